"""Runs one scheduled step: packs all sequences' new tokens into one row, runs the model
over the paged cache, returns logits only where a token is to be sampled.

Packing (B=1, T = all new tokens, per-token positions) means mixed prompt lengths
never pad the projections or MLPs. Attention happens in `PagedAttention.attend`,
which `Llama` calls in every layer: it first writes the step's K/V into their
slots, then attends per sequence through its block table: single-token queries
(decodes) in length-sorted groups gathered from the pool in one index_select each,
longer queries (prefill chunks) one sequence at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lmops.engine.kv_cache import KVPool
from lmops.engine.sequence import Sequence
from lmops.model import Llama

# A decode group is padded to its longest member; start a new group when padding would
# exceed this fraction of the group's real blocks.
_MAX_PAD_FRACTION = 0.25


@dataclass
class DecodeGroup:
    rows: slice                 # rows of the packed batch
    block_ids: torch.Tensor     # (B * max_blocks,) block tables, padded, flattened
    mask: torch.Tensor          # (1, B, 1, max_blocks * block_size) key is valid
    max_blocks: int


@dataclass
class PrefillSeg:
    rows: slice
    start: int                      # tokens already in the cache before this chunk
    block_ids: torch.Tensor | None  # blocks holding the whole context, None if start == 0
    mask: torch.Tensor | None       # (T, start + T) causal mask with the cached prefix


class PagedAttention:
    """The `cache` object handed to `Llama`: K/V live in the pool, addressed by slots."""

    def __init__(self, pool: KVPool, slot_mapping: torch.Tensor, decodes: list[DecodeGroup],
                 prefills: list[PrefillSeg]):
        self.pool, self.slot_mapping = pool, slot_mapping
        self.decodes, self.prefills = decodes, prefills

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = q[0], k[0], v[0]                                  # (T, H, D), (T, Hkv, D)
        T, H, D = q.shape
        Hkv = k.shape[1]
        kc, vc = self.pool.k[layer], self.pool.v[layer]            # (Hkv, NB, bs, D)
        nb, bs = kc.shape[1], kc.shape[2]
        kc.view(Hkv, nb * bs, D).index_copy_(1, self.slot_mapping, k.transpose(0, 1))
        vc.view(Hkv, nb * bs, D).index_copy_(1, self.slot_mapping, v.transpose(0, 1))
        out = torch.empty_like(q)
        for g in self.decodes:
            B = g.rows.stop - g.rows.start
            qd = q[g.rows].view(B, Hkv, H // Hkv, D).transpose(0, 1)   # (Hkv, B, G, D)
            keys = kc.view(Hkv, nb, bs * D).index_select(1, g.block_ids).view(Hkv, B, -1, D)
            vals = vc.view(Hkv, nb, bs * D).index_select(1, g.block_ids).view(Hkv, B, -1, D)
            y = F.scaled_dot_product_attention(qd, keys, vals, attn_mask=g.mask)
            out[g.rows] = y.transpose(0, 1).reshape(B, H, D)
        for p in self.prefills:
            qs = q[p.rows].transpose(0, 1).unsqueeze(0)               # (1, H, n, D)
            if p.block_ids is None:
                ks = k[p.rows].transpose(0, 1).unsqueeze(0)
                vs = v[p.rows].transpose(0, 1).unsqueeze(0)
                y = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            else:
                L = p.mask.shape[1]
                ks = kc.index_select(1, p.block_ids).view(Hkv, -1, D)[:, :L].unsqueeze(0)
                vs = vc.index_select(1, p.block_ids).view(Hkv, -1, D)[:, :L].unsqueeze(0)
                y = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=p.mask, enable_gqa=True)
            out[p.rows] = y[0].transpose(0, 1)
        return out.unsqueeze(0)


def decode_groups(lengths: list[int], block_size: int) -> list[tuple[int, int]]:
    """Split length-sorted decodes into [start, end) groups whose padding stays small."""
    groups, start = [], 0
    nblocks = [-(-n // block_size) for n in lengths]
    total = 0
    for i, nb in enumerate(nblocks):
        size = i - start + 1
        if i > start and size * nb > (1 + _MAX_PAD_FRACTION) * (total + nb):
            groups.append((start, i))
            start, total = i, 0
        total += nb
    if lengths:
        groups.append((start, len(lengths)))
    return groups


class ModelRunner:
    def __init__(self, model: Llama, pool: KVPool):
        self.model, self.pool = model, pool
        self.device = next(model.parameters()).device
        self.block_size = pool.block_size

    @torch.inference_mode()
    def execute(self, seqs: list[Sequence], num_new: list[int],
                copies: list[tuple[int, int]] = ()) -> torch.Tensor:
        """Run the step; float32 logits (one row per sequence that reaches its last token,
        in `seqs` order)."""
        self.pool.copy_blocks(list(copies))
        bs = self.block_size
        # Decodes first, sorted by context length so each group pads little; then prefills.
        dec = sorted((i for i, n in enumerate(num_new) if n == 1),
                     key=lambda i: seqs[i].num_computed_tokens)
        order = dec + [i for i, n in enumerate(num_new) if n != 1]
        ids, pos, slots = [], [], []
        prefills: list[PrefillSeg] = []
        row = len(dec)
        for i in order[len(dec):]:
            s, n = seqs[i], num_new[i]
            start = s.num_computed_tokens
            ids.extend(s.token_ids[start:start + n])
            p = torch.arange(start, start + n)
            pos.append(p)
            table = torch.tensor(s.block_table, dtype=torch.long)
            slots.append(table[p // bs] * bs + p % bs)
            if start == 0:
                prefills.append(PrefillSeg(slice(row, row + n), 0, None, None))
            else:
                L = start + n
                mask = torch.ones(n, L, dtype=torch.bool).tril(diagonal=start)
                prefills.append(PrefillSeg(slice(row, row + n), start,
                                           table[:-(-L // bs)].to(self.device),
                                           mask.to(self.device)))
            row += n
        dec_ids, dec_pos, dec_slots = [], [], []
        for i in dec:
            s = seqs[i]
            p = s.num_computed_tokens
            dec_ids.append(s.token_ids[p])
            dec_pos.append(p)
            dec_slots.append(s.block_table[p // bs] * bs + p % bs)
        groups = []
        lengths = [seqs[i].num_computed_tokens + 1 for i in dec]
        for a, b in decode_groups(lengths, bs):
            nmax = -(-lengths[b - 1] // bs)
            table = torch.zeros(b - a, nmax, dtype=torch.long)
            for j, i in enumerate(dec[a:b]):
                bt = seqs[i].block_table[:-(-lengths[a + j] // bs)]
                table[j, :len(bt)] = torch.tensor(bt)
            mask = torch.arange(nmax * bs)[None, :] < torch.tensor(lengths[a:b])[:, None]
            groups.append(DecodeGroup(slice(a, b), table.view(-1).to(self.device),
                                      mask[None, :, None, :].to(self.device), nmax))
        input_ids = torch.tensor(dec_ids + ids, dtype=torch.long, device=self.device)
        positions = torch.cat([torch.tensor(dec_pos, dtype=torch.long)] + pos).to(self.device)
        slot_mapping = torch.cat([torch.tensor(dec_slots, dtype=torch.long)] + slots).to(self.device)
        cache = PagedAttention(self.pool, slot_mapping, groups, prefills)
        h = self.model.hidden_states(input_ids[None], positions[None], cache)[0]
        # Row of each sequence's last new token, for those that reach their end.
        last = {}
        r = 0
        for i in order:
            r += num_new[i]
            last[i] = r - 1
        want = [last[i] for i, s in enumerate(seqs)
                if s.num_computed_tokens + num_new[i] == s.num_tokens]
        if not want:
            return h.new_empty(0, self.model.config.vocab_size, dtype=torch.float32)
        rows = torch.tensor(want, device=self.device)
        return self.model.lm_head(h.index_select(0, rows)).float()
