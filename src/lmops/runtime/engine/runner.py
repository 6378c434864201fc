"""Runs one scheduled step: packs all sequences' new tokens into one batch, runs the model
over the paged cache, returns logits only where a token is to be sampled.

Packing (T = all new tokens, per-token positions) means mixed prompt lengths never pad
the projections or MLPs. Attention lives in `PagedAttention`: it first writes the
step's K/V into their slots (all sequences, before any read, so a block filled in this
very step can already be shared by a prefix-cache hit), then attends through block
tables. Sequences with the same small number of new tokens (decodes: 1; short prompt
tails after a prefix-cache hit) go in groups of similar context length, each served by
one index_select of their blocks and one attention call; fresh prompts use causal
attention on their own K/V; long chunks after cached context, one sequence at a time.
The layers' math is forward.py's, which the compiled decode graph (compiled.py) runs too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lmops.runtime.engine.compiled import CompiledDecode
from lmops.runtime.engine.forward import FusedForward, causal_attention
from lmops.runtime.engine.kv_cache import KVPool
from lmops.runtime.engine.scheduler import ScheduledBatch
from lmops.runtime.engine.sequence import PromptScores, Sequence
from lmops.runtime.model import Llama

log = logging.getLogger(__name__)

# On CPU a context group is padded to its longest member and a new group starts when padding
# would exceed this fraction of the group's real blocks (gathers cost memory bandwidth). On
# CUDA bandwidth is plentiful and kernel launches are not: one group.
_MAX_PAD_FRACTION = 0.1
# cuDNN attention (preferred by recent torch on Hopper) builds a plan per new shape, and every
# step brings new context lengths: the flash / memory-efficient kernels have no such cost.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


# Groups only for short query runs: the mask is (members, G * n, context).
_MAX_GROUP_QUERY = 64


@dataclass
class RunnerOutput:
    """What one step computed: float32 logits for the sequences due a token (one row each, in
    `batch.ready` order; a drafted one's draft rows first, a multi-step one's lookahead rows
    first), and the prompt positions scored (drift signal, prompt_logprobs)."""

    logits: torch.Tensor | None  # None: a compiled run of one sequence, which keeps its tokens only
    prompt_scores: list[PromptScores]
    # Each row's token, where the compiled graph made every row's: its argmax or draw (a plain
    # decode step of `graph_draws` sequences), or a lone sequence's run.
    tokens: torch.Tensor | None = None
    # (drafted, kept) draft tokens of a run that drafted and verified in the graph (prompt lookup).
    speculation: tuple[int, int] | None = None


@dataclass
class ContextGroup:
    rows: slice  # B members x n rows of the packed batch, member-major
    n: int  # new tokens per member (1 for decodes)
    block_ids: torch.Tensor  # (B * max_blocks,) block tables, padded, flattened
    mask: torch.Tensor  # (1, B, G * n or 1, max_blocks * block_size) additive: 0 or -inf


@dataclass
class PrefillSeg:
    rows: slice
    block_ids: torch.Tensor | None  # blocks holding the whole context, None if nothing cached
    mask: torch.Tensor | None  # (n, context) additive causal mask over the cached prefix too


class PagedAttention:
    """Attention through block tables for one step (the runner's fused forward calls it per layer)."""

    def __init__(
        self, pool: KVPool, slot_mapping: torch.Tensor, groups: list[ContextGroup], prefills: list[PrefillSeg]
    ):
        self.pool, self.slot_mapping = pool, slot_mapping
        self.groups, self.prefills = groups, prefills
        # One gather buffer for the step, reused by every group and layer.
        self._workspace: torch.Tensor | None = None
        per_block = pool.kv.shape[1] * pool.kv.shape[3] * pool.kv.shape[4]
        self._workspace_size = max((g.block_ids.shape[0] for g in groups), default=0) * per_block

    def __call__(self, layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """q: (T, H, D); kv: (T, 2 * Hkv, D), K heads then V heads -> (T, H, D)."""
        T, H, D = q.shape
        Hkv = kv.shape[1] // 2
        cache = self.pool.kv[layer]  # (2Hkv, blocks, bs, D)
        nb, bs = cache.shape[1], cache.shape[2]
        cache.view(2 * Hkv, nb * bs, D).index_copy_(1, self.slot_mapping, kv.transpose(0, 1))
        blocks = cache.view(2 * Hkv, nb, bs * D)
        if len(self.groups) == 1 and not self.prefills:
            return self._group(self.groups[0], q, blocks, Hkv)
        out = torch.empty_like(q)
        for g in self.groups:
            out[g.rows] = self._group(g, q[g.rows], blocks, Hkv)
        for p in self.prefills:
            if p.block_ids is None:
                out[p.rows] = causal_attention(q[p.rows], kv[p.rows])
                continue
            qs = q[p.rows].transpose(0, 1)[None]  # (1, H, n, D)
            ctx = blocks.index_select(1, p.block_ids).view(2 * Hkv, -1, D)[None, :, : p.mask.shape[1]]
            ks, vs = ctx.split(Hkv, 1)
            y = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=p.mask, enable_gqa=True)
            out[p.rows] = y[0].transpose(0, 1)
        return out

    def _group(self, g: ContextGroup, q: torch.Tensor, blocks: torch.Tensor, Hkv: int) -> torch.Tensor:
        # Batch axes (Hkv, B): the G query heads x n tokens of each member that share one KV
        # head form its query rows; keys are the member's gathered blocks.
        rows, H, D = q.shape
        B, n, G = rows // g.n, g.n, H // Hkv
        size = g.block_ids.shape[0] * blocks.shape[0] * blocks.shape[2]
        if self._workspace is None or self._workspace.numel() < size:
            self._workspace = blocks.new_empty(max(size, self._workspace_size))
        ctx = self._workspace[:size].view(blocks.shape[0], -1, blocks.shape[2])
        torch.index_select(blocks, 1, g.block_ids, out=ctx)
        ctx = ctx.view(2 * Hkv, B, -1, D)
        qg = q.view(B, n, Hkv, G, D).permute(2, 0, 3, 1, 4).reshape(Hkv, B, G * n, D)
        y = F.scaled_dot_product_attention(qg, ctx[:Hkv], ctx[Hkv:], attn_mask=g.mask)
        return y.view(Hkv, B, G, n, D).permute(1, 3, 0, 2, 4).reshape(rows, H, D)


def context_groups(
    segs: list[tuple[int, int]], block_size: int, max_pad: float = _MAX_PAD_FRACTION, max_elems: int = 1 << 22
) -> list[tuple[int, int]]:
    """Split (n, context length) pairs, sorted, into [start, end) groups of equal n whose
    block padding stays under `max_pad` and whose mask stays under `max_elems` entries."""
    groups, start, total = [], 0, 0
    for i, (n, length) in enumerate(segs):
        nb = -(-length // block_size)
        size = i - start + 1
        if i > start and (
            n != segs[start][0]
            or size * nb > (1 + max_pad) * (total + nb)
            or size * n * nb * block_size > max_elems
        ):
            groups.append((start, i))
            start, total = i, 0
        total += nb
    if segs:
        groups.append((start, len(segs)))
    return groups


class ModelRunner:
    """`compile_up_to` > 0 compiles decode steps of up to that many sequences (compiled.py),
    with the pool's last block, which the block manager must not hand out, as scratch;
    `prompt_lookup` (speculative drafts from prompt lookup, not a draft model): a lone greedy
    sequence's compiled runs draft and verify in the graph (`lookup_tokens` a run at most)."""

    def __init__(
        self,
        model: Llama,
        pool: KVPool,
        compile_up_to: int = 0,
        num_speculative_tokens: int = 0,
        num_scheduler_steps: int = 1,
        prompt_lookup: bool = False,
    ):
        self.model, self.pool = model, pool
        self.forward = FusedForward(model)
        self.decode: CompiledDecode | None = None
        if compile_up_to:
            try:
                self.decode = CompiledDecode(
                    self.forward,
                    pool,
                    pool.num_blocks - 1,
                    compile_up_to,
                    num_speculative_tokens,
                    num_scheduler_steps,
                    prompt_lookup,
                )
            except Exception as exc:  # e.g. no C++ compiler in a slim image: eager still works
                log.warning("compiled decode unavailable, decoding eagerly: %s", exc)
                self.forward.drop_packed()  # nothing reads them now
        # Multi-step decoding runs only in its compiled graph: eagerly, one step at a time.
        self.scheduler_steps = self.decode.scheduler_steps if self.decode is not None else 1
        self.lookup_tokens = self.decode.lookup_tokens if self.decode is not None else 0
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.block_size = pool.block_size
        self.max_pad = _MAX_PAD_FRACTION if self.device.type == "cpu" else float("inf")

    def _additive(self, valid: torch.Tensor) -> torch.Tensor:
        """Float mask (0 / -inf) in the model dtype: SDPA would convert a bool mask per call."""
        mask = torch.zeros(valid.shape).masked_fill_(~valid, float("-inf"))
        return mask.to(device=self.device, dtype=self.dtype)

    def prepare(self, seqs: list[Sequence], num_new: list[int]):
        """Packed ids, positions, the attention metadata, and each sequence's last row."""
        bs, dev = self.block_size, self.device
        G = self.model.config.n_head // self.model.config.n_kv_heads
        # Grouped first (sorted by new tokens, then context length), then the other prefills.
        grouped = sorted(
            (
                i
                for i, n in enumerate(num_new)
                if n <= _MAX_GROUP_QUERY and (n == 1 or seqs[i].num_computed_tokens > 0)
            ),
            key=lambda i: (num_new[i], seqs[i].num_computed_tokens),
        )
        in_group = set(grouped)
        order = grouped + [i for i in range(len(seqs)) if i not in in_group]
        ids, pos, slots, last = [], [], [], {}
        prefills = []
        for i in order:
            s, n = seqs[i], num_new[i]
            start, row = s.num_computed_tokens, len(ids)
            ids.extend(s.token_ids[start : start + n - len(s.draft)])
            ids.extend(s.draft)
            pos.extend(range(start, start + n))
            slots.extend(s.block_table[p // bs] * bs + p % bs for p in range(start, start + n))
            last[i] = row + n - 1
            if i in in_group:
                continue
            if start == 0:
                prefills.append(PrefillSeg(slice(row, row + n), None, None))
            else:
                L = start + n
                mask = torch.ones(n, L, dtype=torch.bool).tril(diagonal=start)
                table = torch.tensor(s.block_table[: -(-L // bs)])
                prefills.append(PrefillSeg(slice(row, row + n), table.to(dev), self._additive(mask)))
        groups = []
        segs = [(num_new[i], seqs[i].num_computed_tokens + num_new[i]) for i in grouped]
        row = 0
        for a, b in context_groups(segs, bs, self.max_pad):
            n = segs[a][0]
            width = -(-max(L for _, L in segs[a:b]) // bs)
            # Padded with block 0: its keys are masked out, and any block holds finite values.
            table = [seqs[grouped[j]].block_table[: -(-segs[j][1] // bs)] for j in range(a, b)]
            table = [bt + [0] * (width - len(bt)) for bt in table]
            # Query i of a member (context L) sees keys up to L - n + i; same for all G heads.
            limit = torch.tensor([L - n for _, L in segs[a:b]])[:, None] + torch.arange(n)
            valid = torch.arange(width * bs) <= limit[:, :, None]  # (B, n, keys)
            if n > 1:  # rows are (head, token) pairs; decodes broadcast one row over the heads
                valid = valid[:, None].expand(-1, G, -1, -1).reshape(b - a, G * n, -1)
            groups.append(
                ContextGroup(
                    slice(row, row + (b - a) * n),
                    n,
                    torch.tensor(table).view(-1).to(dev),
                    self._additive(valid[None]),
                )
            )
            row += (b - a) * n
        meta = torch.tensor([ids, pos, slots], dtype=torch.long).to(dev)
        attn = PagedAttention(self.pool, meta[2], groups, prefills)
        return meta[0], meta[1], attn, last

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        """Run the step: float32 logits, one row per sequence of `batch.ready`, and the
        scores of the prompt positions this step's rows predict (for sequences `scoring`)."""
        seqs, num_new = batch.seqs, batch.num_new_tokens
        vocab = self.model.config.vocab_size
        if not seqs:
            return RunnerOutput(torch.empty(0, vocab, device=self.device), [])
        self.pool.copy_blocks(batch.copies)
        if self.decode is not None and (decoded := self.decode.run(seqs, num_new)) is not None:
            return RunnerOutput(decoded[0], [], decoded[1], decoded[2])
        input_ids, positions, attn, last = self.prepare(seqs, num_new)
        with sdpa_kernel(_SDPA_BACKENDS):
            h = self.forward(input_ids, positions, attn)
        scores = self.score_prompts(h, seqs, num_new, last) if any(s.scoring for s in seqs) else []
        if not batch.ready:
            return RunnerOutput(h.new_empty(0, vocab, dtype=torch.float32), scores)
        rows = [r for i in batch.ready for r in range(last[i] - len(seqs[i].draft), last[i] + 1)]
        h = h.index_select(0, torch.tensor(rows, device=self.device))
        return RunnerOutput(self.forward.logits(h), scores)

    def score_prompts(
        self, h: torch.Tensor, seqs: list[Sequence], num_new: list[int], last: dict[int, int]
    ) -> list[PromptScores]:
        """The prompt's log-probs, riding on the prefill: for each sequence that is `scoring`,
        the log-prob of every prompt token this step's rows predict, with its rank and (when
        some request asked for prompt_logprobs) the top alternatives. Only those rows go
        through the LM head (in slices, bounding the logits' memory)."""
        rows, targets, spans = [], [], []
        for i, s in enumerate(seqs):
            start = s.num_computed_tokens
            lo, hi = max(start, s.num_scored), min(start + num_new[i], s.num_prompt_tokens - 1)
            if not s.scoring or lo >= hi:
                continue
            first = last[i] - num_new[i] + 1  # the row of position `start`
            spans.append((s, lo, len(rows), hi - lo))
            rows.extend(range(first + lo - start, first + hi - start))
            targets.extend(s.token_ids[lo + 1 : hi + 1])
        if not rows:
            return []
        k = max(s.request.params.prompt_logprobs or 0 for s, *_ in spans)
        rows_t, targets_t = torch.tensor(rows, device=self.device), torch.tensor(targets, device=self.device)
        chosen, ranks, top_vals, top_ids = [], [], [], []
        for a in range(0, len(rows), 512):
            logprobs = torch.log_softmax(self.forward.logits(h[rows_t[a : a + 512]]), -1)
            lp = logprobs.gather(1, targets_t[a : a + 512, None])
            chosen.append(lp[:, 0])
            ranks.append((logprobs > lp).sum(-1) + 1)
            if k:
                v, t = logprobs.topk(k, -1)
                top_vals.append(v)
                top_ids.append(t)
        chosen_l, ranks_l = torch.cat(chosen).tolist(), torch.cat(ranks).tolist()
        top_vals = torch.cat(top_vals).tolist() if k else [[]] * len(rows)
        top_ids = torch.cat(top_ids).tolist() if k else [[]] * len(rows)
        return [
            PromptScores(
                s,
                lo,
                chosen_l[at : at + n],
                ranks_l[at : at + n],
                top_ids[at : at + n],
                top_vals[at : at + n],
            )
            for s, lo, at, n in spans
        ]
