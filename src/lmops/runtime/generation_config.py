"""generation_config.json, the model's sampling defaults, and its one owner: the file's
name, the defaults training writes into it, and the one merge every door samples from.

`lmops generate`, evaluate's samples, the MLflow pyfunc and the API (a request that sets
no temperature, top_p, top_k or max_tokens) all start from the directory's file, with a
deployment's overrides (LMOPS_GENERATION_CONFIG) on top, as vLLM does with
`--generation-config auto` and `--override-generation-config`. This module gives the
SamplingParams fields that asks for (`default_sampling_fields`); SamplingParams builds
them (`SamplingParams.from_model_dir`), so the dependency runs one way.

Free of torch at import: the service's settings (gunicorn's master) read its keys.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmops.runtime.json_files import read_json_object

GENERATION_FILE = "generation_config.json"
# How a model samples by default, defined once and written into generation_config.json
# (`Llama.save_pretrained`), where HF runtimes read it too.
GENERATION_DEFAULTS = {
    "do_sample": True,
    "temperature": 0.8,
    "top_k": 50,
    "top_p": 0.95,
    "max_new_tokens": 128,
}
# The generation_config.json keys that set sampling defaults (besides do_sample: false =
# greedy), and the SamplingParams field each one sets.
GENERATION_KEYS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "max_new_tokens": "max_tokens",
}
# What a deployment may override (LMOPS_GENERATION_CONFIG).
SAMPLING_KEYS = ("do_sample", *GENERATION_KEYS)


def read_generation_config(directory: str | Path) -> dict:
    """The directory's generation_config.json ({} when it has none)."""
    path = Path(directory) / GENERATION_FILE
    return read_json_object(path, "generation config") if path.is_file() else {}


def default_sampling_fields(directory: str | Path, overrides: dict[str, Any] | None = None) -> dict:
    """The SamplingParams fields the model asks for: its generation_config.json with
    `overrides` (generation-config keys) on top; temperature, top_k, top_p, and
    max_new_tokens as max_tokens; greedy when do_sample is false, as in transformers.
    No generation config at all: no fields, so the engine's defaults (vLLM's: temperature 1)."""
    generation = {**read_generation_config(directory), **(overrides or {})}
    if not generation:
        return {}
    fields = {
        field: generation[key] for key, field in GENERATION_KEYS.items() if generation.get(key) is not None
    }
    if not generation.get("do_sample", False):
        fields["temperature"] = 0.0
    return fields
