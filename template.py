"""Create the working skeleton of an lmops checkout, idempotently.

Makes the directories the pipeline and the service write into and says what it
created. It never overwrites or deletes anything: run it as often as you like.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lmops.pipeline.params import PromoteConfig
from lmops.pipeline.paths import WORK_DIRECTORIES

DIRECTORIES = (
    *WORK_DIRECTORIES,
    Path(PromoteConfig().export_dir),  # the model the service loads, which promote exports
    Path("benchmarks/results"),  # what benchmarks/*.py write
)


def main(root: Path) -> list[Path]:
    created = []
    for rel in DIRECTORIES:
        path = root / rel
        if not path.is_dir():
            path.mkdir(parents=True)
            created.append(path)
    return created


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent
    made = main(root)
    for path in made:
        print(f"created {path.relative_to(root)}/")
    print(f"skeleton ready: {len(made)} created, {len(DIRECTORIES) - len(made)} already there")
