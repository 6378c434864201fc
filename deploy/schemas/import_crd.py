#!/usr/bin/env python3
"""Store a CustomResourceDefinition's schema for deploy/validate.py.

    python deploy/schemas/import_crd.py CRD.yaml SOURCE_URL COMMIT > deploy/schemas/<kind>.json

Keeps the served version's openAPIV3Schema as the CRD ships it, without the
descriptions (most of its size), and records where it came from. validate.py
makes it strict when it loads it (an unknown field is an error, not pruned).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml


def without_descriptions(node: Any) -> Any:
    if isinstance(node, dict):
        # A property may be *named* description; only the schema keyword (a string) goes.
        return {
            k: without_descriptions(v)
            for k, v in node.items()
            if not (k == "description" and isinstance(v, str))
        }
    if isinstance(node, list):
        return [without_descriptions(v) for v in node]
    return node


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    crd_file, source, commit = argv
    crd = yaml.safe_load(Path(crd_file).read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v.get("served")]
    stored = {
        "source": source,
        "commit": commit,
        "apiVersion": f"{crd['spec']['group']}/{version['name']}",
        "kind": crd["spec"]["names"]["kind"],
        "openAPIV3Schema": without_descriptions(version["schema"]["openAPIV3Schema"]),
    }
    print(json.dumps(stored, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
