"""Block manager: allocation, chained prefix hashes, LRU eviction, copy-on-write; the pool."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from lmops.runtime.engine.kv_cache import BlockManager, KVPool, block_hash
from lmops.runtime.model_config import LlamaConfig


def seq(tokens, computed=0):
    return SimpleNamespace(
        token_ids=list(tokens), num_computed_tokens=computed, block_table=[], block_hashes=[]
    )


def run_prefill(bm: BlockManager, s) -> None:
    """What the scheduler does for a whole-prompt prefill: hits, allocate, register."""
    hits, hashes = bm.match_prefix(s.token_ids)
    s.num_computed_tokens = len(hits) * bm.block_size
    assert bm.allocate(s, len(s.token_ids), hits, hashes) == []
    bm.register(s, len(s.token_ids))
    s.num_computed_tokens = len(s.token_ids)


def test_allocates_only_what_tokens_need_and_frees_all():
    bm = BlockManager(10, 4)
    s = seq(range(9))
    assert bm.allocate(s, 9) == []
    assert len(s.block_table) == 3 and bm.num_free_blocks == 7  # 9 tokens: 2 full + 1 partial
    assert bm.allocate(s, 12) == [] and len(s.block_table) == 3  # room left in the last block
    assert bm.allocate(s, 13) == [] and len(s.block_table) == 4
    bm.free(s)
    assert bm.num_free_blocks == 10 and s.block_table == []
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_allocate_is_all_or_nothing():
    bm = BlockManager(3, 4)
    s = seq(range(20))
    assert bm.allocate(s, 13) is None
    assert s.block_table == [] and bm.num_free_blocks == 3


def test_prefix_hits_are_chained_and_leave_a_token_to_compute():
    bm = BlockManager(16, 4)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    run_prefill(bm, a)
    # Same first two blocks: both hit; the third (partial) never is.
    hits, _ = bm.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert hits == a.block_table[:2]
    # A prompt of exactly the cached blocks still computes its last token: last block not hit.
    hits, _ = bm.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert hits == a.block_table[:1]
    # Block 2's tokens after a different block 1 are a different key (the hash is chained).
    hits, _ = bm.match_prefix([0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert hits == []
    assert block_hash(None, [1, 2]) != block_hash(block_hash(None, [0]), [1, 2])


def test_shared_blocks_are_ref_counted():
    bm = BlockManager(16, 4)
    a, b = seq(range(10)), seq(list(range(8)) + [50, 51])
    run_prefill(bm, a)
    run_prefill(bm, b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1]
    bm.free(b)
    assert bm.num_free_blocks == 16


def test_free_cached_blocks_are_evicted_lru_after_uncached_ones():
    bm = BlockManager(8, 2)
    old, new = seq([1, 2, 3, 4, 9]), seq([5, 6, 7, 8, 9])
    run_prefill(bm, old)
    run_prefill(bm, new)
    old_full, new_full = old.block_table[:2], new.block_table[:2]  # free() clears the tables
    bm.free(old)
    bm.free(new)
    # 8 blocks: 2 never used, 2 partial (uncached) from old/new, 4 cached full blocks.
    grab = seq(range(8))
    assert bm.allocate(grab, 8) == []  # takes the 4 uncached blocks first
    assert bm.match_prefix([1, 2, 3, 4, 0])[0] == old_full
    assert bm.match_prefix([5, 6, 7, 8, 0])[0] == new_full
    more = seq(range(4))
    assert bm.allocate(more, 4) == []  # evicts the least recently freed: old's blocks
    assert bm.match_prefix([1, 2, 3, 4, 0])[0] == []
    assert bm.match_prefix([5, 6, 7, 8, 0])[0] == new_full


def test_reusing_a_cached_block_refreshes_it():
    bm = BlockManager(4, 2)
    a, b = seq([1, 2, 0]), seq([3, 4, 0])
    run_prefill(bm, a)
    run_prefill(bm, b)
    bm.free(a)
    bm.free(b)
    c = seq([1, 2, 5])
    run_prefill(bm, c)  # hits a's block: now in use, then freed again as most recent
    bm.free(c)
    grab = seq(range(5))
    assert bm.allocate(grab, 5) == []  # 3 blocks: the uncached ones, then b's (older than a's)
    assert bm.match_prefix([3, 4, 0])[0] == []
    assert len(bm.match_prefix([1, 2, 0])[0]) == 1


def test_copy_on_write_for_a_shared_partial_block():
    bm = BlockManager(8, 4)
    parent = seq(range(6))
    run_prefill(bm, parent)
    child = SimpleNamespace(
        token_ids=list(parent.token_ids),
        num_computed_tokens=6,
        block_table=list(parent.block_table),
        block_hashes=list(parent.block_hashes),
    )
    bm.share(parent)
    assert [bm.blocks[i].ref_count for i in parent.block_table] == [2, 2]
    parent.token_ids.append(7)
    copies = bm.allocate(parent, 7)  # writes position 6, inside the shared partial block
    assert copies == [(child.block_table[1], parent.block_table[1])]
    assert parent.block_table[0] == child.block_table[0]
    assert [bm.blocks[i].ref_count for i in child.block_table] == [2, 1]
    child.token_ids.append(8)
    assert bm.allocate(child, 7) == []  # now the only owner: writes in place
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8


def test_pool_size_and_block_copy():
    cfg = LlamaConfig(vocab_size=10, n_layer=2, n_head=4, n_kv_heads=2, n_embd=32)
    pool = KVPool(cfg, num_blocks=4, block_size=8, device="cpu", dtype=torch.float32)
    assert pool.nbytes == 4 * KVPool.bytes_per_block(cfg, 8, torch.float32) == 4 * 2 * 2 * 2 * 8 * 8 * 4
    pool.k[:, :, 1] = 3.0
    pool.v[:, :, 1] = 4.0
    pool.copy_blocks([(1, 3)])
    assert torch.equal(pool.k[:, :, 3], pool.k[:, :, 1]) and torch.equal(pool.v[:, :, 3], pool.v[:, :, 1])
    assert pool.k[:, :, 2].abs().sum() == 0
