"""KV-cache events: what a subscriber written from vLLM's types (kv_subscriber.py) receives
over real ZMQ sockets on 127.0.0.1 from an engine serving prompts: the prompt's full
blocks stored once, in order, hashes chaining; evicted blocks removed; a reset cleared;
a missed batch replayed. And the bad configurations, each one line."""

from __future__ import annotations

import socket

import pytest
import torch

from lmops.errors import LmopsError
from lmops.runtime.engine import LLMEngine, SamplingParams
from lmops.runtime.engine.config import EngineConfig, KVEventsConfig
from lmops.runtime.engine.kv_cache import KVPool
from lmops.runtime.engine.kv_events import external_hash
from tests.conftest import free_port
from tests.unit.engine.kv_subscriber import AllBlocksCleared, BlockRemoved, BlockStored, Subscriber

BLOCK = 8
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1)


@pytest.fixture
def served(model_dir, ref_model):
    """An engine whose events go to a bound subscriber (the engine connects), with replay;
    its cache holds exactly one full-context sequence (32 blocks), so prompts evict."""
    port, replay_port = free_port(), free_port()
    sub = Subscriber(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", topic="kv@")
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://127.0.0.1:{port}",
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        topic="kv@pod-0@lmops-tiny",
    )
    per_block = KVPool.bytes_per_block(ref_model.config, BLOCK, torch.float32)
    engine = LLMEngine.from_pretrained(
        model_dir,
        device="cpu",
        block_size=BLOCK,
        kv_cache_memory=per_block * (ref_model.config.max_seq_len // BLOCK),
        kv_events_config=config,
    )
    yield engine, sub
    engine.close()
    sub.close()


def stored(events) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]


def test_a_served_prompt_is_announced_block_by_block_with_chained_hashes(served):
    engine, sub = served
    prompt = list(range(3, 3 + 5 * BLOCK + 3))  # 5 full blocks and 3 tokens
    engine.generate([prompt], ONE_TOKEN)
    sub.poll(lambda s: stored(s.events()))
    first, *rest = sub.events()
    assert isinstance(first, AllBlocksCleared)  # the new engine's cache
    (event,) = stored(rest)
    assert event.token_ids == prompt[: 5 * BLOCK] and event.block_size == BLOCK
    assert event.parent_block_hash is None and event.medium == "GPU" and event.lora_id is None
    assert len(event.block_hashes) == 5 == len(set(event.block_hashes))
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in event.block_hashes)
    assert sub.topics == {b"kv@pod-0@lmops-tiny"}
    # The same prefix again, one block longer: only the new block, its parent the prompt's last.
    longer = prompt[: 5 * BLOCK] + list(range(100, 100 + BLOCK + 1))
    engine.generate([longer], ONE_TOKEN)
    sub.poll(lambda s: len(stored(s.events())) == 2)
    again = stored(sub.events())[1]
    assert again.parent_block_hash == event.block_hashes[-1]
    assert again.token_ids == longer[5 * BLOCK : 6 * BLOCK] and len(again.block_hashes) == 1


def test_eviction_removes_and_reset_clears_what_was_stored(served):
    engine, sub = served
    a = list(range(10, 10 + 4 * BLOCK))
    engine.generate([a], ONE_TOKEN)
    # A prompt that needs every block of the cache evicts all of a's.
    engine.generate([list(range(200, 200 + engine.max_model_len - 1))], ONE_TOKEN)
    assert engine.reset_prefix_cache()
    sub.poll(lambda s: sum(isinstance(e, AllBlocksCleared) for e in s.events()) == 2)
    events = sub.events()
    a_hashes = set(stored(events)[0].block_hashes)
    removed = {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert a_hashes <= removed
    assert isinstance(events[-1], AllBlocksCleared)
    # Replaying the events rebuilds the engine's prefix-cache index exactly (empty after a reset).
    index: set[int] = set()
    for e in events:
        if isinstance(e, BlockStored):
            assert not index & set(e.block_hashes), "a block announced twice"
            index |= set(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            assert set(e.block_hashes) <= index
            index -= set(e.block_hashes)
        else:
            index = set()
    assert index == {external_hash(h) for h in engine.block_manager.cached} == set()


def test_the_events_mirror_the_index_through_a_busy_workload(served, prompts):
    engine, sub = served
    engine.generate(prompts, [SamplingParams(temperature=0, max_tokens=6)] * len(prompts))
    engine.generate(prompts[::2], [SamplingParams(temperature=0, max_tokens=6)] * len(prompts[::2]))
    sub.poll(lambda s: s.last_seq >= 0 and not engine.block_manager.events and _settled(s, engine))
    assert any(isinstance(e, BlockRemoved) for e in sub.events())  # the small cache evicted


def _settled(sub, engine) -> bool:
    index: set[int] = set()
    for e in sub.events():
        if isinstance(e, BlockStored):
            index |= set(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            index -= set(e.block_hashes)
        else:
            index = set()
    return index == {external_hash(h) for h in engine.block_manager.cached}


def test_a_missed_batch_is_replayed(served):
    engine, sub = served
    engine.generate([list(range(5, 5 + 3 * BLOCK))], ONE_TOKEN)
    sub.poll(lambda s: stored(s.events()))
    sub.drop_next = True  # lose the next batch on the way
    missed = list(range(50, 50 + 2 * BLOCK + 1))
    engine.generate([missed], ONE_TOKEN)
    engine.generate([list(range(90, 90 + 2 * BLOCK + 1))], ONE_TOKEN)
    sub.poll(lambda s: len(stored(s.events())) == 3)
    assert sub.replayed, "nothing was replayed"
    assert stored(sub.events())[1].token_ids == missed[: 2 * BLOCK]


def test_a_new_model_on_the_same_publisher_clears_what_the_old_one_announced(served, model_dir):
    """The live-champion swap: the new engine takes over the sockets, and the subscriber
    sees one stream: the old engine's blocks, AllBlocksCleared, the new engine's blocks."""
    old, sub = served
    prompt = list(range(30, 30 + 2 * BLOCK + 1))
    old.generate([prompt], ONE_TOKEN)
    new = LLMEngine.from_pretrained(model_dir, device="cpu", block_size=BLOCK, kv_events=old.kv_events)
    new.generate([prompt], ONE_TOKEN)
    sub.poll(lambda s: len(stored(s.events())) == 2)
    kinds = [type(e).__name__ for e in sub.events()]
    assert kinds == ["AllBlocksCleared", "BlockStored", "AllBlocksCleared", "BlockStored"]
    first, second = stored(sub.events())
    assert first.token_ids == second.token_ids == prompt[: 2 * BLOCK]


def test_a_bound_endpoint_serves_a_connecting_subscriber(model_dir, tmp_path):
    """vLLM's rule: ipc:// (like tcp://*) is bound by the engine; the subscriber connects."""
    endpoint, replay = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint, replay_endpoint=replay)
    engine = LLMEngine.from_pretrained(model_dir, device="cpu", block_size=BLOCK, kv_events_config=config)
    sub = Subscriber(endpoint, replay, bind=False)
    try:
        prompt = list(range(7, 7 + 2 * BLOCK + 1))
        engine.generate([prompt], ONE_TOKEN)  # sent before the subscription may be complete: replayed
        sub.poll(lambda s: stored(s.events()))
        assert stored(sub.events())[0].token_ids == prompt[: 2 * BLOCK]
    finally:
        engine.close()
        sub.close()


def test_events_are_off_by_default_and_null_publishes_nothing(model_dir):
    assert EngineConfig().kv_events_config is None
    engine = LLMEngine.from_pretrained(model_dir, device="cpu")
    assert engine.kv_events is None and engine.block_manager.events is None
    null = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    assert LLMEngine.from_pretrained(model_dir, device="cpu", kv_events_config=null).kv_events is None


@pytest.mark.parametrize(
    "value, message",
    [
        ('{"enable_kv_cache_events": true, "endpiont": "tcp://*:5557"}', "unknown key 'endpiont'"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be true or false"),
        ('{"publisher": "kafka"}', "publisher must be 'zmq' or 'null'"),
        ('{"buffer_steps": 0}', "buffer_steps must be an integer >= 1"),
        ("enable", "kv_events_config is not JSON"),
    ],
)
def test_a_bad_config_is_one_line_naming_it(value, message):
    with pytest.raises(ValueError, match=message) as info:
        EngineConfig(kv_events_config=value)
    assert "\n" not in str(info.value)


def test_an_endpoint_that_cannot_bind_fails_the_engine_in_one_line(model_dir):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    config = KVEventsConfig(
        enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*", replay_endpoint=f"tcp://127.0.0.1:{port}"
    )
    try:
        with pytest.raises(LmopsError, match=rf"cannot bind tcp://127.0.0.1:{port}: Address already in use"):
            LLMEngine.from_pretrained(model_dir, device="cpu", kv_events_config=config)
    finally:
        taken.close()
