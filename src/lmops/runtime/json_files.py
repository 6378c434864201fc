"""Reading the model directory's JSON files, one error line naming the file when one is
unreadable. A leaf (no project imports but the error type), so both the directory's owner
(model_dir) and the generation config's (generation_config) read through it."""

from __future__ import annotations

import json
from pathlib import Path

from lmops.errors import LmopsError


def read_json_object(path: Path, what: str) -> dict:
    """A JSON object from `path`, or one line naming the file and what is wrong."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LmopsError(f"{path}: unreadable {what} ({exc})") from None
    if not isinstance(value, dict):
        raise LmopsError(f"{path}: unreadable {what} (not a JSON object)")
    return value
