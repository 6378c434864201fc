"""Fault injection (LMOPS_FAULT_*): off unless set; when set, the replica's engine
steps are slower or its submissions fail, which is what the canary analysis test
relies on; a bad value is a clear error."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from lmops.errors import LmopsError
from production_service import faults


def replica():
    calls = []
    engine = SimpleNamespace(step=lambda: calls.append("step") or [])
    loop = SimpleNamespace(submit=lambda ids, params: calls.append("submit") or "stream")
    return engine, loop, calls


def test_nothing_changes_unless_set():
    engine, loop, _ = replica()
    step, submit = engine.step, loop.submit
    faults.inject(engine, loop, {})
    faults.inject(engine, loop, {"LMOPS_FAULT_STEP_DELAY": "", "LMOPS_FAULT_ERROR_RATE": "0"})
    assert engine.step is step and loop.submit is submit


def test_step_delay_slows_every_step():
    engine, loop, calls = replica()
    faults.inject(engine, loop, {"LMOPS_FAULT_STEP_DELAY": "0.05"})
    start = time.perf_counter()
    engine.step()
    engine.step()
    assert time.perf_counter() - start >= 0.1 and calls == ["step", "step"]


def test_error_rate_fails_that_share_of_submissions():
    engine, loop, calls = replica()
    faults.inject(engine, loop, {"LMOPS_FAULT_ERROR_RATE": "1"})
    with pytest.raises(RuntimeError, match="injected fault"):
        loop.submit([1], None)
    assert calls == []
    engine, loop, calls = replica()
    faults.inject(engine, loop, {"LMOPS_FAULT_ERROR_RATE": "0.5"})
    outcomes = []
    for _ in range(400):
        try:
            outcomes.append(loop.submit([1], None) == "stream")
        except RuntimeError:
            outcomes.append(False)
    assert 120 < sum(outcomes) < 280


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"LMOPS_FAULT_ERROR_RATE": "1.5"}, "LMOPS_FAULT_ERROR_RATE=1.5 must be between 0 and 1"),
        ({"LMOPS_FAULT_STEP_DELAY": "-1"}, "LMOPS_FAULT_STEP_DELAY=-1 must be >= 0"),
        ({"LMOPS_FAULT_STEP_DELAY": "slow"}, "LMOPS_FAULT_STEP_DELAY='slow' is not a number"),
    ],
)
def test_bad_values_are_one_clear_error(env, message):
    engine, loop, _ = replica()
    with pytest.raises(LmopsError, match=message.replace("(", r"\(")):
        faults.inject(engine, loop, env)
