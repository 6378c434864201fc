"""Priority scheduling (vLLM's "priority" policy): the waiting queue in priority order
(lower first, then arrival), preemption of the lowest priority first, per-priority queue
metrics with bounded labels; and the "fcfs" default, which refuses a priority."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import generate_latest

from lmops.runtime.engine import LLMEngine, SamplingParams
from lmops.runtime.engine.kv_cache import KVPool
from lmops.runtime.engine.metrics import MAX_PRIORITY_LABELS

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def test_waiting_requests_run_lowest_priority_first_then_by_arrival(model_dir):
    engine = LLMEngine.from_pretrained(model_dir, device="cpu", scheduling_policy="priority", max_num_seqs=1)
    for rid, priority in [("late-5", 5), ("first-0", 0), ("ten", 10), ("second-0", 0), ("minus", -3)]:
        engine.add_request(rid, engine.make_request(rid, [1, 2, 3, 4], GREEDY, priority))
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["minus", "first-0", "second-0", "late-5", "ten"]


def test_fcfs_serves_in_arrival_order_and_refuses_a_priority(model_dir):
    engine = LLMEngine.from_pretrained(model_dir, device="cpu", max_num_seqs=1)
    for rid in ("a", "b", "c"):
        engine.add_request(rid, [5, 6, 7], GREEDY)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["a", "b", "c"]
    with pytest.raises(ValueError, match="LMOPS_SCHEDULING_POLICY=priority"):
        engine.make_request(None, [1, 2], GREEDY, priority=1)


@pytest.mark.parametrize("priority", [2**63, -(2**63) - 1, 1.5, True, "0"])
def test_a_priority_outside_int64_is_refused(model_dir, priority):
    engine = LLMEngine.from_pretrained(model_dir, device="cpu", scheduling_policy="priority")
    with pytest.raises(ValueError, match="priority must be a 64-bit signed integer"):
        engine.make_request(None, [1, 2], GREEDY, priority=priority)


def test_preemption_takes_the_lowest_priority_first(model_dir, ref_model):
    """Two growing sequences in a cache that holds one full context: when blocks run out the
    priority-10 one is preempted, though the priority-0 one is the newer (fcfs's victim)."""
    block = 8
    per_block = KVPool.bytes_per_block(ref_model.config, block, torch.float32)
    engine = LLMEngine.from_pretrained(
        model_dir,
        device="cpu",
        scheduling_policy="priority",
        block_size=block,
        kv_cache_memory=per_block * (ref_model.config.max_seq_len // block),
    )
    victims = []
    preempt = engine.scheduler.preempt

    def record(seq):
        victims.append(seq.request.request_id)
        preempt(seq)

    engine.scheduler.preempt = record
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    engine.add_request("low", engine.make_request("low", list(range(10, 110)), params, priority=10))
    engine.add_request("high", engine.make_request("high", list(range(120, 220)), params, priority=0))
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert victims and set(victims) == {"low"}
    assert done["high"].metrics.finished_time < done["low"].metrics.finished_time
    assert all(len(o.outputs[0].token_ids) == 100 for o in done.values())


def test_queue_metrics_by_priority_with_bounded_labels(model_dir):
    engine = LLMEngine.from_pretrained(model_dir, device="cpu", scheduling_policy="priority", max_num_seqs=2)
    one = SamplingParams(temperature=0, max_tokens=1)
    priorities = [0, 10] + list(range(100, 100 + MAX_PRIORITY_LABELS + 4))
    for i, priority in enumerate(priorities):
        engine.add_request(str(i), engine.make_request(str(i), [3, 4, 5], one, priority))
    engine.step()  # runs priorities 0 and 10; 16 labels: theirs and 100..113, then "other"
    over = len(priorities) - MAX_PRIORITY_LABELS
    text = generate_latest(engine.metrics.registry).decode()
    assert f'lmops:num_requests_waiting_by_priority{{priority="other"}} {over:.1f}' in text
    waiting = [
        line for line in text.splitlines() if line.startswith("lmops:num_requests_waiting_by_priority{")
    ]
    assert sum(float(line.split()[-1]) for line in waiting) == len(priorities) - 2
    while engine.has_unfinished_requests():
        engine.step()
    text = generate_latest(engine.metrics.registry).decode()
    counts = {
        line.split('"')[1]: float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("lmops:request_queue_time_by_priority_seconds_count")
    }
    assert len(counts) == MAX_PRIORITY_LABELS + 1 and counts["other"] == over and counts["0"] == 1
    assert sum(counts.values()) == len(priorities)
    assert 'lmops:num_requests_waiting_by_priority{priority="10"} 0.0' in text
