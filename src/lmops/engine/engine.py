"""`LLMEngine` (add_request / step / abort / generate) and `EngineLoop`, its thread-safe front.

The engine is single-threaded by design: one owner calls `step()`. The service shares
it through `EngineLoop`, whose background thread is that owner; other threads only
`submit` (validated synchronously, so bad input fails in the caller) and read streams.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import threading
from collections import deque
from pathlib import Path

import torch
from tokenizers import Tokenizer

from lmops.engine.kv_cache import BlockManager, KVPool
from lmops.engine.metrics import EngineMetrics, now
from lmops.engine.runner import ModelRunner
from lmops.engine.sampling import SamplingParams, sample
from lmops.engine.scheduler import Scheduler
from lmops.engine.sequence import (
    IncrementalDetokenizer,
    Request,
    RequestOutput,
    Sequence,
    Status,
    make_output,
)
from lmops.errors import LmopsError
from lmops.model import Llama, default_dtype, resolve_device
from lmops.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PromptTooLongError(ValueError):
    """The prompt leaves no room for a generated token within the model's context."""


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the caller should retry later (HTTP 429/503)."""


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


class LLMEngine:
    def __init__(self, model: Llama, tokenizer: Tokenizer, *, block_size: int = 16,
                 kv_cache_memory: int | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True,
                 eos_token_ids: list[int] | None = None):
        cfg = model.config
        self.model, self.tokenizer, self.config = model.eval(), tokenizer, cfg
        self.max_model_len = cfg.block_size
        self.block_size = _positive_int("block_size", block_size)
        self.max_num_seqs = _positive_int("max_num_seqs", max_num_seqs)
        self.max_num_batched_tokens = _positive_int("max_num_batched_tokens", max_num_batched_tokens)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.eos_token_ids = frozenset(eos_token_ids if eos_token_ids is not None else [cfg.eos_token_id])
        num_blocks = self._num_blocks(kv_cache_memory)
        self.pool = KVPool(cfg, num_blocks, block_size, self.device, self.dtype)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens)
        self.runner = ModelRunner(model, self.pool)
        self.metrics = EngineMetrics()
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        log.info("engine: %d KV blocks of %d tokens (%.1f MiB), device %s, %s", num_blocks,
                 block_size, self.pool.nbytes / 2**20, self.device, self.dtype)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, device: str = "auto", dtype: str | torch.dtype = "auto",
                        **kwargs) -> LLMEngine:
        """Load a model directory (config.json, model.safetensors, tokenizer.json, ...)."""
        d = Path(model_dir)
        if not d.is_dir():
            raise LmopsError(f"{d}: model directory not found")
        dev = resolve_device(device)
        if dtype == "auto":
            dt = default_dtype(dev)
        elif isinstance(dtype, torch.dtype):
            dt = dtype
        elif dtype in _DTYPES:
            dt = _DTYPES[dtype]
        else:
            raise LmopsError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
        tokenizer = load_tokenizer(d)
        model = Llama.from_pretrained(d, dev, dt)
        eos = {model.config.eos_token_id}
        gen_cfg = d / "generation_config.json"
        if gen_cfg.is_file():
            value = json.loads(gen_cfg.read_text()).get("eos_token_id")
            eos |= set(value if isinstance(value, list) else [] if value is None else [value])
        return cls(model, tokenizer, eos_token_ids=sorted(eos), **kwargs)

    def _num_blocks(self, kv_cache_memory: int | None) -> int:
        per_block = KVPool.bytes_per_block(self.config, self.block_size, self.dtype)
        min_blocks = -(-self.max_model_len // self.block_size)
        if kv_cache_memory is None:
            # Room for max_num_seqs full-length sequences, twice over (the spare blocks keep
            # prefixes cached), within a share of the memory that is actually free.
            want = 2 * self.max_num_seqs * min_blocks * per_block
            if self.device.type == "cuda":
                cap = int(0.8 * torch.cuda.mem_get_info(self.device)[0])
            else:
                cap = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
            kv_cache_memory = max(min(want, cap), min_blocks * per_block)
        num_blocks = int(kv_cache_memory) // per_block
        if num_blocks < min_blocks:
            raise LmopsError(f"kv_cache_memory={kv_cache_memory} bytes holds {num_blocks} blocks; one "
                             f"{self.max_model_len}-token sequence needs {min_blocks} blocks of "
                             f"{per_block} bytes, so at least {min_blocks * per_block} bytes")
        return num_blocks

    # -- requests ----------------------------------------------------------------------

    def make_request(self, request_id: str | None, prompt: str | list[int],
                     params: SamplingParams | None = None) -> Request:
        """Validate and tokenize (touches no engine state, so any thread may call it)."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            text, ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=False).ids
        else:
            text, ids = None, list(prompt)
            vocab = self.config.vocab_size
            if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if not ids:
            raise ValueError("prompt must not be empty")
        limit = self.max_model_len - 1
        if len(ids) > limit:
            raise PromptTooLongError(f"prompt is {len(ids)} tokens; this model's context is "
                                     f"{self.max_model_len} tokens, so a prompt may have at most {limit}")
        if params.n > self.max_num_seqs:
            raise ValueError(f"n must be <= max_num_seqs ({self.max_num_seqs}), got {params.n}")
        max_tokens = self.max_model_len - len(ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        rid = request_id if request_id is not None else f"req-{next(self._request_ids)}"
        return Request(str(rid), text, ids, params, max_tokens, now())

    def add_request(self, request_id: str | None, prompt: str | list[int] | Request,
                    params: SamplingParams | None = None) -> str:
        req = prompt if isinstance(prompt, Request) else self.make_request(request_id, prompt, params)
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        seq = Sequence(next(self._seq_ids), req, 0,
                       IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids),
                       self._generator(req.params.seed, 0))
        seq.pending_forks = req.params.n - 1
        req.seqs.append(seq)
        self.requests[req.request_id] = req
        self.scheduler.add(seq)
        return req.request_id

    def _generator(self, seed: int | None, index: int) -> torch.Generator | None:
        if seed is None:
            return None
        g = torch.Generator(device=self.device)
        g.manual_seed((seed if index == 0 else hash((seed, index))) & 0xFFFF_FFFF_FFFF_FFFF)
        return g

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; its final output (finish_reason "abort")."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.remove(seq)
                seq.status, seq.finish_reason = Status.FINISHED, "abort"
        req.aborted = True
        self.metrics.on_finished(req.metrics, "abort", now())
        self._update_gauges()
        return make_output(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len({s.request.request_id for s in self.scheduler.waiting})

    @property
    def num_running(self) -> int:
        return len({s.request.request_id for s in self.scheduler.running})

    # -- the step ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; outputs of the requests that advanced."""
        batch = self.scheduler.schedule()
        t = now()
        prompt_tokens = 0
        for seq in batch.admitted:
            m = seq.request.metrics
            if m.first_scheduled_time is None:
                self.metrics.on_first_scheduled(m, t)
                m.num_cached_tokens = seq.num_computed_tokens
                prompt_tokens += m.num_prompt_tokens
        self.metrics.on_schedule(preemptions=len(batch.preempted), prefix_queries=batch.prefix_queries,
                                 prefix_hits=batch.prefix_hits, prompt_tokens=prompt_tokens)
        touched: dict[str, Request] = {}
        if batch.seqs:
            logits = self.runner.execute(batch.seqs, batch.num_new_tokens, batch.copies)
            ready = []
            for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
                seq.num_computed_tokens += n
                if seq.num_computed_tokens == seq.num_tokens:
                    ready.append(seq)
            rows, targets = [], []
            for j, seq in enumerate(ready):
                rows.append(j)
                targets.append(seq)
                for child in self._fork(seq):
                    rows.append(j)
                    targets.append(child)
            if len(rows) != len(ready):
                logits = logits[torch.tensor(rows, device=logits.device)]
            result = sample(logits, targets) if targets else None
            t = now()
            for k, seq in enumerate(targets):
                req = seq.request
                seq.append(result.token_ids[k], result.logprobs[k], self.eos_token_ids, req.max_tokens)
                if seq.is_finished:
                    self.scheduler.remove(seq)
                touched.setdefault(req.request_id, req)
            for req in touched.values():
                self.metrics.on_tokens(req.metrics, t, sum(1 for s in targets if s.request is req))
        outputs = []
        for rid, req in touched.items():
            if req.finished:
                del self.requests[rid]
                self.metrics.on_finished(req.metrics, req.seqs[0].finish_reason, t)
            outputs.append(make_output(req))
        self._update_gauges()
        return outputs

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """At the first sample of an n > 1 request: siblings sharing the prompt's blocks."""
        children = []
        for i in range(1, parent.pending_forks + 1):
            child = parent.fork(next(self._seq_ids), i, self._generator(parent.params.seed, i))
            self.block_manager.share(parent, child)
            self.scheduler.add_running(child)
            parent.request.seqs.append(child)
            children.append(child)
        parent.pending_forks = 0
        return children

    def _update_gauges(self) -> None:
        self.metrics.set_state(running=self.num_running, waiting=self.num_waiting,
                               kv_usage=self.block_manager.usage)

    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts to completion (continuous batching across them); outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        reqs = [self.make_request(None, p, sp) for p, sp in zip(prompts, plist, strict=True)]
        ids = [self.add_request(None, r) for r in reqs]
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            if not self.scheduler.has_work():
                raise RuntimeError("engine has no work left but requests are unfinished")
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]


class RequestStream:
    """Blocking iterator over one request's incremental outputs; ends after the finished one."""

    def __init__(self, loop: EngineLoop, request_id: str):
        self.request_id = request_id
        self._loop = loop
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._done = False

    def _put(self, item) -> None:
        self._queue.put(item)

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> RequestOutput:
        item = self.get()
        if item is None:
            raise StopIteration
        return item

    def get(self, timeout: float | None = None) -> RequestOutput | None:
        """The next output; None once finished. Raises queue.Empty after `timeout` seconds."""
        if self._done:
            return None
        item = self._queue.get(timeout=timeout)
        if isinstance(item, BaseException):
            self._done = True
            raise RuntimeError(f"engine loop failed: {item!r}") from item
        self._done = item.finished
        return item

    def cancel(self) -> None:
        """Abort the request (its blocks are freed); the stream ends with finish_reason "abort"."""
        self._loop._cancel(self.request_id)


class EngineLoop:
    """One background thread drives `engine.step()`; any thread may submit and stream."""

    def __init__(self, engine: LLMEngine, max_queued: int = 256, stall_timeout: float = 60.0):
        self.engine = engine
        self.max_queued = _positive_int("max_queued", max_queued)
        self.stall_timeout = stall_timeout
        self._cv = threading.Condition()
        self._inbox: deque[Request] = deque()
        self._cancels: deque[str] = deque()
        self._streams: dict[str, RequestStream] = {}
        self._accepting = True
        self._deadline: float | None = None   # set by shutdown
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._last_progress = now()
        self._waiting = self._running = 0

    def start(self) -> EngineLoop:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lmops-engine-loop", daemon=True)
            self._thread.start()
        return self

    @property
    def num_waiting(self) -> int:
        return len(self._inbox) + self._waiting

    @property
    def num_running(self) -> int:
        return self._running

    def _pending(self) -> bool:
        return bool(self._inbox or self._streams)

    def submit(self, prompt: str | list[int], params: SamplingParams | None = None,
               request_id: str | None = None) -> RequestStream:
        req = self.engine.make_request(request_id, prompt, params)  # raises ValueError here
        with self._cv:
            if not self._accepting:
                raise RuntimeError("shutting down")
            if self._error is not None or self._thread is None or not self._thread.is_alive():
                raise RuntimeError("engine loop is not running")
            if self.num_waiting >= self.max_queued:
                raise QueueFullError(f"{self.num_waiting} requests are already waiting "
                                     f"(max_queued={self.max_queued})")
            if req.request_id in self._streams:
                raise ValueError(f"request_id {req.request_id!r} is already in use")
            if not self._pending():
                self._last_progress = now()
            stream = self._streams[req.request_id] = RequestStream(self, req.request_id)
            self._inbox.append(req)
            self._cv.notify()
        return stream

    def _cancel(self, request_id: str) -> None:
        with self._cv:
            self._cancels.append(request_id)
            self._cv.notify()

    def healthy(self) -> bool:
        """Thread alive, no crash, and steps completing while there is work."""
        if self._error is not None or self._thread is None or not self._thread.is_alive():
            return False
        with self._cv:
            return not self._pending() or now() - self._last_progress < self.stall_timeout

    def shutdown(self, timeout: float = 30.0) -> None:
        """Refuse new work, let in-flight requests finish for `timeout` s, abort the rest, join."""
        with self._cv:
            self._accepting = False
            self._deadline = now() + timeout
            self._cv.notify()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join()
        else:
            self._abort_all()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        with self._cv:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream._put(out)
                    if out.finished:
                        del self._streams[out.request_id]

    def _abort_all(self) -> None:
        with self._cv:
            inbox, self._inbox = list(self._inbox), deque()
        for req in inbox:
            self.engine.add_request(None, req)
        self._deliver([o for rid in list(self.engine.requests) if (o := self.engine.abort(rid))])

    def _run(self) -> None:
        eng = self.engine
        try:
            while True:
                with self._cv:
                    while not (self._inbox or self._cancels or self._deadline is not None
                               or eng.has_unfinished_requests()):
                        self._cv.wait()
                    for req in self._inbox:  # under the lock: num_waiting never undercounts
                        eng.add_request(None, req)
                    if self._inbox:
                        self._inbox.clear()
                        self._waiting = eng.num_waiting
                    cancels, self._cancels = list(self._cancels), deque()
                    deadline = self._deadline
                self._deliver([o for rid in cancels if (o := eng.abort(rid))])
                if deadline is not None and (now() >= deadline or not eng.has_unfinished_requests()):
                    self._abort_all()
                    return
                if eng.has_unfinished_requests():
                    outputs = eng.step()
                    with self._cv:
                        self._last_progress = now()
                        self._waiting, self._running = eng.num_waiting, eng.num_running
                    self._deliver(outputs)
        except BaseException as exc:  # noqa: BLE001 - any failure must reach every waiting stream
            log.exception("engine loop failed")
            self._error = exc
            with self._cv:
                streams, self._streams = list(self._streams.values()), {}
            for stream in streams:
                stream._put(exc)
