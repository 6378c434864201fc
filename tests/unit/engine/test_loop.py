"""EngineLoop: the thread-safe front (submit, stream, cancel, queue limit, health, shutdown)."""

from __future__ import annotations

import threading
import time

import pytest

from lmops.runtime.engine import EngineLoop, LLMEngine, PromptTooLongError, QueueFullError, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture
def engine(model_dir):
    return LLMEngine.from_pretrained(model_dir, device="cpu")


@pytest.fixture
def loop(engine):
    loop = EngineLoop(engine).start()
    yield loop
    loop.shutdown(timeout=5)


def gate_steps(engine: LLMEngine) -> threading.Event:
    """Make each step wait for the returned event: the test decides when the engine moves."""
    gate, step = threading.Event(), engine.step

    def gated():
        gate.wait(10)
        return step()

    engine.step = gated
    return gate


def wait_for(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.005)


def test_concurrent_submits_stream_the_same_tokens_as_generate(model_dir, loop, prompts):
    expected = LLMEngine.from_pretrained(model_dir, device="cpu").generate(prompts[:8], GREEDY)
    results: dict[int, list] = {}

    def client(i):
        results[i] = list(loop.submit(prompts[i], GREEDY, request_id=f"c{i}"))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for i, exp in enumerate(expected):
        outs = results[i]
        assert len(outs) > 1 and outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert outs[-1].request_id == f"c{i}" and outs[-1].token_ids == exp.token_ids
        assert "".join(o.outputs[0].delta_text for o in outs) == exp.text
    assert loop.healthy() and loop.num_running == 0


def test_validation_errors_raise_at_submit(loop):
    with pytest.raises(ValueError, match="empty"):
        loop.submit("", GREEDY)
    with pytest.raises(PromptTooLongError):
        loop.submit([5] * 400, GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        loop.submit("x", SamplingParams(temperature=-1))


def test_cancel_aborts_and_frees_blocks(engine, loop, prompts, all_blocks_free):
    stream = loop.submit(prompts[5], SamplingParams(max_tokens=200, ignore_eos=True))
    first = next(stream)
    assert not first.finished
    stream.cancel()
    last = list(stream)[-1]
    assert last.finished and last.finish_reason == "abort" and len(last.token_ids) < 200
    wait_for(lambda: not engine.has_unfinished_requests())
    all_blocks_free(engine)
    assert (
        engine.metrics.registry.get_sample_value("lmops:request_success_total", {"finished_reason": "abort"})
        == 1
    )


def test_queue_full(engine, prompts):
    gate = gate_steps(engine)
    loop = EngineLoop(engine, max_queued=2).start()
    streams = [loop.submit(prompts[1], GREEDY), loop.submit(prompts[2], GREEDY)]
    assert loop.num_waiting == 2
    with pytest.raises(QueueFullError, match="max_queued=2"):
        loop.submit(prompts[3], GREEDY)
    gate.set()
    assert all(list(s)[-1].finish_reason == "length" for s in streams)
    loop.submit(prompts[3], GREEDY)  # room again
    loop.shutdown(timeout=10)


def test_shutdown_finishes_in_flight_then_refuses(engine, loop, prompts, all_blocks_free):
    streams = [loop.submit(p, GREEDY) for p in prompts[:4]]
    loop.shutdown(timeout=30)
    assert [list(s)[-1].finish_reason for s in streams] == ["length"] * 4
    with pytest.raises(RuntimeError, match="shutting down"):
        loop.submit("x", GREEDY)
    assert not loop.healthy()
    all_blocks_free(engine)


def test_shutdown_timeout_aborts_the_rest(engine, prompts, all_blocks_free):
    step = engine.step

    def slow():
        time.sleep(0.01)
        return step()

    engine.step = slow
    loop = EngineLoop(engine).start()
    streams = [loop.submit(p, SamplingParams(max_tokens=200, ignore_eos=True)) for p in prompts[:3]]
    next(streams[0])
    t0 = time.monotonic()
    loop.shutdown(timeout=0.1)
    assert time.monotonic() - t0 < 5
    assert [list(s)[-1].finish_reason for s in streams] == ["abort"] * 3
    all_blocks_free(engine)


def test_a_crashed_loop_fails_streams_and_health(engine, prompts):
    def broken():
        raise RuntimeError("boom")

    engine.step = broken
    loop = EngineLoop(engine).start()
    stream = loop.submit(prompts[0], GREEDY)
    with pytest.raises(RuntimeError, match="engine loop failed.*boom"):
        list(stream)
    assert not loop.healthy()
    with pytest.raises(RuntimeError, match="not running"):
        loop.submit(prompts[0], GREEDY)


def test_health_detects_a_stalled_step(engine, prompts):
    gate = gate_steps(engine)
    loop = EngineLoop(engine, stall_timeout=0.2).start()
    assert loop.healthy()  # idle is healthy
    stream = loop.submit(prompts[0], GREEDY)
    assert loop.healthy()
    wait_for(lambda: not loop.healthy())
    gate.set()
    assert list(stream)[-1].finished
    assert loop.healthy()
    loop.shutdown(timeout=5)
