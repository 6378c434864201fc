"""The paged KV cache: a preallocated pool of fixed-size blocks, and the block manager.

Pool layout per layer is (2 * n_kv_heads, num_blocks, block_size, head_dim): heads
outermost, so gathering a batch's blocks with one `index_select` yields
(heads, batch, tokens, D), which attention consumes without a further copy.

The block manager owns which block holds what. A sequence holds a block table
and allocates blocks only as its tokens arrive, so at most its last block is
partly empty. With prefix caching, each full block is keyed by a chained hash of
(parent block's hash, its tokens); a request reuses every cached block of its
prompt; a block whose ref count drops to 0 stays cached in the free queue and is
evicted least recently used first (never-cached free blocks are handed out before
any cached one). Blocks shared by `n > 1` siblings are copied on write.

With `record_events`, the manager also records what the cache's index (`cached`)
gains and loses, as vLLM's KV-cache events (engine/kv_events.py): a hash entering it
is stored once, a hash leaving it (its block evicted) removed, a new or reset cache
cleared; the engine publishes them after each step.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from lmops.runtime.engine.kv_events import (
    MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    external_hash,
)
from lmops.runtime.hugepages import huge_page_zeros
from lmops.runtime.model_config import LlamaConfig

if TYPE_CHECKING:
    from lmops.runtime.engine.sequence import Sequence


class KVPool:
    """K and V of every layer in one tensor, (n_layer, 2 * n_kv_heads, num_blocks, block_size,
    head_dim): K heads then V heads, so one index_copy_ writes both and one index_select
    gathers both."""

    def __init__(self, cfg: LlamaConfig, num_blocks: int, block_size: int, device, dtype):
        shape = (cfg.n_layer, 2 * cfg.n_kv_heads, num_blocks, block_size, cfg.head_dim)
        # Zeros, not empty: padded attention reads unused slots, which must be finite.
        if torch.device(device).type == "cpu":  # a step gathers blocks from all over it
            self.kv = huge_page_zeros(math.prod(shape), dtype).view(shape)
        else:
            self.kv = torch.zeros(shape, device=device, dtype=dtype)
        self.k, self.v = self.kv[:, : cfg.n_kv_heads], self.kv[:, cfg.n_kv_heads :]
        self.num_blocks, self.block_size = num_blocks, block_size

    @staticmethod
    def bytes_per_block(cfg: LlamaConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.n_layer * cfg.n_kv_heads * block_size * cfg.head_dim * elem

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate block src into dst in every layer."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.kv.device)
        dst = torch.tensor([d for _, d in pairs], device=self.kv.device)
        self.kv[:, :, dst] = self.kv[:, :, src]


def block_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    """Chained key of a full block: equal only if the whole prefix up to it is equal."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.token_ids: tuple[int, ...] | None = None


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        record_events: bool = False,
    ):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order: never-cached at the front, then cached ones LRU first.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        # KV-cache events since `take_events`; None: not recorded. A new cache starts
        # cleared: whatever a subscriber knew of this engine's blocks is gone.
        self.events: list[KVCacheEvent] | None = [AllBlocksCleared()] if record_events else None

    def take_events(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (a new model's K/V differ); False, and nothing changes,
        while any block is in use (as vLLM's reset_prefix_cache)."""
        if self.num_free_blocks < self.num_blocks:
            return False
        for b in self.blocks:
            b.hash = b.token_ids = None
        self.cached.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.free_queue)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / len(self.blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- allocation ------------------------------------------------------------------

    def _take_free(self) -> int:
        bid, _ = self.free_queue.popitem(last=False)
        b = self.blocks[bid]
        if b.hash is not None:  # evict: its contents are about to be overwritten
            if self.cached.get(b.hash) == bid:
                del self.cached[b.hash]
                if self.events is not None:
                    self.events.append(BlockRemoved([external_hash(b.hash)], MEDIUM))
            b.hash = b.token_ids = None
        b.ref_count = 1
        return bid

    def _acquire(self, bid: int) -> None:
        b = self.blocks[bid]
        if b.ref_count == 0:
            del self.free_queue[bid]
        b.ref_count += 1

    def _release(self, bid: int) -> None:
        b = self.blocks[bid]
        b.ref_count -= 1
        assert b.ref_count >= 0, f"block {bid} released more often than acquired"
        if b.ref_count == 0:
            self.free_queue[bid] = None
            if b.hash is None:
                self.free_queue.move_to_end(bid, last=False)

    def match_prefix(self, token_ids: list[int]) -> tuple[list[int], list[bytes]]:
        """Cached blocks holding a prefix of `token_ids`, leaving at least one token to compute
        (its logits are needed). Reads only: nothing is acquired."""
        if not self.enable_prefix_caching:
            return [], []
        bs = self.block_size
        ids, hashes, parent = [], [], None
        for i in range((len(token_ids) - 1) // bs):
            chunk = token_ids[i * bs : (i + 1) * bs]
            h = block_hash(parent, chunk)
            bid = self.cached.get(h)
            if bid is None or self.blocks[bid].token_ids != tuple(chunk):
                break
            ids.append(bid)
            hashes.append(h)
            parent = h
        return ids, hashes

    def _needs_cow(self, seq: Sequence) -> bool:
        """The block that the next token is written into is shared with a sibling."""
        pos = seq.num_computed_tokens
        i = pos // self.block_size
        return (
            pos % self.block_size != 0
            and i < len(seq.block_table)
            and self.blocks[seq.block_table[i]].ref_count > 1
        )

    def num_new_blocks(self, seq: Sequence, num_tokens: int, hits: list[int] = ()) -> int:
        """Free blocks that `allocate(seq, num_tokens, hits)` would consume."""
        need = self.blocks_for(num_tokens) - len(seq.block_table) - len(hits)
        need += sum(1 for bid in hits if self.blocks[bid].ref_count == 0)
        return need + (1 if not hits and self._needs_cow(seq) else 0)

    def allocate(
        self, seq: Sequence, num_tokens: int, hits: list[int] = (), hit_hashes: list[bytes] = ()
    ) -> list[tuple[int, int]] | None:
        """Make seq's block table cover `num_tokens` tokens, taking the prefix-cache `hits`
        first (only for a sequence without blocks). All or nothing: None if too few free
        blocks. Returns the copy-on-write (src, dst) pairs to apply before the forward."""
        if not hits and len(seq.block_table) * self.block_size >= num_tokens and not self._needs_cow(seq):
            return []  # the common decode step: room left in the last block
        if self.num_new_blocks(seq, num_tokens, hits) > len(self.free_queue):
            return None
        for bid in hits:
            self._acquire(bid)
        seq.block_table.extend(hits)
        seq.block_hashes.extend(hit_hashes)
        copies = []
        if not hits and self._needs_cow(seq):
            i = seq.num_computed_tokens // self.block_size
            src, dst = seq.block_table[i], self._take_free()
            self._release(src)
            seq.block_table[i] = dst
            copies.append((src, dst))
        while len(seq.block_table) < self.blocks_for(num_tokens):
            seq.block_table.append(self._take_free())
        return copies

    def share(self, seq: Sequence) -> None:
        """A fork of `seq` (a copy of its block table) now also references every block of it."""
        for bid in seq.block_table:
            self._acquire(bid)

    def register(self, seq: Sequence, num_tokens: int) -> None:
        """Key every block that `num_tokens` of seq's tokens fill, so later requests find it.
        Called at scheduling time: a same-step reader is safe because each layer writes all
        of the step's K/V before any attention reads them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        stored: BlockStored | None = None  # the run of blocks this call adds to the index
        for i in range(len(seq.block_hashes), num_tokens // bs):
            chunk = seq.token_ids[i * bs : (i + 1) * bs]
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = block_hash(parent, chunk)
            b = self.blocks[seq.block_table[i]]
            new = b.hash is None and h not in self.cached  # the index gains h
            if b.hash is None:
                b.hash, b.token_ids = h, tuple(chunk)
                self.cached.setdefault(h, b.block_id)
            if self.events is not None:
                stored = self._record_stored(stored, parent, h, chunk) if new else None
            seq.block_hashes.append(h)

    def _record_stored(self, run: BlockStored | None, parent: bytes | None, h: bytes, chunk) -> BlockStored:
        """Extend the current run of stored blocks with one, or start a new event."""
        if run is None:
            parent_hash = None if parent is None else external_hash(parent)
            run = BlockStored([], parent_hash, [], self.block_size, None, MEDIUM, None)
            self.events.append(run)
        run.block_hashes.append(external_hash(h))
        run.token_ids.extend(chunk)
        return run

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Release seq's blocks past those `num_tokens` tokens need (rejected draft tokens'),
        tail first; they were never registered, so nothing cached is lost."""
        keep = self.blocks_for(num_tokens)
        for bid in reversed(seq.block_table[keep:]):
            self._release(bid)
        del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks, tail first, so its last blocks are evicted before its prefix."""
        for bid in reversed(seq.block_table):
            self._release(bid)
        seq.block_table = []
        seq.block_hashes = []
