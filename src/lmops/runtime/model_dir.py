"""The model directory, the one thing that crosses from the pipeline to the runtime, and its
one owner: its files, the typed `lmops.json`, writing, reading, verifying, exporting and
downloading it (generation_config.json's sampling defaults: lmops.runtime.generation_config).

The layout is Hugging Face's Llama one (`config.json`, `model.safetensors`,
`generation_config.json`, `tokenizer.json`, `tokenizer_config.json`), so transformers and
other Llama runtimes load it unchanged, plus `lmops.json`: where the model came from and
how good it is. `lmops.json` is optional (a plain HF Llama directory serves), but one that
is there and unreadable is an error naming it, like any other corrupt model file.

Free of torch at import: the pipeline's light stages and the service's master read it.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lmops import atomic, crash_points
from lmops.errors import LmopsError
from lmops.runtime.generation_config import GENERATION_FILE, read_generation_config
from lmops.runtime.json_files import read_json_object

if TYPE_CHECKING:
    from lmops.runtime.model import Llama

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
TOKENIZER_FILES = ("tokenizer.json", TOKENIZER_CONFIG_FILE)
# Where transformers (>= 4.43) saves a chat template; older directories keep it as
# tokenizer_config.json's "chat_template", which the pipeline writes.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
META_FILE = "lmops.json"
MODEL_FILES = (CONFIG_FILE, WEIGHTS_FILE, GENERATION_FILE, *TOKENIZER_FILES)
# An export (production_service/model) holds versions `.v-<hex>/` and the link `.current`
# to the one it serves (see `export`).
CURRENT = ".current"
VERSION_PREFIX = ".v-"

META_VERSION = 1
Metric = float | int | str | None


class ModelMeta(BaseModel):
    """`lmops.json`, version 1: written by training, completed by promotion's export."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Annotated[int, Field(ge=1, le=META_VERSION)] = META_VERSION
    run_id: str | None = None  # the MLflow training run
    data_sha256: str | None = None  # the corpus the model was trained on (data/raw/manifest.json)
    git_commit: str | None = None
    num_params: int | None = None
    stop_reason: str | None = None
    # train_loss, val_loss, exported_step, ... from training; test_* from evaluation at
    # promotion; `test_bits_per_byte` is the drift signal's reference.
    metrics: dict[str, Metric] = Field(default_factory=dict)
    weights_sha256: str | None = None  # of model.safetensors, checked at every load
    # Registry facts, set by the export: what production_service/model holds.
    model_name: str | None = None
    model_version: int | None = None
    model_uri: str | None = None  # when fetched by URI (deploy/fetch_model.sh)

    @property
    def reference_bits_per_byte(self) -> float | None:
        """The test bits/byte promotion compared (the drift alert's baseline), if known."""
        value = self.metrics.get("test_bits_per_byte")
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            return None
        return float(value)


def read_meta(directory: str | Path) -> ModelMeta | None:
    """The directory's lmops.json; None when it has none (a plain HF Llama directory)."""
    path = Path(directory) / META_FILE
    if not path.is_file():
        return None
    raw = read_json_object(path, "lmops.json")
    try:
        return ModelMeta.model_validate(raw)
    except ValidationError as exc:
        raise LmopsError(f"{path}: {meta_problem(exc, raw)}") from None


def meta_problem(exc: ValidationError, raw: dict) -> str:
    """The first thing wrong with an lmops.json, in words."""
    error = exc.errors(include_url=False)[0]
    where = ".".join(map(str, error["loc"])) or META_FILE
    if error["type"] == "extra_forbidden":
        return f"unknown key {where!r} ({META_FILE} version {META_VERSION})"
    if where == "schema_version" and error["type"] == "less_than_equal":
        return (
            f"schema_version {raw['schema_version']} was written by a newer lmops "
            f"(this one reads version {META_VERSION})"
        )
    return f"invalid {where} ({error['msg']})"


def require_meta(directory: str | Path) -> ModelMeta:
    """lmops.json of a directory the pipeline trained (evaluate and promote need its run)."""
    meta = read_meta(directory)
    if meta is None:
        raise LmopsError(f"{directory}: not a trained lmops model directory, missing {META_FILE}")
    return meta


def write_meta(directory: Path, meta: ModelMeta) -> None:
    text = meta.model_dump_json(indent=2, exclude_none=True)
    (directory / META_FILE).write_text(text + "\n", encoding="utf-8")


def read_chat_template(directory: str | Path) -> str | None:
    """The directory's chat template (chat_template.jinja, else tokenizer_config.json's
    "chat_template"); None when it has none."""
    directory = Path(directory)
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        return (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    template = read_tokenizer_config(directory).get("chat_template")
    if template is not None and not isinstance(template, str):
        raise LmopsError(
            f"{Path(directory) / TOKENIZER_CONFIG_FILE}: chat_template must be a string (one template)"
        )
    return template


def read_tokenizer_config(directory: str | Path) -> dict:
    """tokenizer_config.json ({} when there is none)."""
    path = Path(directory) / TOKENIZER_CONFIG_FILE
    return read_json_object(path, "tokenizer config") if path.is_file() else {}


def special_tokens(directory: str | Path) -> dict[str, str]:
    """The special tokens a chat template sees (bos_token, eos_token, ...), as transformers
    passes them: tokenizer_config.json's, as strings."""
    config = read_tokenizer_config(directory)
    out = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value  # an AddedToken's form
        if isinstance(value, str):
            out[key] = value
    return out


def eos_token_ids(directory: str | Path, config_eos: int | None) -> list[int]:
    """Every id that ends generation: config.json's and generation_config.json's (either may be a list)."""
    ids = set() if config_eos is None else {config_eos}
    for source in (
        read_json_object(Path(directory) / CONFIG_FILE, "model config"),
        read_generation_config(directory),
    ):
        value = source.get("eos_token_id")
        ids |= set(value if isinstance(value, list) else [] if value is None else [value])
    return sorted(i for i in ids if isinstance(i, int) and not isinstance(i, bool))


def weights_digest(directory: str | Path) -> str:
    digest = hashlib.sha256()
    with open(Path(directory) / WEIGHTS_FILE, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify(directory: str | Path) -> ModelMeta | None:
    """Check what can be checked before loading (`Llama.from_pretrained` does it first): the
    network's files are there, generation_config.json and lmops.json (both optional) are
    valid, and the weights are the ones lmops.json recorded. Returns lmops.json."""
    directory = Path(directory)
    if not directory.is_dir():
        raise LmopsError(f"{directory}: model directory not found")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (directory / name).is_file():
            raise LmopsError(f"{directory}: not a model directory, missing {name}")
    read_generation_config(directory)
    meta = read_meta(directory)
    if meta is not None and meta.weights_sha256 and weights_digest(directory) != meta.weights_sha256:
        raise LmopsError(
            f"{directory / WEIGHTS_FILE}: corrupt weights file (its sha256 is not the "
            f"weights_sha256 that {META_FILE} recorded at export)"
        )
    return meta


def write_model_dir(model: Llama, tokenizer_dir: Path, directory: Path, meta: ModelMeta) -> None:
    """The whole directory from a model and a tokenizer directory, atomically: the model's
    files (`Llama.save_pretrained`), the tokenizer's, and `meta` with the weights' digest
    as lmops.json."""
    for name in TOKENIZER_FILES:
        if not (tokenizer_dir / name).is_file():
            raise LmopsError(f"{tokenizer_dir / name} not found: run `lmops tokenize` first")
    with atomic.directory(directory) as tmp:
        model.save_pretrained(tmp)
        for name in TOKENIZER_FILES:
            shutil.copyfile(tokenizer_dir / name, tmp / name)
        write_meta(tmp, meta.model_copy(update={"weights_sha256": weights_digest(tmp)}))
        missing = [f for f in MODEL_FILES if not (tmp / f).is_file()]
        assert not missing, f"model directory incomplete: {missing}"


def export(source: Path, target: Path, extra_files: dict[str, str] | None = None, **facts) -> ModelMeta:
    """Copy the model directory `source` into the export `target`, `facts` (registry name,
    version, metrics, ...) merged into its lmops.json; a plain HF directory gets one.
    `extra_files` (name -> text: promotion's README.md model card) are written into the
    version with the model's files, so they change with it in the one flip.

    `target` itself is never replaced, so a bind mount of it (docker-compose's) keeps
    seeing every export. The files go to a new hidden version directory inside it,
    `.v-<hex>`, and the symlink `.current` is flipped to it in one rename; the
    top-level names (`config.json`, ...) are fixed links to `.current/<name>`, so HF
    readers see the layout unchanged and the service reads one version through
    `current()`. A process killed at any step leaves `.current` naming a complete
    version; the next export or `lmops promote` tidies the rest (`tidy`).

    Contents only (`copyfile`, not `copytree`'s copy of modes): the export gets the
    ordinary modes of the umask even when the source (a private temporary download,
    an older export) is 0600/0700, so a container user can read a baked-in model.
    """
    meta = verify(current(source)) or ModelMeta()
    if "metrics" in facts:
        facts["metrics"] = {**meta.metrics, **facts["metrics"]}
    raw = {**meta.model_dump(), **facts}
    try:
        merged = ModelMeta.model_validate(raw)
    except ValidationError as exc:
        raise LmopsError(f"cannot export {source} to {target}: {meta_problem(exc, raw)}") from None
    target.mkdir(parents=True, exist_ok=True)
    tidy(target)
    staging = target / f".staging.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    staging.mkdir()  # mode 0o777 minus the umask
    for src in current(source).iterdir():
        if src.is_file() and src.name != META_FILE:
            shutil.copyfile(src, staging / src.name)
    for name, text in (extra_files or {}).items():
        (staging / name).write_text(text, encoding="utf-8")
    if not merged.weights_sha256:
        merged = merged.model_copy(update={"weights_sha256": weights_digest(staging)})
    write_meta(staging, merged)
    crash_points.reached("export.staged")
    version = target / f".v-{secrets.token_hex(6)}"
    os.rename(staging, version)
    crash_points.reached("export.version_in_place")
    _link(target / CURRENT, version.name)
    crash_points.reached("export.flipped")
    tidy(target)
    return merged


def current(directory: str | Path) -> Path:
    """Where to read a model from: in an export, the version `.current` names, resolved
    once, so a reader never mixes two versions' files; any other directory as it is."""
    link = Path(directory) / CURRENT
    return link.resolve() if link.is_symlink() else Path(directory)


def tidy(target: Path) -> None:
    """Finish what an export killed midway left in `target`: link every file of the
    current version at the top level, and remove everything else (staging and
    superseded version directories, names the current version lacks, and
    atomic.directory's leftovers beside `target` from before the versioned layout)."""
    link = target / CURRENT
    live = os.readlink(link) if link.is_symlink() else None
    for entry in target.iterdir():
        leftover = entry.name.endswith(".tmp") or entry.name.startswith(VERSION_PREFIX)
        stale = live is not None and not entry.name.startswith(".") and not (link / entry.name).is_file()
        if entry.name not in (CURRENT, live) and (leftover or stale):
            _remove(entry)
    if live is not None and link.is_dir():
        for src in link.iterdir():
            name, want = target / src.name, f"{CURRENT}/{src.name}"
            if not (name.is_symlink() and os.readlink(name) == want):
                _link(name, want)
    for leftover in target.parent.glob(f".{target.name}.*"):
        if leftover.name.endswith(".tmp") or leftover.name == f".{target.name}.old":
            _remove(leftover)


def _link(path: Path, to: str) -> None:
    """Point `path` at `to` in one rename (readers see the old link or the new one)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    os.symlink(to, tmp)
    os.replace(tmp, path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def download(model_uri: str, dst: Path) -> Path:
    """Download a logged model (`models:/name@alias`, `models:/name/N`, `runs:/...`) with the
    MLflow client into `dst`; return the model directory inside it."""
    import mlflow.artifacts  # lazily: ~2 s, and only a registry download needs it
    from mlflow.exceptions import MlflowException

    try:
        root = Path(mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=str(dst)))
    except MlflowException as exc:
        raise LmopsError(f"could not download {model_uri}: {exc.message}") from None
    for config in sorted(root.rglob(CONFIG_FILE)):
        if (config.parent / WEIGHTS_FILE).is_file():
            return config.parent
    raise LmopsError(f"{model_uri} holds no model directory (no {CONFIG_FILE} + {WEIGHTS_FILE})")
