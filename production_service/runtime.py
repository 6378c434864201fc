"""The engine's life in the worker: load in the background (so /health answers
and /ready says 503 meanwhile), warm up, serve, drain on shutdown."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING

from lmops.runtime.chat_template import compile_template
from lmops.runtime.model_dir import read_chat_template, special_tokens
from production_service import faults
from production_service.model_source import ModelInfo, resolve_model
from production_service.schemas import Limits
from production_service.settings import ServiceConfig

if TYPE_CHECKING:
    from lmops.runtime.engine.sampling import SamplingParams

log = logging.getLogger(__name__)

WARMUP_PROMPT = "def add(a, b):"
WORKER_BOOT_ERROR = 3  # gunicorn's exit status for "worker failed to boot": the master halts


class Runtime:
    """States: loading -> ready -> draining -> stopped, or loading -> failed."""

    def __init__(self, config: ServiceConfig):
        self.config = config
        self.state = "loading"
        self.error: str | None = None
        self.engine = None
        self.loop = None
        self.model: ModelInfo | None = None
        self.limits: Limits | None = None
        # Request defaults: the model's generation_config.json, LMOPS_GENERATION_CONFIG on top.
        self.sampling_defaults: SamplingParams | None = None
        # /v1/chat/completions: the model's chat template (or LMOPS_CHAT_TEMPLATE's file), None if neither.
        self.chat_template: str | None = None
        self.special_tokens: dict[str, str] = {}
        self.created = int(time.time())
        self._ready = threading.Event()
        self._lock = threading.Lock()

    def start(self) -> None:
        threading.Thread(target=self._load, name="lmops-model-loader", daemon=True).start()

    def wait_ready(self, timeout: float) -> bool:
        return self._ready.wait(timeout)

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def healthy(self) -> bool:
        """Alive while loading; once serving, only if the engine loop is not stuck."""
        if self.state == "failed":
            return False
        return self.loop is None or self.loop.healthy()

    def _load(self) -> None:
        from lmops.runtime.engine import EngineLoop, LLMEngine, SamplingParams

        try:
            model = resolve_model(self.config.model_dir, self.config.model_uri, self.config.model_cache)
            # built once, so an invalid file or LMOPS_GENERATION_CONFIG fails the load
            sampling_defaults = SamplingParams.from_model_dir(model.path, self.config.generation_config)
            path = self.config.chat_template
            chat_template = path.read_text(encoding="utf-8") if path else read_chat_template(model.path)
            if chat_template is not None:
                compile_template(chat_template)  # a template that does not parse fails the load
            engine = LLMEngine.from_pretrained(model.path, self.config.engine)
            engine.generate([WARMUP_PROMPT], SamplingParams(temperature=0, max_tokens=8))
            engine.reset_metrics()  # the warm-up is not a request anyone made
            loop = EngineLoop(engine, max_queued=self.config.max_queued)
            faults.inject(engine, loop)  # LMOPS_FAULT_*: off unless set
        except Exception as exc:  # any failure to load is fatal: one clear line, no traceback
            self.error = f"cannot load the model from {self.config.model_uri or self.config.model_dir}: {exc}"
            log.error(self.error)
            self.state = "failed"
            if self.config.exit_on_load_failure:
                logging.shutdown()
                os._exit(WORKER_BOOT_ERROR)
            return
        with self._lock:
            if self.state != "loading":  # shut down while loading
                return
            loop.start()
            self.engine, self.loop, self.model = engine, loop, model
            self.sampling_defaults = sampling_defaults
            self.chat_template, self.special_tokens = chat_template, special_tokens(model.path)
            self.limits = Limits(
                max_model_len=engine.max_model_len,
                vocab_size=engine.model_config.vocab_size,
                max_num_seqs=engine.max_num_seqs,
                max_token_chars=max(map(len, engine.tokenizer.get_vocab())),
                priority_scheduling=engine.engine_config.scheduling_policy == "priority",
            )
            self.created = int(time.time())
            self.state = "ready"
        if model.reference_bits_per_byte is None:
            log.warning(
                "%s: no reference bits/byte (lmops.json's metrics.test_bits_per_byte, which "
                "promotion writes): lmops:model_reference_bits_per_byte is not exported, so the "
                "drift alert has nothing to compare with",
                model.path,
            )
        else:
            engine.metrics.set_reference_bits_per_byte(model.reference_bits_per_byte)
        log.info(
            "serving %s (version %s, run %s) from %s", model.name, model.version, model.run_id, model.path
        )
        self._ready.set()

    def shutdown(self, timeout: float) -> None:
        """Refuse new work now; let in-flight requests finish within `timeout`, abort the rest."""
        with self._lock:
            if self.state in ("draining", "stopped"):
                return
            self.state = "draining"
            loop = self.loop
        if loop is not None:
            loop.shutdown(timeout)
        self.state = "stopped"
        log.info("engine stopped")
