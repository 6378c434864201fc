"""The compiled decode step: a pure-decode batch padded up to one of a few batch sizes, each
compiled once at engine start, so a step runs as one generated kernel sequence instead of
a few hundred eagerly dispatched small ops (at batch 1 a decode step is mostly that
overhead; see benchmarks/README.md). The graphs make each sequence's token too, where a
graph can make its draw (greedy, or sampled with temperature and the filters alone:
`SamplingParams.graph_draw`): the step's graph its argmax, and for sampled rows a draw
graph after it the draw (the sampler's filters and race, from noise drawn before the call
by the request's generator, so a seeded request gets the sampler's tokens), so a step of
such sequences, sampled ones included, runs no sampler dispatches. With speculative
decoding, a step whose decodes carry drafts runs through graphs of 1 + K tokens a sequence
the same way (each token sees its sequence's cache and, causally, the step's earlier
tokens). With multi-step decoding
(`num_scheduler_steps` S), a lone decode whose draw a graph can make runs up to S steps in
one graph call, each step's token the next one's input: one call, and one pass of the
Python around it, for up to S tokens. The steps are a loop inside the graph (`while_loop`),
whose body is compiled once whatever S, and which runs any count up to S (a request's last
few tokens too). With prompt lookup as well, a lone greedy sequence's run drafts in the loop
(`lookup_draft`), and a pass that found a draft verifies 1 + K rows and keeps greedy's
tokens, one that did not is a plain step (`torch.cond`): the Python around a verification
is paid once for a run of them. A lone fresh prompt's prefill (its time to first
token) runs through a graph too, one for any length from PREFILL_MIN_TOKENS. Any other
step (other prefills, mixed batches, more sequences than the largest size) takes the
runner's eager path.

CPU only for now: `torch.compile` with inductor (which needs a C++ compiler). CUDA graphs
for the GPU are not written yet (nothing here could test them), so CUDA stays eager.

The graph is forward.py's `FusedForward` itself, traced with a decode-only attention whose shapes are
fixed per batch size except the block-table width (symbolic, so contexts of any length
share one graph). It returns the step's K/V, which the runner writes into the pool after
the graph; padding rows write theirs into a scratch block that the engine reserves past
the block manager's blocks, and their logits are dropped. Each size's graph is compiled
ahead of time and called without dynamo's guards; the compiled graphs are saved under
inductor's cache directory (TORCHINDUCTOR_CACHE_DIR, default under /tmp, in
`lmops-decode/`), so a restart with the same model structure loads them in seconds.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import time
from array import array
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch._higher_order_ops.while_loop import while_loop  # (imported by torch itself)

import lmops
from lmops import atomic
from lmops.runtime.engine.forward import SMALL_PRODUCT_ROWS, FusedForward, causal_attention
from lmops.runtime.engine.kernels import kernels_loaded, load_kernels
from lmops.runtime.engine.kv_cache import KVPool
from lmops.runtime.engine.sampling import SamplingParams, batch_draw_inputs, plain_draw, plain_draw_inputs
from lmops.runtime.engine.sequence import Sequence

if TYPE_CHECKING:
    from torch._dynamo.aot_compile import AOTCompiledFunction

log = logging.getLogger(__name__)

# Powers of two, as vLLM's CUDA-graph sizes: a batch pads to the next one. The gain
# shrinks as a step's matrix products grow (measured in benchmarks/README.md: clear at 4
# sequences, within noise at 16), so larger steps stay eager and engine start stays short.
BATCH_SIZES = (1, 2, 4, 8, 16)
# A lookup run drafts from a match of this many tokens or more; after a shorter one (or
# none) its pass is a plain one-row step. A 1-token match's draft is mostly wrong, and
# verifying it costs a second row's step (benchmarks/README.md, "Prompt lookup inside the
# run, one row where there is no draft").
LOOKUP_MIN_MATCH = 2
# A lone sequence's prompt chunk of at least this many tokens runs through the prefill graph
# (its products aten.mm's, which the graph is traced for); a shorter one stays eager.
PREFILL_MIN_TOKENS = SMALL_PRODUCT_ROWS
# The graphs this process has loaded from the disk cache, by path (the structure and the
# size name the file): a graph fits every engine of that structure, and each load keeps its compiled
# code in the process for good (about 0.5 MiB an engine), so a replica swapping in new
# versions of one model loads them once (benchmarks/swap.py's memory phase).
_LOADED: dict[str, AOTCompiledFunction] = {}


class DecodeAttention:
    """`PagedAttention` for B decoding sequences of T new tokens each, in tensors only (so
    that it traces): T is 1 for a plain decode, 1 + K for one verifying a K-token draft.

    It reads the pool but does not write it: each token attends to its sequence's cached
    context (`gather`ed from the pool) and, causally, to the step's new K/V, which are
    collected in `new_kv` and written by the caller after the graph (an in-graph write made
    inductor copy the whole pool layer, every layer). A layer's attention is one call of
    lmops' `decode_attention` where kernels.py built it, else two batched products around
    a softmax.
    """

    def __init__(
        self,
        context: torch.Tensor,
        cached: torch.Tensor,
        groups: int,
        ahead: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        """`context`: `gather`'s; `cached` (B * T,): how many of its sequence's cached keys each
        row sees; `groups` query heads share a KV head; `ahead` (a multi-step run, one
        sequence): the K/V its run's steps have computed so far, (layers, 2 * Hkv, rows, D),
        and the run's rows j (T,) of this step's T tokens: token t writes its own K/V at row
        j[t] and sees rows 0..j[t]."""
        self.context, self.ahead = context, ahead
        self.new_kv: list[torch.Tensor] = []
        B, width = context.shape[2:4]
        self.T = T = cached.shape[0] // B
        device = context.device
        # (B, T, keys + new keys): cached key k is visible iff k < the row's cached count; the
        # step's new key t to query i iff t <= i (multi-step: the run's key t iff t <= j).
        old = torch.arange(width, device=device) < cached.view(B, T, 1)
        if ahead is None:
            new = torch.ones(T, T, dtype=torch.bool, device=device).tril().expand(B, T, T)
        else:
            buffer, j = ahead
            new = (torch.arange(buffer.shape[2], device=device) <= j.view(T, 1)).view(1, T, -1)
        valid = torch.cat((old, new), 2)
        rows = torch.zeros(valid.shape, dtype=context.dtype, device=device).masked_fill(~valid, float("-inf"))
        # The query rows are (head, token) pairs: each token's row, the same for its G heads.
        self.mask = rows[:, None].expand(B, groups, T, -1).reshape(1, B, groups * T, -1)

    def __call__(self, layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """q: (B * T, H, D); kv: (B * T, 2 * Hkv, D) -> (B * T, H, D)."""
        rows, H, D = q.shape
        T, Hkv = self.T, kv.shape[1] // 2
        B, G = rows // T, H // Hkv
        new = kv.transpose(0, 1)  # (2Hkv, B * T, D)
        if self.ahead is not None:  # the run's K/V so far, with this step's at rows j
            buffer, j = self.ahead
            new = buffer[layer].index_copy(1, j, new)
        self.new_kv.append(new)
        ctx = torch.cat((self.context[layer], new.view(2 * Hkv, B, -1, D)), 2)
        # (Hkv, B, G * T, D): the G query heads x T tokens that share a KV head.
        qg = q.view(B, T, Hkv, G, D).permute(2, 0, 3, 1, 4).reshape(Hkv, B, G * T, D)
        if kernels_loaded() and D % 8 == 0 and q.dtype == torch.float32:  # lmops' kernel: one call
            y = torch.ops.lmops.decode_attention(
                qg.reshape(Hkv * B, G * T, D),
                ctx[:Hkv].reshape(Hkv * B, -1, D),
                ctx[Hkv:].reshape(Hkv * B, -1, D),
                self.mask.reshape(B, G * T, -1),
                D**-0.5,
            )
        else:
            # Written out, not SDPA: with a few query rows a head, SDPA's flash kernel costs
            # more around its products than they take, and here inductor fuses the scale, mask
            # and softmax into one loop between two batched products (6-12% off the graph at
            # batch 1: benchmarks/README.md, "Single stream").
            scores = (qg @ ctx[:Hkv].transpose(2, 3)) * D**-0.5 + self.mask
            y = scores.softmax(-1) @ ctx[Hkv:]
        return y.view(Hkv, B, G, T, D).permute(1, 3, 0, 2, 4).reshape(rows, H, D)

    @staticmethod
    def gather(kv: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """Every layer's cached K/V of B sequences from the pool (layers, 2 * Hkv, blocks,
        block_size, D) by their block tables (B, width): (layers, 2 * Hkv, B, keys, D). Once
        for a multi-step run, not once a step."""
        L, H2, _, _, D = kv.shape
        return kv.index_select(2, tables.view(-1)).view(L, H2, tables.shape[0], -1, D)


class PrefillAttention:
    """Attention for a fresh prompt's chunk in a graph (`causal_attention`: many query rows a
    head, where DecodeAttention's few-row products would not beat SDPA's flash kernel), its
    K/V collected in `new_kv` for the caller to write, as DecodeAttention's."""

    def __init__(self):
        self.new_kv: list[torch.Tensor] = []

    def __call__(self, layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        self.new_kv.append(kv.transpose(0, 1))  # (2 * Hkv, T, D)
        return causal_attention(q, kv)


class CompiledDecode:
    """Decode steps of up to `max(sizes)` sequences through per-size compiled graphs; with
    `num_speculative_tokens` K, also the steps that verify drafts (every sequence a decode
    with up to K draft tokens), through graphs of 1 + K tokens a sequence for the sizes of
    at most 16 tokens in all, so that single-stream speculative decoding runs compiled too;
    and with `scheduler_steps` S > 1, a lone decode's runs of up to S steps, greedy or
    sampled."""

    def __init__(
        self,
        forward: FusedForward,
        pool: KVPool,
        scratch_block: int,
        max_num_seqs: int,
        num_speculative_tokens: int = 0,
        scheduler_steps: int = 1,
        prompt_lookup: bool = False,
    ):
        self.forward, self.pool = forward, pool
        self.block_size = pool.block_size
        self.scratch_slot = scratch_block * pool.block_size
        self.scratch_block = scratch_block
        # Every size below max_num_seqs, and the first one that holds it.
        self.sizes = [b for b in BATCH_SIZES if b < max_num_seqs]
        self.sizes += [b for b in BATCH_SIZES if b >= max_num_seqs][:1]
        self.verify_len = 1 + num_speculative_tokens
        self.verify_sizes = (
            [b for b in self.sizes if b * self.verify_len <= BATCH_SIZES[-1]]
            if num_speculative_tokens
            else []
        )
        model = forward.model
        self.device = model.lm_head.weight.device
        self.vocab = model.lm_head.weight.shape[0]
        # One graph per size, compiled ahead of time (`aot_compile`): a step calls its size's
        # graph directly, with none of dynamo's per-call guard checks or cache lookup (they cost
        # as much as the Python around the graph: benchmarks/README.md). Nothing is
        # left for guards to catch: the caller picks the size, the inputs' dtypes and ranks
        # never change, and the block-table width is symbolic (two blocks at least: a
        # symbolic size of 1 would be specialised). The weights are read from the model at
        # each call, not baked in, so a graph fits any engine of the same structure (those
        # the kernel reads from the copies packed for it here, so a weight changed in place
        # after this is seen by the eager path only; nothing changes one).
        # cpp_wrapper: the code that calls the step's kernels is C++ too, not Python
        # (less per step at batch 1; benchmarks/README.md, "Inference engine").
        options = {"cpp_wrapper": True, "guard_filter_fn": lambda guards: [False] * len(guards)}
        one_step = torch.compile(self._eager_step, fullgraph=True, options=options)
        run = torch.compile(self._eager_run, fullgraph=True, options=options)
        # (Imported here: torch._dynamo takes a second to import, which an engine that
        # does not compile need not pay.)
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        inductor_cache = Path(cache_dir())
        self.cache_dir = inductor_cache / "lmops-decode"
        _keep_precompiled_headers_in(inductor_cache)
        if load_kernels(self.cache_dir, _cpu_instruction_sets()):  # before tracing: the graphs call them
            forward.pack_for_kernels()
        key = _structure_key(forward, pool)
        shapes = [(b, 1) for b in self.sizes] + [(b, self.verify_len) for b in self.verify_sizes]
        self.scheduler_steps = scheduler_steps
        log.info(
            "compiling decode for (batch size, tokens) %s and runs of up to %d steps of one sequence "
            "(on 2 CPU cores: 50-100 s the first time, 1-3 s from %s after that; LMOPS_COMPILE=0 skips it)",
            shapes,
            scheduler_steps,
            self.cache_dir,
        )
        t = time.perf_counter()
        self.graphs_compiled = 0  # the rest come from the cache (a shared one: docs/deploy.md)
        graphs = {
            (b, n): self._load_or_compile(
                one_step, f"{key}-b{b}" + f"t{n}" * (n > 1), lambda b=b, n=n: self._step_inputs(b, n)
            )
            for b, n in shapes
        }
        # With multi-step decoding, a lone sequence's runs of up to S steps, by whether they
        # draw (sampled) or take the argmax.
        lone = {
            s: self._load_or_compile(
                run,
                f"{key}-b1s{scheduler_steps}" + "-sampled" * s,
                lambda s=s: self._step_inputs(1, scheduler_steps, self._run_inputs(1, s)),
            )
            for s in ([True, False] if scheduler_steps > 1 else [])
        }
        # With prompt lookup (speculative decoding without a draft model), a lone greedy
        # sequence's runs draft and verify in the graph's loop too (`_eager_lookup_run`): runs
        # of up to S passes of the loop, each making up to 1 + K tokens.
        # `lookup_tokens`: the most tokens such a run makes (the scheduler's lookahead), 0 if none.
        lookup, self.lookup_tokens = None, 0
        if prompt_lookup and num_speculative_tokens and scheduler_steps > 1:
            self.lookup_tokens = tokens = scheduler_steps * self.verify_len
            self.history_len = model.config.max_seq_len + tokens + num_speculative_tokens
            lookup = self._load_or_compile(
                torch.compile(self._eager_lookup_run, fullgraph=True, options=options),
                f"{key}-b1s{tokens}k{num_speculative_tokens}-lookup",
                lambda: self._step_inputs(1, tokens, self._lookup_inputs(tokens)),
            )
        # The draw of a plain step's sampled rows, after its graph: one graph for any number of
        # rows, so the step graphs stay free of the sampler (benchmarks/README.md, "Batched
        # sampled steps draw in a graph too").
        draw = torch.compile(plain_draw, fullgraph=True, options=options)
        draw = self._load_or_compile(draw, f"{key}-draw", self._draw_inputs)
        # A lone sequence's prompt chunk (its time to first token): one graph for any length
        # from PREFILL_MIN_TOKENS up (benchmarks/README.md, "The prefill in a graph").
        prefill = torch.compile(self._eager_prefill, fullgraph=True, options=options)
        prefill = self._load_or_compile(prefill, f"{key}-prefill", self._prefill_inputs)
        # Kept on self only now: dynamo pickles what the traced method's `self` holds into a
        # graph's guards, and a compiled graph there cannot be pickled.
        self._steps, self._lone, self._lookup, self._draw, self._prefill = graphs, lone, lookup, draw, prefill
        self.compile_seconds = time.perf_counter() - t
        total = len(graphs) + len(lone) + (lookup is not None) + 2  # and the draw and prefill graphs
        log.info(
            "compiled decode in %.1f s (%d graphs: %d loaded from the cache, %d compiled), "
            "few-row products and attention through %s",
            self.compile_seconds,
            total,
            total - self.graphs_compiled,
            self.graphs_compiled,
            "lmops' kernels" if kernels_loaded() else "inductor's loops",
        )

    def _load_or_compile(self, compiler, name: str, example) -> AOTCompiledFunction:
        """`compiler`'s graph `name` from the on-disk cache, else compiled for the inputs
        `example()` makes (their static and symbolic dimensions marked) and saved there.
        aot_compile bypasses inductor's own cache (it compiled afresh, 30 s for the
        default model's 5 sizes, at every start); a saved graph loads in milliseconds."""
        from torch._dynamo.aot_compile import AOTCompiledFunction
        from torch._guards import TracingContext, tracing

        path = self.cache_dir / f"{name}.bin"
        if str(path) in _LOADED:
            return _LOADED[str(path)]
        step = None
        if path.is_file():
            try:
                # Inside a tracing context: a run's graph (while_loop) holds a guard on torch's
                # pytree registry whose source registers itself with the current trace when
                # unpickled (torch 2.13), and fails outside one. (No guard is checked: see below.)
                with tracing(TracingContext(None)):
                    step = AOTCompiledFunction.deserialize(path.read_bytes())
            except Exception as exc:  # e.g. truncated by a full disk: compile again
                log.warning("compiled decode: ignoring unreadable cache %s: %s", path, exc)
        if step is None:
            with torch.inference_mode():
                step = compiler.aot_compile((example(), {}))
            self.graphs_compiled += 1
            try:
                atomic.write_bytes(path, AOTCompiledFunction.serialize(step).serialized_data)
            except OSError as exc:
                log.warning("compiled decode: cannot cache %s: %s", path, exc)
            step.disable_guard_check()
            return step  # not kept: a step's graph compiled here holds this engine (its _eager_step)
        step.disable_guard_check()
        _LOADED[str(path)] = step
        return step

    def _eager_step(self, meta, tables) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Logits (B * T, vocab), their argmax (B * T,) (a greedy row's draw, without the
        sampler's dispatches), and the step's K/V of every layer, (layers, 2 * Hkv, B * T, D)."""
        groups = self.forward.n_head // self.forward.n_kv
        attn = DecodeAttention(DecodeAttention.gather(self.pool.kv, tables), meta[3], groups)
        logits = self.forward.logits(self.forward(meta[0], meta[1], attn))
        return logits, logits.argmax(-1), torch.stack(attn.new_kv)

    def _eager_prefill(self, meta, tables) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A fresh prompt's first chunk of T tokens (T symbolic; nothing cached before it, so
        `tables` is not read): the last row's logits (1, vocab) and argmax (1,), and the
        chunk's K/V (layers, 2 * Hkv, T, D). Only the last row goes through the LM head: the
        prompt's own log-probs take the eager path."""
        attn = PrefillAttention()
        logits = self.forward.logits(self.forward(meta[0], meta[1], attn)[-1:])
        return logits, logits.argmax(-1), torch.stack(attn.new_kv)

    def _eager_run(
        self, meta, tables, steps, knobs=None, top_k=None, noise=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Multi-step decoding: `steps` (a tensor: up to `meta.shape[1]`, S) steps of one
        sequence, a loop in the graph (`while_loop`: its body is compiled once, whatever S),
        step j's input the token of step j - 1 (meta's ids after the first are not read). The
        token is the argmax, or with `plain_draw_inputs` (knobs, top_k, noise) the draw from
        noise row j. The run's tokens (S,) and K/V (layers, 2 * Hkv, S, D); rows from `steps`
        on are not computed (zeros, and their slots in meta the scratch block's; their noise
        is not read)."""
        fw = self.forward
        S, groups = meta.shape[1], fw.n_head // fw.n_kv
        context = DecodeAttention.gather(self.pool.kv, tables)

        def step(j, ids, ahead, tokens):
            row = meta.index_select(1, j)  # (4, 1): this step's id (unread), position, slot, cached
            attn = DecodeAttention(context, row[3], groups, (ahead, j))
            logits = fw.logits(fw(ids, row[1], attn))
            ids = (
                logits.argmax(-1)
                if noise is None
                else plain_draw(logits, knobs, top_k, noise.index_select(0, j))
            )
            return j + 1, ids, torch.stack(attn.new_kv), tokens.index_copy(0, j, ids)

        shape = (len(fw.layers), 2 * fw.n_kv, S, fw.head_dim)
        start = (meta.new_zeros(1), meta[0, :1].clone(), self.pool.kv.new_zeros(shape), meta.new_zeros(S))
        _, _, ahead, tokens = while_loop(lambda j, *_: j[0] < steps, step, start)
        return tokens, ahead

    def _eager_lookup_run(
        self, meta, tables, steps, history, length
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Multi-step decoding of a greedy sequence with prompt lookup in the loop: each pass
        looks for K draft tokens in the tokens so far (`lookup_draft` on `history`, whose first
        `length` are the sequence's, and the run's after them; a match of LOOKUP_MIN_MATCH
        tokens or more). Where it finds them, the pass verifies them in one forward of 1 + K
        rows and keeps the draft's prefix that greedy decoding agrees with and greedy's next
        token; where not, it is a plain step of one row (`torch.cond`: a 1 + K-row forward
        costs about two of one row). Until `steps` (a tensor, up to S) tokens: greedy's
        tokens, in fewer forwards and no Python between them. The run's tokens (S,), its
        (drafted, kept) draft tokens (2,), and the K/V of its S rows (as `_eager_run`'s: rows
        from `steps` on are not computed)."""
        fw = self.forward
        S, K, groups = meta.shape[1], self.verify_len - 1, fw.n_head // fw.n_kv
        context = DecodeAttention.gather(self.pool.kv, tables)
        last_position = fw.cos.shape[0] - 1

        def forward_pass(T: int):
            """A pass of T rows: the last token and the draft's first T - 1."""
            rows = torch.arange(T, device=meta.device)
            cached = meta[3, :1].repeat(T)  # every row sees the keys cached before the run

            def run(n, last, ahead, tokens, history, counts, draft, own):
                j = n + rows  # the run's rows of this pass's tokens
                attn = DecodeAttention(context, cached, groups, (ahead, j))
                positions = (meta[1, :1] + j).clamp(max=last_position)  # a draft past the end is not kept
                best = fw.logits(fw(torch.cat((last, draft[: T - 1])), positions, attn)).argmax(-1)
                room = steps - n - 1  # tokens the run may still keep after this pass's own
                agree = (best[: T - 1] == draft[: T - 1]).long().cumprod(0)
                kept = torch.minimum(agree.sum(0, keepdim=True), room)
                counts = counts + torch.cat((torch.minimum(own, room), torch.minimum(kept, own)))
                history = history.index_copy(0, length + j, best)  # past the kept ones: overwritten
                tokens = tokens.index_copy(0, j, best)
                return (
                    n + kept + 1,
                    best.index_select(0, kept),
                    torch.stack(attn.new_kv),
                    tokens,
                    history,
                    counts,
                )

            return run

        verify, plain = forward_pass(K + 1), forward_pass(1)

        def step(n, last, ahead, tokens, history, counts):
            draft, own = lookup_draft(history, length + n, K, min_n=LOOKUP_MIN_MATCH)
            return torch.cond(
                own[0] > 0, verify, plain, (n, last, ahead, tokens, history, counts, draft, own)
            )

        shape = (len(fw.layers), 2 * fw.n_kv, S + K, fw.head_dim)
        start = (
            meta.new_zeros(1),
            meta[0, :1].clone(),
            self.pool.kv.new_zeros(shape),
            meta.new_zeros(S + K),
            history.clone(),
            meta.new_zeros(2),
        )
        _, _, ahead, tokens, _, counts = while_loop(lambda n, *_: n[0] < steps, step, start)
        return tokens[:S], counts, ahead[:, :, :S]

    def _step_inputs(self, size: int, tokens: int, extra: tuple = ()) -> tuple:
        """A step graph's example inputs for `size` sequences of `tokens` rows, then `extra` (a
        run's step count and draw inputs: `_eager_run`). Only the table width is symbolic. The
        rows and sequences are the size's own: dynamo would make them symbolic from the second
        size on (it marks a dimension dynamic once it has seen it change), and code for any
        number of rows is slower."""
        meta, tables = self._inputs([], size, tokens)
        for x in (meta, *extra):
            torch._dynamo.mark_static(x)
        torch._dynamo.mark_static(tables, 0)
        torch._dynamo.mark_dynamic(tables, 1)
        return meta, tables, *extra

    def _prefill_inputs(self) -> tuple:
        """The prefill graph's example inputs: a chunk of 2 x PREFILL_MIN_TOKENS tokens, its
        length symbolic from PREFILL_MIN_TOKENS to the model's context (so the products'
        choice of aten.mm holds for every length), as the table width."""
        meta, tables = self._inputs([], 1, 2 * PREFILL_MIN_TOKENS)
        max_len = self.forward.model.config.max_seq_len
        torch._dynamo.mark_dynamic(meta, 1, min=PREFILL_MIN_TOKENS, max=max_len)
        torch._dynamo.mark_static(tables, 0)
        torch._dynamo.mark_dynamic(tables, 1)
        return meta, tables

    def _draw_inputs(self) -> tuple:
        """The draw graph's example inputs: `plain_draw`'s (float32 logits) for a few rows, the
        rows symbolic (at least two: a symbolic size of 1 would be specialised)."""
        rows, device = 4, self.device
        inputs = (
            torch.zeros(rows, self.vocab, device=device),
            torch.tensor([[1.0, 1.0, 0.0]] * rows, device=device),
            torch.full((rows, 1), self.vocab, device=device),
            torch.rand(rows, self.vocab, device=device),
        )
        for x in inputs:
            torch._dynamo.mark_dynamic(x, 0)
        return inputs

    def _run_inputs(self, steps: int, sampled: bool, seq: Sequence | None = None) -> tuple:
        """What a run's graph reads after the step's inputs: its step count, and a sampled
        run's `plain_draw_inputs` (`seq`'s; noise for `steps` draws in the graph's S rows)."""
        count = torch.tensor(steps, device=self.device)
        if not sampled:
            return (count,)
        params, generator = (seq.params, seq.generator) if seq is not None else (SamplingParams(), None)
        return count, *plain_draw_inputs(
            params, generator, steps, self.vocab, self.device, self.scheduler_steps
        )

    def _lookup_inputs(self, steps: int, seq: Sequence | None = None) -> tuple:
        """What a lookup run's graph reads after the step's inputs: its step count, `seq`'s
        tokens padded to `history_len` with zeros, and how many they are. The tokens go in
        through an `array` (a C copy): `torch.tensor` of the list reads it an int at a time
        (50 us for the default model's context, 330 us for 2,048 tokens, against 18 and 30)."""
        tokens = seq.token_ids if seq is not None else [0, 0]
        history = torch.zeros(self.history_len, dtype=torch.long, device=self.device)
        history[: len(tokens)] = torch.frombuffer(array("q", tokens), dtype=torch.long)
        return (
            torch.tensor(steps, device=self.device),
            history,
            torch.tensor([len(tokens)], device=self.device),
        )

    def _run(
        self, seqs: list[Sequence], graph, size: int, tokens: int, extra: tuple = (), own: int = 1
    ) -> list[torch.Tensor]:
        """`graph` (of `size` sequences, `tokens` rows each) on `seqs`, padded: its outputs but
        the last, the K/V of every row, which is written into the pool. `own`: `_inputs`'."""
        meta, tables = self._inputs(seqs, size, tokens, own)
        *outputs, new_kv = graph(self, meta, tables, *extra)
        kv = self.pool.kv
        L, H2, nb, bs, D = kv.shape
        kv.view(L, H2, nb * bs, D).index_copy_(2, meta[2], new_kv)
        return outputs

    def _inputs(
        self, seqs: list[Sequence], size: int, tokens: int, own: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(4, size * tokens): ids, positions, slots and cached keys seen, `tokens` rows a
        sequence (its `own` tokens from its first uncomputed one: its last token, or a prompt
        chunk's; then its draft); (size, width) block tables. Padded, to
        `tokens` rows a sequence and to `size` sequences, with rows that write only the
        scratch block (causal attention keeps them out of the real rows). A multi-step
        sequence's rows after the first are its lookahead: ids the graph makes itself."""
        bs = self.block_size
        ids, pos, slots, cached, tables = [], [], [], [], []
        width = 2
        for s in seqs:
            p = s.num_computed_tokens
            new = s.token_ids[p : p + own] + s.draft + [0] * s.lookahead
            fill = tokens - len(new)
            ids += new + [0] * fill
            pos += list(range(p, p + len(new))) + [p] * fill
            slots += [s.block_table[q // bs] * bs + q % bs for q in range(p, p + len(new))]
            slots += [self.scratch_slot] * fill
            cached += [p] * tokens
            n = (p + len(new) - 1) // bs + 1
            tables.append(s.block_table[:n])
            width = max(width, n)
        pad = (size - len(seqs)) * tokens
        meta = [ids + [0] * pad, pos + [0] * pad, slots + [self.scratch_slot] * pad, cached + [0] * pad]
        tables += [[]] * (size - len(seqs))
        tables = [t + [self.scratch_block] * (width - len(t)) for t in tables]
        return torch.tensor(meta, device=self.device), torch.tensor(tables, device=self.device)

    def run(
        self, seqs: list[Sequence], num_new: list[int]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, tuple[int, int] | None] | None:
        """If this is a step it serves (every sequence a decode, with or without a draft, or
        a lone sequence's prompt chunk: `_prefill_run`): logits, one row per sequence and draft token, in the runner's order (a sequence's
        draft rows first, as RunnerOutput), and each row's token where the graph made every
        row's (a plain step of `graph_draws` sequences; a verifying one of greedy ones: the
        argmax), else None in its place; for a lone
        `graph_draw` sequence's run, no logits (None) and its tokens (its lookahead's first,
        as RunnerOutput); then a greedy lookup run's (drafted, kept) draft tokens, else None.
        None if it does not serve the step."""
        if any(s.num_computed_tokens != s.num_tokens - 1 for s in seqs):
            return self._prefill_run(seqs, num_new)
        seq = seqs[0]
        if seq.lookahead:  # the scheduler's, for a lone sequence that `graph_draws` only
            steps, sampled = 1 + seq.lookahead, not seq.params.greedy
            if self.lookup_tokens and not sampled:
                extra = self._lookup_inputs(steps, seq)
                tokens, counts = self._run(seqs, self._lookup, 1, self.lookup_tokens, extra)
                drafted, kept = counts.tolist()
                return None, tokens[:steps], (drafted, kept)
            extra = self._run_inputs(steps, sampled, seq)
            (tokens,) = self._run(seqs, self._lone[sampled], 1, self.scheduler_steps, extra)
            return None, tokens[:steps], None
        tokens = 1 if all(n == 1 for n in num_new) else self.verify_len
        sizes = self.sizes if tokens == 1 else self.verify_sizes
        if not sizes or len(seqs) > sizes[-1] or max(num_new) > tokens:
            return None
        size = next(b for b in sizes if b >= len(seqs))
        logits, argmax = self._run(seqs, self._steps[size, tokens], size, tokens)
        if tokens == 1:
            logits, argmax = logits[: len(seqs)], argmax[: len(seqs)]
            # The graphs make every row's token or none (a seeded request's generator is read
            # once a step, wherever its draw is made).
            if not all(s.graph_draws for s in seqs):
                return logits, None, None
            if all(s.params.greedy for s in seqs):
                return logits, argmax, None
            return logits, self._draw(logits, *batch_draw_inputs(seqs, self.vocab, self.device)), None
        rows = [b * tokens + j for b, n in enumerate(num_new) for j in range(n)]
        rows = torch.tensor(rows, device=self.device)
        greedy = all(s.params.greedy and s.graph_draws for s in seqs)  # a draft's verdict: greedy_verdict
        return logits[rows], argmax[rows] if greedy else None, None

    def _prefill_run(
        self, seqs: list[Sequence], num_new: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None, None] | None:
        """`run` for a step of one sequence's first prompt chunk (nothing cached: after a
        prefix cache hit, or a later chunk, the prefill is shorter, and eager) of
        PREFILL_MIN_TOKENS tokens or more that does not score its prompt (log-probs read every
        row): the last row's logits where the chunk ends the prompt (none before), and its
        argmax where that is the sequence's draw; None for any other step."""
        seq, n = seqs[0], num_new[0]
        if len(seqs) != 1 or n < PREFILL_MIN_TOKENS or seq.num_computed_tokens or seq.scoring:
            return None
        logits, argmax = self._run(seqs, self._prefill, 1, n, own=n)
        if seq.num_computed_tokens + n < seq.num_tokens:
            return logits[:0], None, None
        return logits, argmax if seq.params.greedy and seq.graph_draws else None, None


def lookup_draft(
    history: torch.Tensor, length: torch.Tensor, k: int, max_n: int = 3, min_n: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """scheduler.ngram_draft in tensors, for a graph: the k tokens after the latest earlier
    occurrence of the last n of `history`'s first `length` (1,) tokens, for the longest
    min_n <= n <= max_n that occurs, an occurrence with k tokens after it first; and how many of them
    ngram_draft would propose (1,) (0 where none occurs; fewer than k where the occurrence
    has fewer tokens after it). The rest are read from `history` whatever lies there (past
    `length`; the start, where none occurs): a draft token is kept only where greedy decoding
    agrees with it, and is counted as a draft only if it is the sequence's own."""
    size = history.shape[0]
    index = torch.arange(size, device=history.device)
    latest = []  # the draft's start in history, or -1, by (n, tokens after) in preference order
    for n in range(max_n, min_n - 1, -1):
        tail = history.index_select(0, (length - n + index[:n]).clamp(min=0))
        windows = torch.stack([history[i : size - n + 1 + i] for i in range(n)])
        ends = index[: size - n + 1] + n  # the token after each window
        match = (windows == tail.view(n, 1)).all(0)
        for after in (k, 1):
            latest.append(torch.where(match & (ends + after <= length), ends, -1).max())
    latest = torch.stack(latest)
    hit = latest >= 0
    start = latest.index_select(0, hit.long().argmax().view(1))  # the first preference that occurs
    own = torch.where(start >= 0, (length - start).clamp(max=k), 0)
    return history.index_select(0, (start.clamp(min=0) + index[:k]).clamp(max=size - 1)), own


def _keep_precompiled_headers_in(directory: Path) -> None:
    """Keep inductor's precompiled C++ headers in `directory`. It builds them (about 150 MB)
    when it compiles a graph and looks for them when it loads one, in
    $TMPDIR/torchinductor_<user> whatever TORCHINDUCTOR_CACHE_DIR says (torch 2.13's
    `codecache._HEADER_DIR`): in a new container /tmp is empty, so every start built them
    again, 4.1 s of the 4.7 s that loading the default model's 8 graphs took. Beside the
    graphs, a compile cache shared by pods (docs/deploy.md) carries them too, built under
    inductor's file lock there."""
    from torch._inductor import codecache

    headers = str(directory / "precompiled_headers")
    if headers != codecache._HEADER_DIR:
        codecache._HEADER_DIR, codecache._HEADER_LOCK_DIR = headers, os.path.join(headers, "locks")
        codecache._precompile_header.cache_clear()  # it memoises the paths it returned


def _structure_key(forward: FusedForward, pool: KVPool) -> str:
    """What a saved graph depends on, since no guard checks it at run time: torch and
    Python, the CPU and thread count it was compiled for, whether it calls lmops' kernels,
    the lmops source it was traced from (the kernels' C++ too), the model config (its sizes
    and eps are constants in the graph), and the kind, shape, dtype and strides of every
    tensor the graph reads (weights after fusing and quantizing, their copies packed for lmops'
    kernel, RoPE tables, the KV pool).
    Not the weights' values, which each call reads afresh. (The pool's size is in it too:
    where free memory sizes the pool, a restart may miss the cache and compile again.)"""
    from torch._inductor.utils import parallel_num_threads  # inductor writes it into the OpenMP loops

    h = hashlib.sha256(f"{torch.__version__} {sys.version} {forward.model.config!r}".encode())
    h.update(
        f"{_cpu_instruction_sets()} threads={parallel_num_threads()} kernels={kernels_loaded()}".encode()
    )
    source = Path(lmops.__file__).parent
    for f in sorted([*source.rglob("*.py"), *source.rglob("*.cpp")]):
        h.update(f.read_bytes())
    m = forward.model
    reads = [m.model.embed_tokens.weight, m.model.norm.weight, m.lm_head.weight, forward.cos]
    reads += [forward.sin_signed, pool.kv, *(w for layer in forward.layers for w in layer), *forward.qk_norms]
    reads += forward.packed_tensors()
    h.update(";".join(map(_describe, reads)).encode())
    return h.hexdigest()[:32]


def _describe(x) -> str:
    """A tensor's layout; for a weight object such as quantize.Int8Weight, its tensors'."""
    if isinstance(x, torch.Tensor):
        return f"{tuple(x.shape)} {x.dtype} {x.stride()} {x.device.type}"
    return f"{type(x).__name__}({','.join(_describe(v) for v in vars(x).values())})"


def _cpu_instruction_sets() -> str:
    """The instruction sets the generated code may use: inductor compiles for its chosen
    vector ISA and with -march=native (as kernels.py does), so a graph or kernel library
    cached on one CPU (a shared cache volume) could crash another with an illegal instruction."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.is_file() else []
    keep = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return f"{platform.machine()} {pick_vec_isa()} {keep}"
