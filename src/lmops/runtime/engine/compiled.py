"""The compiled decode step: a pure-decode batch padded up to one of a few batch sizes, each
compiled once at engine start, so a step runs as one generated kernel sequence instead of
a few hundred eagerly dispatched small ops (at batch 1 a decode step is mostly that
overhead; see benchmarks/README.md). With speculative decoding, a step whose decodes
carry drafts runs through graphs of 1 + K tokens a sequence the same way (each token sees
its sequence's cache and, causally, the step's earlier tokens). With multi-step decoding
(`num_scheduler_steps` S), a lone decode whose draw a graph can make (greedy, or sampled with
temperature and the filters alone: `SamplingParams.graph_draw`) runs S steps in one graph,
each step's token the next one's input (its
argmax, or its draw: the sampler's filters and race, in the graph, from noise drawn before
the call by the request's generator): one call, and one pass of the Python around it, for S
tokens. A lone sampled decode of one step draws in the graph the same way (a graph of its
own), so the sampler's dispatches leave the single stream's step too.
Any other step (prefills, mixed batches, more sequences than the largest size) takes the
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
import platform
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import lmops
from lmops import atomic
from lmops.runtime.engine.forward import FusedForward
from lmops.runtime.engine.kv_cache import KVPool
from lmops.runtime.engine.sampling import SamplingParams, plain_draw, plain_draw_inputs
from lmops.runtime.engine.sequence import Sequence

if TYPE_CHECKING:
    from torch._dynamo.aot_compile import AOTCompiledFunction

log = logging.getLogger(__name__)

# Powers of two, as vLLM's CUDA-graph sizes: a batch pads to the next one. The gain
# shrinks as a step's matrix products grow (measured in benchmarks/README.md: clear at 4
# sequences, within noise at 16), so larger steps stay eager and engine start stays short.
BATCH_SIZES = (1, 2, 4, 8, 16)
# The graphs this process has loaded from the disk cache, by path (the structure and the
# size name the file): a graph fits every engine of that structure, and each load keeps its compiled
# code in the process for good (about 0.5 MiB an engine), so a replica swapping in new
# versions of one model loads them once (benchmarks/swap.py's memory phase).
_LOADED: dict[str, AOTCompiledFunction] = {}


class DecodeAttention:
    """`PagedAttention` for B decoding sequences of T new tokens each, in tensors only (so
    that it traces): T is 1 for a plain decode, 1 + K for one verifying a K-token draft.

    It reads the pool but does not write it: each token attends to its sequence's cached
    context and, causally, to the step's new K/V, which are collected in `new_kv` and
    written by the caller after the graph (an in-graph write made inductor copy the whole
    pool layer, every layer).
    """

    def __init__(
        self,
        kv: torch.Tensor,
        tables: torch.Tensor,
        cached: torch.Tensor,
        groups: int,
        earlier: list[torch.Tensor] | None = None,
    ):
        """`cached` (B * T,): how many of its sequence's cached keys each row sees; `groups`
        query heads share a KV head; `earlier` (multi-step, one sequence): each layer's K/V
        of the tokens the graph's earlier steps computed, (2 * Hkv, steps, D), seen by every
        row after the cache."""
        self.kv, self.tables, self.earlier = kv, tables, earlier
        self.new_kv: list[torch.Tensor] = []
        B = tables.shape[0]
        self.T = T = cached.shape[0] // B
        width = tables.shape[1] * kv.shape[3]
        steps = 0 if earlier is None else earlier[0].shape[1]
        # (B, T, keys + steps + T): cached key j is visible iff j < the row's cached count;
        # the earlier steps' keys always; the step's new key t to query i iff t <= i.
        old = torch.arange(width, device=kv.device) < cached.view(B, T, 1)
        before = torch.ones(B, T, steps, dtype=torch.bool, device=kv.device)
        new = torch.ones(T, T, dtype=torch.bool, device=kv.device).tril().expand(B, T, T)
        valid = torch.cat((old, before, new), 2)
        rows = torch.zeros(valid.shape, dtype=kv.dtype, device=kv.device).masked_fill(~valid, float("-inf"))
        # The query rows are (head, token) pairs: each token's row, the same for its G heads.
        self.mask = rows[:, None].expand(B, groups, T, -1).reshape(1, B, groups * T, -1)

    def __call__(self, layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """q: (B * T, H, D); kv: (B * T, 2 * Hkv, D) -> (B * T, H, D)."""
        rows, H, D = q.shape
        T, Hkv = self.T, kv.shape[1] // 2
        B, G = rows // T, H // Hkv
        new = kv.transpose(0, 1)  # (2Hkv, B * T, D)
        self.new_kv.append(new)
        ctx = self.kv[layer].index_select(1, self.tables.view(-1)).view(2 * Hkv, B, -1, D)
        if self.earlier is not None:  # one sequence: its rows are the steps' tokens in order
            new = torch.cat((self.earlier[layer], new), 1)
        ctx = torch.cat((ctx, new.view(2 * Hkv, B, -1, D)), 2)
        # (Hkv, B, G * T, D): the G query heads x T tokens that share a KV head.
        qg = q.view(B, T, Hkv, G, D).permute(2, 0, 3, 1, 4).reshape(Hkv, B, G * T, D)
        # Written out, not SDPA: with a few query rows a head, SDPA's flash kernel costs
        # more around its products than they take, and here inductor fuses the scale, mask
        # and softmax into one loop between two batched products (6-12% off the graph at
        # batch 1: benchmarks/README.md, "Single stream").
        scores = (qg @ ctx[:Hkv].transpose(2, 3)) * D**-0.5 + self.mask
        y = scores.softmax(-1) @ ctx[Hkv:]
        return y.view(Hkv, B, G, T, D).permute(1, 3, 0, 2, 4).reshape(rows, H, D)


class CompiledDecode:
    """Decode steps of up to `max(sizes)` sequences through per-size compiled graphs; with
    `num_speculative_tokens` K, also the steps that verify drafts (every sequence a decode
    with up to K draft tokens), through graphs of 1 + K tokens a sequence for the sizes of
    at most 16 tokens in all, so that single-stream speculative decoding runs compiled too;
    a lone sampled decode through a graph that draws its token; with `scheduler_steps` S > 1,
    also S steps of one sequence in one graph, greedy or sampled (a graph each)."""

    def __init__(
        self,
        forward: FusedForward,
        pool: KVPool,
        scratch_block: int,
        max_num_seqs: int,
        num_speculative_tokens: int = 0,
        scheduler_steps: int = 1,
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
        # each call, not baked in, so a graph fits any engine of the same structure.
        # cpp_wrapper: the code that calls the step's kernels is C++ too, not Python
        # (less per step at batch 1; benchmarks/README.md, "Inference engine").
        options = {"cpp_wrapper": True, "guard_filter_fn": lambda guards: [False] * len(guards)}
        one_step = torch.compile(self._eager_step, fullgraph=True, options=options)
        multi_step = torch.compile(self._eager_steps, fullgraph=True, options=options)
        # (Imported here: torch._dynamo takes a second to import, which an engine that
        # does not compile need not pay.)
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        self.cache_dir = Path(cache_dir()) / "lmops-decode"
        key = _structure_key(forward, pool)
        shapes = [(b, 1) for b in self.sizes] + [(b, self.verify_len) for b in self.verify_sizes]
        self.scheduler_steps = scheduler_steps
        log.info(
            "compiling decode for (batch size, tokens) %s%s (on 2 CPU cores: 40-70 s the first time, "
            "2-3 s from %s after that; LMOPS_COMPILE=0 skips it)",
            shapes,
            f", one sampled step{f' and {scheduler_steps} steps' * (scheduler_steps > 1)} of one sequence",
            self.cache_dir,
        )
        t = time.perf_counter()
        graphs = {
            (b, n): self._load_or_compile(one_step, b, n, f"{key}-b{b}" + f"t{n}" * (n > 1))
            for b, n in shapes
        }
        # A lone sequence's graphs that make its tokens, by (steps, sampled): one sampled step,
        # and with multi-step decoding S steps greedy and sampled (one greedy step is `graphs`').
        lone = [(1, True)] + [(scheduler_steps, s) for s in (False, True)] * (scheduler_steps > 1)
        lone = {
            (n, s): self._load_or_compile(multi_step, 1, n, f"{key}-b1s{n}" + "-sampled" * s, s)
            for n, s in lone
        }
        # Kept on self only now: dynamo pickles what the traced method's `self` holds into a
        # graph's guards, and a compiled graph there cannot be pickled.
        self._steps, self._lone = graphs, lone
        self.compile_seconds = time.perf_counter() - t
        log.info("compiled decode in %.1f s", self.compile_seconds)

    def _load_or_compile(
        self, compiler, size: int, tokens: int, name: str, sampled: bool = False
    ) -> AOTCompiledFunction:
        """`compiler`'s graph for `size` sequences of `tokens` rows (`sampled`: taking
        `plain_draw_inputs` too) from the on-disk cache, else compiled and saved there.
        aot_compile bypasses inductor's own cache (it compiled afresh, 30 s for the
        default model's 5 sizes, at every start); a saved graph loads in milliseconds."""
        from torch._dynamo.aot_compile import AOTCompiledFunction

        path = self.cache_dir / f"{name}.bin"
        if str(path) in _LOADED:
            return _LOADED[str(path)]
        step = None
        if path.is_file():
            try:
                step = AOTCompiledFunction.deserialize(path.read_bytes())
            except Exception as exc:  # e.g. truncated by a full disk: compile again
                log.warning("compiled decode: ignoring unreadable cache %s: %s", path, exc)
        if step is None:
            meta, tables = self._inputs([], size, tokens)
            sampling = (
                plain_draw_inputs(SamplingParams(), None, tokens, self.vocab, self.device) if sampled else ()
            )
            # Only the table width is symbolic. The rows and sequences are the size's own:
            # dynamo would make them symbolic from the second size on (it marks a dimension
            # dynamic once it has seen it change), and code for any number of rows is slower.
            for x in (meta, *sampling):
                torch._dynamo.mark_static(x)
            torch._dynamo.mark_static(tables, 0)
            torch._dynamo.mark_dynamic(tables, 1)
            with torch.inference_mode():
                step = compiler.aot_compile(((meta, tables, *sampling), {}))
            try:
                atomic.write_bytes(path, AOTCompiledFunction.serialize(step).serialized_data)
            except OSError as exc:
                log.warning("compiled decode: cannot cache %s: %s", path, exc)
            step.disable_guard_check()
            return step  # not kept: a graph compiled here holds this engine (its _eager_step)
        step.disable_guard_check()
        _LOADED[str(path)] = step
        return step

    def _eager_step(self, meta, tables) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Logits (B * T, vocab), their argmax (B * T,) (a greedy row's draw, without the
        sampler's dispatches), and the step's K/V of every layer, (layers, 2 * Hkv, B * T, D)."""
        groups = self.forward.n_head // self.forward.n_kv
        attn = DecodeAttention(self.pool.kv, tables, meta[3], groups)
        logits = self.forward.logits(self.forward(meta[0], meta[1], attn))
        return logits, logits.argmax(-1), torch.stack(attn.new_kv)

    def _eager_steps(
        self, meta, tables, knobs=None, top_k=None, noise=None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Multi-step decoding: `meta.shape[1]` steps of one sequence, step j's input the
        token of step j - 1 (meta's ids after the first are not read), each attending to the
        cache and to the K/V of the steps before it. The token is the argmax, or with
        `plain_draw_inputs` (knobs, top_k, noise) the draw from noise row j.
        `_eager_step`'s outputs (the argmax's place taken by the tokens), a row a step."""
        groups = self.forward.n_head // self.forward.n_kv
        ids, earlier = meta[0, :1], None
        logits, tokens = [], []
        for j in range(meta.shape[1]):
            attn = DecodeAttention(self.pool.kv, tables, meta[3, j : j + 1], groups, earlier)
            logits.append(self.forward.logits(self.forward(ids, meta[1, j : j + 1], attn)))
            ids = (
                logits[-1].argmax(-1)
                if noise is None
                else plain_draw(logits[-1], knobs, top_k, noise[j : j + 1])
            )
            tokens.append(ids)
            earlier = (
                attn.new_kv
                if earlier is None
                else [torch.cat(p, 1) for p in zip(earlier, attn.new_kv, strict=True)]
            )
        return torch.cat(logits), torch.cat(tokens), torch.stack(earlier)

    def _run(
        self, seqs: list[Sequence], graph, size: int, tokens: int, sampling: tuple = ()
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`graph` (of `size` sequences, `tokens` rows each) on `seqs`, padded: logits and
        tokens of every row; the step's K/V written into the pool."""
        meta, tables = self._inputs(seqs, size, tokens)
        logits, drawn, new_kv = graph(self, meta, tables, *sampling)
        kv = self.pool.kv
        L, H2, nb, bs, D = kv.shape
        kv.view(L, H2, nb * bs, D).index_copy_(2, meta[2], new_kv)
        return logits, drawn

    def _inputs(self, seqs: list[Sequence], size: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(4, size * tokens): ids, positions, slots and cached keys seen, `tokens` rows a
        sequence (its last token, then its draft); (size, width) block tables. Padded, to
        `tokens` rows a sequence and to `size` sequences, with rows that write only the
        scratch block (causal attention keeps them out of the real rows). A multi-step
        sequence's rows after the first are its lookahead: ids the graph makes itself."""
        bs = self.block_size
        ids, pos, slots, cached, tables = [], [], [], [], []
        width = 2
        for s in seqs:
            p = s.num_computed_tokens
            new = [s.token_ids[p], *s.draft] + [0] * s.lookahead
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
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """If this is a step it serves (every sequence a decode, with or without a draft):
        logits, one row per sequence and draft token, in the runner's order (a sequence's
        draft or lookahead rows first, as RunnerOutput), and each row's token where the graph
        made every row's (plain greedy rows: the argmax; a lone `graph_draw` sequence: its
        draws), else None in its place; None if it does not serve the step."""
        if any(s.num_computed_tokens != s.num_tokens - 1 for s in seqs):
            return None
        seq = seqs[0]
        steps, sampled = 1 + seq.lookahead, not seq.params.greedy
        # A lookahead is the scheduler's for a lone sequence that `graph_draws` only.
        if seq.lookahead or (len(seqs) == 1 and num_new == [1] and sampled and seq.graph_draws):
            inputs = (
                plain_draw_inputs(seq.params, seq.generator, steps, self.vocab, self.device)
                if sampled
                else ()
            )
            return self._run(seqs, self._lone[steps, sampled], 1, steps, inputs)
        tokens = 1 if all(n == 1 for n in num_new) else self.verify_len
        sizes = self.sizes if tokens == 1 else self.verify_sizes
        if not sizes or len(seqs) > sizes[-1] or max(num_new) > tokens:
            return None
        size = next(b for b in sizes if b >= len(seqs))
        logits, argmax = self._run(seqs, self._steps[size, tokens], size, tokens)
        if tokens == 1:
            logits, argmax = logits[: len(seqs)], argmax[: len(seqs)]
        else:
            rows = [b * tokens + j for b, n in enumerate(num_new) for j in range(n)]
            rows = torch.tensor(rows, device=self.device)
            logits, argmax = logits[rows], argmax[rows]
        return logits, argmax if all(s.params.greedy and s.graph_draws for s in seqs) else None


def _structure_key(forward: FusedForward, pool: KVPool) -> str:
    """What a saved graph depends on, since no guard checks it at run time: torch and
    Python, the CPU and thread count it was compiled for, the lmops source it was traced
    from, the model config (its sizes and eps are constants in the graph), and the kind,
    shape, dtype and strides of every tensor the graph reads (weights after fusing and
    quantizing, RoPE tables, the KV pool). Not the weights' values, which each call reads
    afresh. (The pool's size is in it too: where free memory sizes the pool, a restart
    may miss the cache and compile again.)"""
    h = hashlib.sha256(f"{torch.__version__} {sys.version} {forward.model.config!r}".encode())
    h.update(_cpu_signature().encode())
    for f in sorted(Path(lmops.__file__).parent.rglob("*.py")):
        h.update(f.read_bytes())
    m = forward.model
    reads = [m.model.embed_tokens.weight, m.model.norm.weight, m.lm_head.weight, forward.cos]
    reads += [forward.sin_signed, pool.kv, *(w for layer in forward.layers for w in layer), *forward.qk_norms]
    h.update(";".join(map(_describe, reads)).encode())
    return h.hexdigest()[:32]


def _describe(x) -> str:
    """A tensor's layout; for a weight object such as quantize.Int8Weight, its tensors'."""
    if isinstance(x, torch.Tensor):
        return f"{tuple(x.shape)} {x.dtype} {x.stride()} {x.device.type}"
    return f"{type(x).__name__}({','.join(_describe(v) for v in vars(x).values())})"


def _cpu_signature() -> str:
    """The instruction sets the generated code may use: inductor compiles for its chosen
    vector ISA and with -march=native, so a graph cached on one CPU (a shared cache
    volume) could crash another with an illegal instruction. And the thread count, which
    inductor writes into the generated OpenMP loops."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    from torch._inductor.utils import parallel_num_threads

    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.is_file() else []
    keep = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return f"{platform.machine()} {pick_vec_isa()} {keep} threads={parallel_num_threads()}"
