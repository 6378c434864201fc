"""Where a served model comes from: a local model directory, or the MLflow
registry (`models:/lmops@champion`), downloaded into the model cache; and whether it
moves (`Source`: an alias or an export's `.current` link does, a version number never).

The cache (LMOPS_MODEL_CACHE) holds one directory per model version (`lmops-v3`; a URI
with no registry version, `runs:/...`, by its hash). A restart that finds the version
there loads it without downloading; a download lands in a hidden scratch directory and
is renamed into place whole, so one killed midway leaves nothing that looks complete;
after each resolution every other entry and scratch directory is removed (under a lock,
so two processes sharing the cache do not prune each other's download); the entries a
process still serves (`keep`: the old champion during a swap, the challenger) stay.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lmops.errors import LmopsError
from lmops.runtime.model_dir import CONFIG_FILE, CURRENT, ModelMeta, current, download, read_meta, verify

log = logging.getLogger(__name__)

CHAMPION, CHALLENGER = "champion", "challenger"  # the roles a served model plays
_REGISTRY_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/]+)|/(?P<version>\d+))$")


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    name: str
    version: str | None = None
    run_id: str | None = None
    source: str = ""
    meta: ModelMeta | None = None  # lmops.json; None for a plain HF Llama directory

    @property
    def reference_bits_per_byte(self) -> float | None:
        """Test bits/byte at promotion: the drift signal's baseline."""
        return None if self.meta is None else self.meta.reference_bits_per_byte


@dataclass(frozen=True)
class Source:
    """Where one served model comes from: `model_uri` when set, else `model_dir`."""

    role: str  # CHAMPION or CHALLENGER
    model_dir: Path | None
    model_uri: str | None = None

    def __str__(self) -> str:
        return self.model_uri or str(self.model_dir)

    @property
    def follows(self) -> bool:
        """Whether a new version can appear: a registry alias, or an export (its `.current`
        link); a version pinned by number, a run's URI or a plain directory never moves."""
        if self.model_uri:
            match = _REGISTRY_URI.match(self.model_uri)
            return bool(match and match["alias"])
        return (Path(self.model_dir) / CURRENT).is_symlink()

    def locate(self) -> str:
        """What the source names now, cheaply (no download): the alias's registry version,
        or the version directory the export's link points at."""
        if self.model_uri:
            return str(_registry_facts(self.model_uri)["model_version"])
        return os.readlink(Path(self.model_dir) / CURRENT)

    def located(self, info: ModelInfo) -> str:
        """What `locate` said when `info` was resolved."""
        return str(info.version) if self.model_uri else info.path.name


def default_model_cache() -> Path:
    """$HOME/.cache/lmops/models: in the image HOME is /tmp, the pod's emptyDir, which
    outlives container restarts."""
    return Path.home() / ".cache" / "lmops" / "models"


def resolve_model(
    model_dir: Path, model_uri: str | None = None, cache: Path | None = None, keep: tuple[Path, ...] = ()
) -> ModelInfo:
    """The local directory to load and what is known about it (registry facts win
    over lmops.json, which a plain HF Llama directory does not have). In an export,
    the version its `.current` names: complete whatever step a promote was killed at.
    A download prunes the cache but for `keep`."""
    if model_uri:
        path, registry = _cached_download(model_uri, cache or default_model_cache(), keep)
        name = path.name
    else:
        path, registry, name = current(model_dir), {}, Path(model_dir).name
        if not (path / CONFIG_FILE).is_file():
            raise LmopsError(
                f"{model_dir}: not a model directory (missing {CONFIG_FILE}); "
                "run `make run` to promote one, or set LMOPS_MODEL_DIR / LMOPS_MODEL_URI"
            )
    meta = read_meta(path)  # the weights are verified when the engine loads them
    facts = (
        {}
        if meta is None
        else {"model_name": meta.model_name, "model_version": meta.model_version, "run_id": meta.run_id}
    )
    facts.update(registry)
    version = facts.get("model_version")
    return ModelInfo(
        path=path,
        name=str(facts.get("model_name") or name),
        version=None if version is None else str(version),
        run_id=facts.get("run_id"),
        source=model_uri or str(model_dir),
        meta=meta,
    )


def _cached_download(uri: str, cache: Path, keep: tuple[Path, ...]) -> tuple[Path, dict]:
    """The model `uri` names, from the cache or downloaded into it; the registry facts."""
    from mlflow.exceptions import MlflowException

    try:
        registry = _registry_facts(uri)
    except MlflowException as exc:
        raise LmopsError(f"cannot resolve {uri}: {exc.message}") from None
    version = registry.get("model_version")
    key = (
        f"{registry['model_name']}-v{version}"
        if version
        else "uri-" + hashlib.sha256(uri.encode()).hexdigest()[:16]
    )
    entry = cache / re.sub(r"[^\w.-]", "_", key)
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LmopsError(f"LMOPS_MODEL_CACHE: cannot create {cache} ({exc.strerror})") from None
    with _locked(cache):
        if entry.is_dir():
            try:
                verify(entry)
                log.info("resolved %s to %s (cached)", uri, entry)
            except LmopsError as exc:  # damaged on disk: fetch it again
                log.warning("%s; downloading it again", exc)
                shutil.rmtree(entry)
        if not entry.is_dir():
            scratch = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", suffix=".tmp", dir=cache))
            try:
                os.replace(download(uri, scratch), entry)  # whole, or not at all
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            log.info("resolved %s to %s (downloaded)", uri, entry)
        for other in cache.iterdir():
            if other != entry and other.name != _LOCK and other not in keep:
                log.info("pruning %s from the model cache", other)
                if other.is_dir():
                    shutil.rmtree(other, ignore_errors=True)
                else:
                    other.unlink(missing_ok=True)
    return entry, registry


_LOCK = ".lock"


@contextlib.contextmanager
def _locked(cache: Path) -> Iterator[None]:
    """Held while a process downloads into or prunes `cache`."""
    with open(cache / _LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _registry_facts(uri: str) -> dict:
    """Name, version and run id of a `models:/name@alias` or `models:/name/N` URI."""
    match = _REGISTRY_URI.match(uri)
    if not match:
        return {}
    from mlflow import MlflowClient

    client = MlflowClient()
    if match["alias"]:
        mv = client.get_model_version_by_alias(match["name"], match["alias"])
    else:
        mv = client.get_model_version(match["name"], match["version"])
    return {"model_name": mv.name, "model_version": str(mv.version), "run_id": mv.run_id}
