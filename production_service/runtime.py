"""The engines' life in the worker: load in the background (so /health answers and
/ready says 503 meanwhile), warm up, serve, swap a new version in (follow.py), drain on
shutdown.

Each model serves as a `Served`: its engine and loop and what requests need of it. A
request pins the one it uses (`Runtime.pin`) for its whole life, a stream to its last
event, so a swap never mixes two models in one answer: the new version takes the
requests that arrive after the switch, and the old one is freed once its last request
is done.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from lmops.errors import LmopsError
from lmops.runtime.chat_template import compile_template
from lmops.runtime.model_dir import read_chat_template, special_tokens
from production_service import faults
from production_service.follow import Follower
from production_service.model_source import CHALLENGER, CHAMPION, ModelInfo, Source, resolve_model
from production_service.observability import ModelMetrics
from production_service.schemas import Limits
from production_service.settings import ServiceConfig
from production_service.shadow import Shadow

if TYPE_CHECKING:
    from lmops.runtime.engine import EngineLoop, LLMEngine
    from lmops.runtime.engine.kv_events import ZmqEventPublisher
    from lmops.runtime.engine.sampling import SamplingParams

log = logging.getLogger(__name__)

WARMUP_PROMPT = "def add(a, b):"
WORKER_BOOT_ERROR = 3  # gunicorn's exit status for "worker failed to boot": the master halts


@dataclass(eq=False)
class Served:
    """One loaded model and what a request needs of it; `users` counts the requests
    pinned to it."""

    role: str
    id: str  # what requests name in `model`: the model's name, `<name>@challenger` for the challenger
    model: ModelInfo
    engine: LLMEngine
    loop: EngineLoop
    limits: Limits
    # Request defaults: the model's generation_config.json, LMOPS_GENERATION_CONFIG on top.
    sampling_defaults: SamplingParams
    # /v1/chat/completions: the model's chat template (or LMOPS_CHAT_TEMPLATE's file), None if neither.
    chat_template: str | None
    special_tokens: dict[str, str]
    created: int = field(default_factory=lambda: int(time.time()))
    users: int = 0
    _idle: threading.Condition = field(default_factory=threading.Condition, repr=False)

    def acquire(self) -> None:
        with self._idle:
            self.users += 1

    def release(self) -> None:
        with self._idle:
            self.users -= 1
            self._idle.notify_all()

    def retire(self, timeout: float) -> None:
        """Once its pinned requests are done (or `timeout` s have passed: what is left is
        aborted), stop the loop and let the engine's memory go."""
        with self._idle:
            self._idle.wait_for(lambda: self.users == 0, timeout)
        self.loop.shutdown(timeout=1.0)
        log.info("retired %s version %s (%s)", self.id, self.model.version, self.model.path)


class Runtime:
    """States: loading -> ready -> draining -> stopped, or loading -> failed."""

    def __init__(self, config: ServiceConfig):
        self.config = config
        self.state = "loading"
        self.error: str | None = None
        self.sources = {CHAMPION: Source(CHAMPION, config.model_dir, config.model_uri)}
        if config.challenger_uri or config.challenger_dir:
            self.sources[CHALLENGER] = Source(CHALLENGER, config.challenger_dir, config.challenger_uri)
        self.served: dict[str, Served] = {}
        self.metrics = ModelMetrics()
        self.shadow: Shadow | None = None
        # The champion's KV-cache events (LMOPS_KV_EVENTS_CONFIG): one publisher for the
        # replica, which each champion version publishes through in turn (the endpoint binds once).
        self.kv_events: ZmqEventPublisher | None = None
        self.stopping = threading.Event()
        self._ready = threading.Event()
        self._lock = threading.Lock()

    def start(self) -> None:
        threading.Thread(target=self._load, name="lmops-model-loader", daemon=True).start()

    def wait_ready(self, timeout: float) -> bool:
        return self._ready.wait(timeout)

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def champion(self) -> Served | None:
        return self.served.get(CHAMPION)

    @property
    def engine(self) -> LLMEngine | None:
        return None if self.champion is None else self.champion.engine

    @property
    def loop(self) -> EngineLoop | None:
        return None if self.champion is None else self.champion.loop

    @property
    def limits(self) -> Limits | None:
        return None if self.champion is None else self.champion.limits

    def healthy(self) -> bool:
        """Alive while loading; once serving, only if no engine loop is stuck."""
        if self.state == "failed":
            return False
        return all(s.loop.healthy() for s in list(self.served.values()))

    def pin(self, model_id: str | None, role: str = CHAMPION) -> Served | None:
        """The model a request names (`role`'s when it names none), held for the request
        until `Served.release`; None when no model has that id."""
        with self._lock:
            if model_id is None:
                served = self.served.get(role)
            else:
                served = next((s for s in self.served.values() if s.id == model_id), None)
            if served is not None:
                served.acquire()
            return served

    def _load(self) -> None:
        from lmops.runtime.engine.kv_events import make_publisher

        try:
            served = {}
            self.kv_events = make_publisher(self.config.engine.kv_events_config)
            for role, source in self.sources.items():
                served[role] = self._build(source, keep=tuple(s.model.path for s in served.values()))
            self._check_headroom(served)
        except Exception as exc:  # any failure to load is fatal: one clear line, no traceback
            from_source = isinstance(exc, _LoadError)
            self.error = f"cannot load the model from {exc.source}: {exc}" if from_source else str(exc)
            log.error(self.error)
            self.state = "failed"
            for s in served.values():
                s.loop.shutdown(0)
            self._close_kv_events()
            if self.config.exit_on_load_failure:
                logging.shutdown()
                os._exit(WORKER_BOOT_ERROR)
            return
        with self._lock:
            if self.state != "loading":  # shut down while loading
                for s in served.values():
                    s.loop.shutdown(0)
                self._close_kv_events()
                return
            self.served = served
            self.state = "ready"
        for s in served.values():
            self.metrics.serving(s.role, s.model.name, s.model.version)
        if self.config.shadow_share > 0:
            self.shadow = Shadow(self, self.config.shadow_share)
        if self._following():
            Follower(self).start()
        self._ready.set()

    def _following(self) -> bool:
        return self.config.model_poll_s > 0 and any(s.follows for s in self.sources.values())

    def _build(self, source: Source, keep: tuple = ()) -> Served:
        """Resolve, verify (weights checksum, finite weights: Llama.from_pretrained), load and
        warm up `source`'s model, its loop started; a failure is a `_LoadError` naming the source."""
        from lmops.runtime.engine import EngineLoop, SamplingParams

        try:
            model = resolve_model(source.model_dir, source.model_uri, self.config.model_cache, keep)
            # built once, so an invalid file or LMOPS_GENERATION_CONFIG fails the load
            sampling_defaults = SamplingParams.from_model_dir(model.path, self.config.generation_config)
            path = self.config.chat_template
            chat_template = path.read_text(encoding="utf-8") if path else read_chat_template(model.path)
            if chat_template is not None:
                compile_template(chat_template)  # a template that does not parse fails the load
            engine = self._engine(source.role, model.path)
            engine.generate([WARMUP_PROMPT], SamplingParams(temperature=0, max_tokens=8))
            engine.reset_metrics()  # the warm-up is not a request anyone made
            loop = EngineLoop(engine, max_queued=self.config.max_queued)
            faults.inject(engine, loop)  # LMOPS_FAULT_*: off unless set
        except Exception as exc:
            raise _LoadError(source, exc) from None
        if model.reference_bits_per_byte is None:
            log.warning(
                "%s: no reference bits/byte (lmops.json's metrics.test_bits_per_byte, which "
                "promotion writes): lmops:model_reference_bits_per_byte is not exported, so the "
                "drift alert has nothing to compare with",
                model.path,
            )
        else:
            engine.metrics.set_reference_bits_per_byte(model.reference_bits_per_byte)
        loop.start()
        log.info(
            "serving %s as %s (version %s, run %s) from %s",
            model.name,
            source.role,
            model.version,
            model.run_id,
            model.path,
        )
        return Served(
            role=source.role,
            id=model.name if source.role == CHAMPION else f"{model.name}@{source.role}",
            model=model,
            engine=engine,
            loop=loop,
            limits=Limits(
                max_model_len=engine.max_model_len,
                vocab_size=engine.model_config.vocab_size,
                max_num_seqs=engine.max_num_seqs,
                max_token_chars=max(map(len, engine.tokenizer.get_vocab())),
                priority_scheduling=engine.engine_config.scheduling_policy == "priority",
            ),
            sampling_defaults=sampling_defaults,
            chat_template=chat_template,
            special_tokens=special_tokens(model.path),
        )

    def _engine(self, role: str, path) -> LLMEngine:
        """The champion publishes KV-cache events through the replica's publisher; the
        challenger none (llm-d routes to the champion's cache)."""
        from lmops.runtime.engine import LLMEngine

        if role == CHAMPION:
            return LLMEngine.from_pretrained(path, self.config.engine, kv_events=self.kv_events)
        return LLMEngine.from_pretrained(path, replace(self.config.engine, kv_events_config=None))

    def _close_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None

    def _check_headroom(self, served: dict[str, Served]) -> None:
        """State the memory the models take and what a swap needs beside them (the largest
        of them, loaded before the old one goes); a challenger that leaves no room for that
        fails the start, a following champion alone only warns (a swap that cannot load is
        refused, and the old version keeps serving)."""
        from lmops.runtime.engine.engine import free_memory

        following = self._following()
        if not following and len(served) == 1:
            return
        sizes = {role: s.engine.memory_bytes for role, s in served.items()}
        free = free_memory(served[CHAMPION].engine.device)
        need = max(sizes.values()) if following else 0
        log.info(
            "memory: %s; a swap loads up to %.0f MiB beside them; %.0f MiB free",
            ", ".join(
                f"{role} {size / 2**20:.0f} MiB (weights and KV cache)" for role, size in sizes.items()
            ),
            need / 2**20,
            free / 2**20,
        )
        if free >= need:
            return
        problem = (
            f"{free / 2**20:.0f} MiB free after loading the models, and a swap needs "
            f"{need / 2**20:.0f} MiB beside them"
        )
        if CHALLENGER in served:
            raise LmopsError(
                f"not enough memory for a champion and a challenger that follow their sources: {problem}; "
                "give the replica more memory, set LMOPS_KV_CACHE_MEMORY lower, or drop the challenger"
            )
        log.warning(
            "%s: a swap may fail to load (it is then refused and this version keeps serving)", problem
        )

    def swap(self, source: Source, target: str) -> bool:
        """Load `source`'s new version (`target`, what `Source.locate` said) beside the one
        serving, switch new requests to it and retire the old one; on any failure the old
        one keeps serving and the swap is counted as refused. Whether it swapped."""
        old = self.served[source.role]
        keep = tuple(s.model.path for s in self.served.values())
        started = time.monotonic()
        try:
            new = self._build(source, keep)
        except _LoadError as exc:
            self.metrics.refused.labels(source.role).inc()
            log.error(
                "refused %s's new version %s: %s; version %s keeps serving",
                source,
                target,
                exc,
                old.model.version,
            )
            return False
        with self._lock:
            if self.state != "ready":  # shutting down meanwhile
                new.loop.shutdown(0)
                return False
            self.served[source.role] = new
        if source.role == CHAMPION and self.kv_events is not None:
            # A router hears of the new version's cache alone from here on: the old engine
            # falls silent, and what it announced is cleared.
            from lmops.runtime.engine.kv_events import AllBlocksCleared

            old.engine.stop_publishing()
            self.kv_events.publish([AllBlocksCleared()])
        self.metrics.serving(source.role, new.model.name, new.model.version)
        self.metrics.swaps.labels(source.role).inc()
        log.info(
            "swapped %s from version %s to %s in %.1f s (the old one finishes its %d requests)",
            source,
            old.model.version,
            new.model.version,
            time.monotonic() - started,
            old.users,
        )
        threading.Thread(
            target=_retire, args=([old], self.config.timeout), name="lmops-retire", daemon=True
        ).start()
        return True

    def shutdown(self, timeout: float) -> None:
        """Refuse new work now; let in-flight requests finish within `timeout`, abort the rest."""
        with self._lock:
            if self.state in ("draining", "stopped"):
                return
            self.state = "draining"
            served = list(self.served.values())
        self.stopping.set()
        drains = [threading.Thread(target=s.loop.shutdown, args=(timeout,)) for s in served]
        for drain in drains:  # the loops drain side by side
            drain.start()
        for drain in drains:
            drain.join()
        self._close_kv_events()
        self.state = "stopped"
        log.info("engine stopped")


class _LoadError(LmopsError):
    """A model that could not be loaded, with the source it came from."""

    def __init__(self, source: Source, cause: Exception):
        super().__init__(str(cause))
        self.source = source


def _retire(retiring: list[Served], timeout: float) -> None:
    """`retiring` holds the one reference the thread has (a Thread keeps its args until its
    target returns, which would keep the engine alive past the collection below)."""
    served = retiring.pop()
    served.retire(timeout)
    del served
    gc.collect()  # the engine's tensors, now unreferenced, go back to the allocator
    if _LIBC is not None:
        _LIBC.malloc_trim(0)  # and the allocator's free pages to the system, swap after swap


# glibc's, to hand freed heap pages back after a swap (None elsewhere: musl, macOS)
_LIBC = ctypes.CDLL(None) if hasattr(ctypes.CDLL(None), "malloc_trim") else None
