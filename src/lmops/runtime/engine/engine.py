"""`LLMEngine`: add_request / step / abort / generate over the scheduler, runner and sampler.

The engine is single-threaded by design: one owner calls `step()`. The service shares
it through `EngineLoop` (loop.py), whose background thread is that owner.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import uuid
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch
from tokenizers import Tokenizer

from lmops.errors import LmopsError
from lmops.runtime.engine.config import PRIORITY_BOUND, EngineConfig
from lmops.runtime.engine.draft import DraftModel
from lmops.runtime.engine.grammar import GrammarCompiler
from lmops.runtime.engine.kv_cache import BlockManager, KVPool
from lmops.runtime.engine.kv_events import ZmqEventPublisher, make_publisher
from lmops.runtime.engine.metrics import EngineMetrics, now
from lmops.runtime.engine.runner import ModelRunner, RunnerOutput
from lmops.runtime.engine.sampling import (
    SampleResult,
    SamplingParams,
    TokenMasks,
    greedy_verdict,
    sample,
    seeded_generator,
    speculative_sample,
)
from lmops.runtime.engine.scheduler import ScheduledBatch, Scheduler, StepUpdate
from lmops.runtime.engine.sequence import (
    IncrementalDetokenizer,
    Request,
    RequestOutput,
    Sequence,
    Status,
    make_output,
)
from lmops.runtime.model import Llama, default_dtype, resolve_device
from lmops.runtime.model_dir import eos_token_ids
from lmops.runtime.quantize import quantize
from lmops.runtime.tokenizer import load_tokenizer, token_byte_lengths

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def free_memory(device: torch.device) -> int:
    """Bytes a new allocation may still take on `device`: CUDA's free memory; on CPU the
    host's free pages, or what the container's cgroup limit leaves when that is less."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return free
    return free if limit == "max" else min(free, int(limit) - used)


class PromptTooLongError(ValueError):
    """The prompt leaves no room for a generated token within the model's context."""


class LLMEngine:
    """Continuous-batching generation over a paged KV cache for one model.

    Owned by one thread: `add_request`, `step` and `abort` are not thread-safe (EngineLoop
    is the thread-safe front). The model's q/k/v and gate/up weights become views into
    fused tensors (see runner.FusedForward): numerically the same model, less overhead.
    """

    def __init__(
        self,
        model: Llama,
        tokenizer: Tokenizer,
        engine_config: EngineConfig | None = None,
        *,
        eos_token_ids: list[int] | None = None,
        kv_events: ZmqEventPublisher | None = None,
    ):
        """`kv_events`: a publisher to share (its caller closes it: the service's, which
        successive versions publish through); by default the engine opens its own when
        `engine_config.kv_events_config` enables events."""
        cfg = model.config
        self.engine_config = engine_config = engine_config or EngineConfig()
        model = quantize(model, engine_config.quantization)  # in place, before the runner fuses weights
        self.model, self.tokenizer, self.model_config = model.eval(), tokenizer, cfg
        self.max_model_len = cfg.max_seq_len
        self.block_size = engine_config.block_size
        self.max_num_seqs = engine_config.max_num_seqs
        self.max_num_batched_tokens = engine_config.max_num_batched_tokens
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        default_eos = [] if cfg.eos_token_id is None else [cfg.eos_token_id]
        self.eos_token_ids = frozenset(eos_token_ids if eos_token_ids is not None else default_eos)
        num_blocks = self._num_blocks(engine_config.kv_cache_memory)
        # The compiled decode path (CPU only: no CUDA graphs yet) pads batches with rows
        # that write into one extra block, which the block manager never hands out.
        compile_up_to = self.max_num_seqs if engine_config.compile and self.device.type == "cpu" else 0
        self.pool = KVPool(cfg, num_blocks + bool(compile_up_to), self.block_size, self.device, self.dtype)
        self._owns_kv_events = kv_events is None
        self.kv_events = (
            kv_events if kv_events is not None else make_publisher(engine_config.kv_events_config)
        )
        self.block_manager = BlockManager(
            num_blocks,
            self.block_size,
            engine_config.enable_prefix_caching,
            record_events=self.kv_events is not None,
        )
        self._publish_events()  # the new cache's AllBlocksCleared
        self.draft_model = None
        if engine_config.speculative_model is not None:
            self.draft_model = DraftModel.load(
                engine_config.speculative_model,
                tokenizer,
                cfg.vocab_size,
                self.max_model_len,
                self.device,
                self.dtype,
            )
            if self.device.type == "cpu":
                log.warning(
                    "speculative_model on CPU: the draft model runs eagerly, a token at a time, "
                    "which costs more than its drafts save (0.27x-0.31x the speed without it on a "
                    "2-core Xeon: benchmarks/README.md, Single stream); prompt lookup (no "
                    "speculative_model) is the CPU's drafter"
                )
        self.runner = ModelRunner(
            model,
            self.pool,
            compile_up_to,
            engine_config.num_speculative_tokens,
            engine_config.num_scheduler_steps,
            prompt_lookup=engine_config.speculative_model is None,
        )
        self.scheduler = Scheduler(
            self.block_manager,
            self.max_num_seqs,
            self.max_num_batched_tokens,
            self.eos_token_ids,
            engine_config.num_speculative_tokens,
            engine_config.scheduling_policy,
            self.draft_model,
            self.runner.scheduler_steps,
            self.runner.lookup_tokens,
        )
        self.reset_metrics()
        self.requests: dict[str, Request] = {}
        # Drift sampling is systematic (every 1/drift_sample-th request), so runs are reproducible.
        self._drift_credit = 0.0
        self._token_bytes = token_byte_lengths(tokenizer)  # bits/byte's denominator
        self._grammars: GrammarCompiler | None = None  # made by the first structured request
        self._grammars_lock = threading.Lock()
        log.info(
            "engine: %d KV blocks of %d tokens (%.1f MiB), device %s, %s, %d CPU threads",
            num_blocks,
            self.block_size,
            self.pool.nbytes / 2**20,
            self.device,
            self.dtype,
            torch.get_num_threads(),
        )

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        engine_config: EngineConfig | None = None,
        *,
        kv_events: ZmqEventPublisher | None = None,
        **overrides,
    ) -> LLMEngine:
        """Load a model directory (config.json, model.safetensors, tokenizer.json, and
        generation_config.json for extra EOS ids when present) with `engine_config`, any of
        whose fields `overrides` replace (`from_pretrained(d, device="cpu", block_size=8)`).
        `kv_events`: a publisher to share, e.g. the one the engine this one replaces uses (a
        new model served on the same event endpoints; its first batch clears what the old
        one announced)."""
        try:
            ec = replace(engine_config or EngineConfig(), **overrides)
        except (TypeError, ValueError) as exc:
            raise LmopsError(f"engine config: {exc}") from None
        d = Path(model_dir)
        if not d.is_dir():
            raise LmopsError(f"{d}: model directory not found")
        dev = resolve_device(ec.device)
        if ec.dtype == "auto":
            dt = default_dtype(dev)
        elif ec.dtype in _DTYPES:
            dt = _DTYPES[ec.dtype]
        else:
            raise LmopsError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {ec.dtype!r}")
        tokenizer = load_tokenizer(d)
        model = Llama.from_pretrained(d, dev, dt)
        return cls(
            model,
            tokenizer,
            ec,
            eos_token_ids=eos_token_ids(d, model.config.eos_token_id),
            kv_events=kv_events,
        )

    def reset_metrics(self) -> None:
        """Fresh Prometheus metrics (the service drops its warm-up's); the cache's shape stays."""
        self.metrics = EngineMetrics()
        self.metrics.set_cache_config(
            block_size=self.block_size,
            num_blocks=len(self.block_manager.blocks),
            prefix_caching=self.engine_config.enable_prefix_caching,
        )

    def _num_blocks(self, kv_cache_memory: int | None) -> int:
        per_block = KVPool.bytes_per_block(self.model_config, self.block_size, self.dtype)
        min_blocks = -(-self.max_model_len // self.block_size)
        if kv_cache_memory is None:
            # Room for max_num_seqs full-length sequences, twice over (the spare blocks keep
            # prefixes cached), within a share of the memory that is actually free.
            want = 2 * self.max_num_seqs * min_blocks * per_block
            share = 0.8 if self.device.type == "cuda" else 0.25
            cap = int(share * free_memory(self.device))
            kv_cache_memory = max(min(want, cap), min_blocks * per_block)
        num_blocks = int(kv_cache_memory) // per_block
        if num_blocks < min_blocks:
            raise LmopsError(
                f"kv_cache_memory={kv_cache_memory} bytes holds {num_blocks} blocks; one "
                f"{self.max_model_len}-token sequence needs {min_blocks} blocks of "
                f"{per_block} bytes, so at least {min_blocks * per_block} bytes"
            )
        return num_blocks

    @property
    def memory_bytes(self) -> int:
        """What this engine holds on its device: the weights (a draft model's too, and the
        copies packed for lmops' kernels) and the paged KV cache (not the draft model's
        per-sequence caches, which come and go)."""
        weights = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        weights += sum(t.nbytes for t in self.runner.forward.packed_tensors())
        return weights + self.pool.nbytes + (self.draft_model.nbytes if self.draft_model else 0)

    # -- requests ----------------------------------------------------------------------

    def make_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        score_prompt: bool = False,
    ) -> Request:
        """Validate and tokenize (touches no engine state, so any thread may call it).
        `priority` as vLLM's: lower runs first, only under the "priority" policy; with
        `score_prompt`, the prompt's bits/byte is measured whatever the drift sample says."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if (
            not isinstance(priority, int)
            or isinstance(priority, bool)
            or not -PRIORITY_BOUND <= priority < PRIORITY_BOUND
        ):
            raise ValueError(f"priority must be a 64-bit signed integer, got {priority!r}")
        if priority != 0 and self.engine_config.scheduling_policy != "priority":
            raise ValueError(
                f"priority {priority} needs priority scheduling (LMOPS_SCHEDULING_POLICY=priority); "
                "this engine serves in arrival order"
            )
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            text, ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=False).ids
        else:
            text, ids = None, list(prompt)
            vocab = self.model_config.vocab_size
            if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if not ids:
            raise ValueError("prompt must not be empty")
        limit = self.max_model_len - 1
        if len(ids) > limit:
            raise PromptTooLongError(
                f"prompt is {len(ids)} tokens; this model's context is "
                f"{self.max_model_len} tokens, so a prompt may have at most {limit}"
            )
        if params.n > self.max_num_seqs:
            raise ValueError(f"n must be <= max_num_seqs ({self.max_num_seqs}), got {params.n}")
        max_tokens = self.max_model_len - len(ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        rid = request_id if request_id is not None else uuid.uuid4().hex
        spec = params.structured_outputs
        grammar = None if spec is None else self.grammars.matcher(spec)  # GrammarError: a ValueError
        return Request(str(rid), text, ids, params, max_tokens, now(), grammar, priority, score_prompt)

    @property
    def grammars(self) -> GrammarCompiler:
        """The structured-output grammars of this engine's tokenizer (thread-safe)."""
        with self._grammars_lock:
            if self._grammars is None:
                ec = self.engine_config
                self._grammars = GrammarCompiler(
                    self.tokenizer,
                    self.model_config.vocab_size,
                    self.eos_token_ids,
                    ec.grammar_cache_size,
                    ec.grammar_compile_timeout,
                )
            return self._grammars

    def add_request(
        self, request_id: str | None, prompt: str | list[int] | Request, params: SamplingParams | None = None
    ) -> str:
        req = prompt if isinstance(prompt, Request) else self.make_request(request_id, prompt, params)
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        seq = Sequence(
            req,
            0,
            IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.params.skip_special_tokens),
            seeded_generator(req.params.seed, 0, self.device),
            req.grammar,
        )
        if req.grammar is not None:
            self.metrics.on_structured_request(req.params.structured_outputs.kind)
        seq.pending_forks = req.params.n - 1
        self._drift_credit += self.engine_config.drift_sample
        sampled = self._drift_credit >= 1
        if sampled:
            self._drift_credit -= 1
        # a 1-token prompt predicts nothing
        seq.score_prompt = (sampled or req.score_prompt) and len(req.prompt_token_ids) > 1
        req.seqs.append(seq)
        self.requests[req.request_id] = req
        self.scheduler.add(seq)
        return req.request_id

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
        """One iteration: schedule -> execute -> sample -> update (nano-vllm's schedule -> run
        -> postprocess, vLLM's schedule -> execute_model -> update_from_output), then the
        step's metrics; outputs of the requests that advanced."""
        batch = self.scheduler.schedule()
        self.metrics.on_schedule(batch, now())
        output = self.runner.execute(batch)
        sampled = self._sample(batch, output)
        update = self.scheduler.update(batch, output.prompt_scores, sampled)
        self._record(batch, update, now())
        self._publish_events()
        outputs = []
        for rid, req in update.requests.items():
            if req.finished:
                del self.requests[rid]
            if req.finished or not req.final_only:
                outputs.append(make_output(req))
        return outputs

    def _publish_events(self) -> None:
        """The KV-cache events since the last batch, as one batch (nothing when none); after
        `stop_publishing`, dropped."""
        if not self.block_manager.events:
            return
        publisher = self.kv_events  # read once: `stop_publishing` may run on another thread
        events = self.block_manager.take_events()
        if publisher is not None:
            publisher.publish(events)

    def stop_publishing(self) -> None:
        """No more KV-cache events from this engine, from any thread: the service calls it
        when a new version takes over the sockets, so a router never hears of the old
        version's blocks again."""
        self.kv_events = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block and announce it (AllBlocksCleared); False while
        requests hold blocks."""
        done = self.block_manager.reset_prefix_cache()
        self._publish_events()
        return done

    def close(self) -> None:
        """Stop the KV-cache events (the engine serves on without them), closing the sockets
        if this engine opened them."""
        publisher, self.kv_events = self.kv_events, None
        self.block_manager.events = None
        if publisher is not None and self._owns_kv_events:
            publisher.close()

    def _sample(self, batch: ScheduledBatch, output: RunnerOutput) -> SampleResult | None:
        """A token for each of `batch.samples`, from its row of the logits: the graph's own
        tokens where it made every row's (its argmax or draw), else the sampler's draw. The
        grammar masks are computed here, after the forward is launched: on CUDA, while it
        runs."""
        if not batch.samples:
            return None
        if output.speculation is not None:
            self.metrics.on_speculation(*output.speculation)
        if output.tokens is not None:
            tokens = output.tokens.tolist()
            result = SampleResult([tokens[r] for r in batch.sample_rows], [None] * len(batch.samples))
            for k, (seq, row) in enumerate(zip(batch.samples, batch.sample_rows, strict=True)):
                if seq.draft:
                    verdict = greedy_verdict(tokens[row - len(seq.draft) : row + 1], seq.draft)
                    self._keep(result, k, seq.draft, *verdict)
                elif seq.lookahead:  # multi-step: the graph's own tokens, all kept
                    result.accepted[k] = tokens[row - seq.lookahead : row]
            return result
        logits = output.logits
        if batch.sample_rows != list(range(len(logits))):
            logits = logits[torch.tensor(batch.sample_rows, device=logits.device)]
        result = sample(logits, batch.samples, self.eos_token_ids, self._token_masks(batch.samples))
        drafted = [k for k, seq in enumerate(batch.samples) if seq.draft]
        if drafted:
            self._verify(batch, output.logits, drafted, result)
        return result

    def _verify(
        self, batch: ScheduledBatch, logits: torch.Tensor, drafted: list[int], result: SampleResult
    ) -> None:
        """Verify the drafts of samples `drafted`: rows `row - len(draft)` .. `row` hold the
        logits after a sequence's last token and after each draft token. `speculative_sample`
        keeps what greedy decoding would have produced (greedy rows) or what rejection
        sampling accepts (sampled rows), so the output is distributed as without a draft;
        its next token replaces the sampler's draw."""
        seqs = [batch.samples[k] for k in drafted]
        rows = [
            r
            for k, s in zip(drafted, seqs, strict=True)
            for r in range(batch.sample_rows[k] - len(s.draft), batch.sample_rows[k] + 1)
        ]
        rows_t = torch.tensor(rows, device=logits.device)
        verdicts = speculative_sample(logits[rows_t], seqs, [s.draft for s in seqs], self.eos_token_ids)
        for k, seq, verdict in zip(drafted, seqs, verdicts, strict=True):
            self._keep(result, k, seq.draft, *verdict)

    def _keep(self, result: SampleResult, k: int, draft: list[int], kept: int, token: int) -> None:
        """Sample `k` keeps the first `kept` tokens of its draft, then `token` (the verified
        model's own next one); the acceptance counts towards /metrics."""
        result.accepted[k] = draft[:kept]
        result.token_ids[k] = token
        self.metrics.on_speculation(len(draft), kept)

    def _record(self, batch: ScheduledBatch, update: StepUpdate, t: float) -> None:
        """The step's metrics: tokens, prompts scored whole (the drift signal), finished
        requests, and the gauges."""
        for rid, count in update.new_tokens.items():
            self.metrics.on_tokens(update.requests[rid].metrics, t, count)
        for seq in batch.seqs:
            if seq.score_prompt and seq.num_computed_tokens >= seq.num_prompt_tokens:
                self._observe_prompt_score(seq)
        for req in update.requests.values():
            if req.finished:
                self.metrics.on_finished(req.metrics, req.seqs[0].finish_reason, t)
        self._update_gauges()

    def _token_masks(self, targets: list[Sequence]) -> TokenMasks | None:
        rows = [k for k, seq in enumerate(targets) if seq.grammar is not None]
        if not rows:
            return None
        t = now()
        bitmask = self.grammars.fill_masks([targets[k].grammar for k in rows])
        self.metrics.on_token_masks(len(rows), now() - t)
        return TokenMasks(rows, bitmask)

    def _observe_prompt_score(self, seq: Sequence) -> None:
        """The prompt is prefilled: its bits per byte, in evaluate's unit (NLL in bits over
        the UTF-8 bytes of the predicted tokens, i.e. all but the first)."""
        seq.score_prompt = False
        n_bytes = int(self._token_bytes[seq.token_ids[1 : seq.num_prompt_tokens]].sum())
        if n_bytes:
            self.metrics.on_prompt_scored(seq.request.metrics, seq.prompt_nll / math.log(2) / n_bytes)

    def _update_gauges(self) -> None:
        waiting = Counter({s.request.request_id: s.request.priority for s in self.scheduler.waiting}.values())
        self.metrics.set_state(running=self.num_running, waiting=waiting, kv_usage=self.block_manager.usage)

    def generate(
        self,
        prompts: str | list[int] | list[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion (continuous batching across them); outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        reqs = [self.make_request(None, p, sp) for p, sp in zip(prompts, plist, strict=True)]
        for r in reqs:
            r.final_only = True
        ids = [self.add_request(None, r) for r in reqs]
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            if not self.scheduler.has_work():
                raise RuntimeError("engine has no work left but requests are unfinished")
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]
