#!/usr/bin/env python3
"""Turn a CustomResourceDefinition into the strict JSON schema deploy/validate.py uses.

    python deploy/schemas/import_crd.py CRD.yaml ORIGIN [VERSION] > deploy/schemas/<kind>.json

ORIGIN says where the CRD came from (repository, tag, path). Takes the served
version's openAPIV3Schema (VERSION names it where the CRD serves several), drops the descriptions (most of its size), makes it
strict like `kubectl --validate=strict` (no additional properties wherever the CRD
lists them, except where it preserves unknown fields: the API server would prune
them silently) and pins apiVersion and kind.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml


def strict(schema: Any) -> Any:
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "description" and isinstance(value, str):
            continue
        if key == "properties":  # field names, each to a schema (a field may be named "description")
            out[key] = {name: strict(sub) for name, sub in value.items()}
        else:
            out[key] = strict(value)
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    crd_file, origin, *wanted = argv
    crd = yaml.safe_load(Path(crd_file).read_text())
    served = [v for v in crd["spec"]["versions"] if v.get("served")]
    (version,) = [v for v in served if not wanted or v["name"] == wanted[0]]
    api_version, kind = f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"]
    body = strict(version["schema"]["openAPIV3Schema"])
    body["properties"].update(apiVersion={"const": api_version}, kind={"const": kind})
    body["required"] = sorted({"apiVersion", "kind", "metadata", *body.get("required", [])})
    schema = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": f"{kind} ({api_version})",
        "description": f"openAPIV3Schema of {origin}, made strict by deploy/schemas/import_crd.py.",
        **body,
    }
    print(json.dumps(schema, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
