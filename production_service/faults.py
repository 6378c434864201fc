"""Fault injection: a replica that is slow or failing on purpose, so that the canary
analysis (deploy/canary) can be shown to stop a bad release on a real service.
Off unless set; never set it in production.

    LMOPS_FAULT_STEP_DELAY=S   every engine step first sleeps S seconds (slow time to first token)
    LMOPS_FAULT_ERROR_RATE=P   that fraction of requests fails at submission (answered 503)
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Mapping

from lmops.errors import LmopsError

log = logging.getLogger(__name__)


def _number(env: Mapping[str, str], name: str, maximum: float | None) -> float:
    text = env.get(name, "").strip()
    if not text:
        return 0.0
    try:
        value = float(text)
    except ValueError:
        raise LmopsError(f"{name}={text!r} is not a number") from None
    if value < 0 or (maximum is not None and value > maximum):
        bounds = ">= 0" if maximum is None else f"between 0 and {maximum:g}"
        raise LmopsError(f"{name}={text} must be {bounds}")
    return value


def inject(engine, loop, env: Mapping[str, str] | None = None) -> None:
    """Wrap this replica's engine step and loop submission as the settings ask."""
    env = os.environ if env is None else env
    delay = _number(env, "LMOPS_FAULT_STEP_DELAY", None)
    rate = _number(env, "LMOPS_FAULT_ERROR_RATE", 1.0)
    if delay:
        step = engine.step

        def slow_step(*args, **kwargs):
            time.sleep(delay)
            return step(*args, **kwargs)

        engine.step = slow_step
    if rate:
        submit = loop.submit

        def failing_submit(*args, **kwargs):
            if random.random() < rate:
                raise RuntimeError("injected fault, LMOPS_FAULT_ERROR_RATE")
            return submit(*args, **kwargs)

        loop.submit = failing_submit
    if delay or rate:
        log.warning("FAULT INJECTION ON: engine steps +%ss, %s of requests fail", delay, rate)
