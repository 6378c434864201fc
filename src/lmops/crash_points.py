"""Crash points: the one seam through which tests kill a stage at a chosen moment, to prove
that a rerun recovers (exact resume, a promotion killed between its steps), or pause it there
to break something under it (the tracking server, mid-training).

    LMOPS_TEST_SIGKILL_AT=<point>[:<n>]   e.g. train.step:15, promote.alias_moved
    LMOPS_TEST_SIGSTOP_AT=<point>[:<n>]   the process stops itself; the test sends SIGCONT

A stage calls `reached(point, n)` where a crash is worth testing; with the variable unset
(always, outside tests) that is two dictionary lookups.
"""

from __future__ import annotations

import os
import signal

ENV = "LMOPS_TEST_SIGKILL_AT"
PAUSE_ENV = "LMOPS_TEST_SIGSTOP_AT"


def reached(point: str, n: int | None = None) -> None:
    """SIGKILL (or SIGSTOP) this process if the environment names `point` (and `n`, when it
    has one)."""
    here = point if n is None else f"{point}:{n}"
    for env, sig in ((ENV, signal.SIGKILL), (PAUSE_ENV, signal.SIGSTOP)):
        if os.environ.get(env) == here:
            os.kill(os.getpid(), sig)
