"""Service settings: one parser for the environment, shared by `create_app` and
gunicorn.conf.py, so the app and the server never disagree on a default."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from lmops.errors import LmopsError

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "model"


@dataclass(frozen=True)
class ServiceConfig:
    host: str = "0.0.0.0"
    port: int = 5001
    model_dir: Path = DEFAULT_MODEL_DIR
    model_uri: str | None = None  # e.g. models:/lmops@champion; wins over model_dir
    api_key: str | None = None
    threads: int | None = None  # None: enough for every running and queued request
    timeout: int = 120
    graceful_timeout: int = 30
    max_queued: int = 64
    max_body_bytes: int = 1 << 20
    device: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_memory: int | None = None
    enable_prefix_caching: bool = True
    drift_sample: float = 0.1
    # gunicorn.conf.py sets it: a worker that cannot load its model exits with
    # gunicorn's WORKER_BOOT_ERROR, so the master halts instead of respawning it.
    exit_on_load_failure: bool = False

    @property
    def worker_threads(self) -> int:
        """A thread per running and queued request (plus probes), so a full queue
        answers 429 instead of leaving connections waiting for a thread."""
        return self.threads or self.max_num_seqs + self.max_queued + 8

    def engine_kwargs(self) -> dict:
        return {
            "device": self.device,
            "block_size": self.block_size,
            "kv_cache_memory": self.kv_cache_memory,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "enable_prefix_caching": self.enable_prefix_caching,
            "drift_sample": self.drift_sample,
        }

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ServiceConfig:
        env = os.environ if env is None else env

        def text(name: str) -> str | None:
            value = env.get(name, "").strip()
            return value or None

        def integer(name: str, default: int | None, minimum: int = 1) -> int | None:
            value = text(name)
            if value is None:
                return default
            try:
                number = int(value)
            except ValueError:
                raise LmopsError(f"{name}={value!r} is not an integer") from None
            if number < minimum:
                raise LmopsError(f"{name}={number} must be >= {minimum}")
            return number

        def flag(name: str, default: bool) -> bool:
            value = text(name)
            if value is None:
                return default
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise LmopsError(f"{name}={value!r} is not a boolean (true/false)")

        def fraction(name: str, default: float) -> float:
            value = text(name)
            try:
                number = default if value is None else float(value)
            except ValueError:
                raise LmopsError(f"{name}={value!r} is not a number") from None
            if not 0 <= number <= 1:
                raise LmopsError(f"{name}={value} must be between 0 and 1")
            return number

        d = cls()
        return cls(
            host=text("HOST") or d.host,
            port=integer("PORT", d.port, minimum=0),
            model_dir=Path(text("LMOPS_MODEL_DIR") or d.model_dir),
            model_uri=text("LMOPS_MODEL_URI"),
            api_key=text("LMOPS_API_KEY"),
            threads=integer("LMOPS_THREADS", None),
            timeout=integer("LMOPS_TIMEOUT", d.timeout),
            graceful_timeout=integer("LMOPS_GRACEFUL_TIMEOUT", d.graceful_timeout),
            max_queued=integer("LMOPS_MAX_QUEUED", d.max_queued),
            max_body_bytes=integer("LMOPS_MAX_BODY_BYTES", d.max_body_bytes),
            device=text("LMOPS_DEVICE") or d.device,
            block_size=integer("LMOPS_BLOCK_SIZE", d.block_size),
            max_num_seqs=integer("LMOPS_MAX_NUM_SEQS", d.max_num_seqs),
            max_num_batched_tokens=integer("LMOPS_MAX_NUM_BATCHED_TOKENS", d.max_num_batched_tokens),
            kv_cache_memory=integer("LMOPS_KV_CACHE_MEMORY", None),
            enable_prefix_caching=flag("LMOPS_ENABLE_PREFIX_CACHING", d.enable_prefix_caching),
            drift_sample=fraction("LMOPS_DRIFT_SAMPLE", d.drift_sample),
            exit_on_load_failure=flag("LMOPS_EXIT_ON_LOAD_FAILURE", False),
        )
