"""Crash points: the one seam through which tests kill a stage at a chosen moment, to prove
that a rerun recovers (exact resume, a promotion killed between its steps).

    LMOPS_TEST_SIGKILL_AT=<point>[:<n>]   e.g. train.step:15, promote.alias_moved

A stage calls `reached(point, n)` where a crash is worth testing; with the variable unset
(always, outside tests) that is one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "LMOPS_TEST_SIGKILL_AT"


def reached(point: str, n: int | None = None) -> None:
    """SIGKILL this process if the environment names `point` (and `n`, when it has one)."""
    wanted = os.environ.get(ENV)
    if wanted and wanted == (point if n is None else f"{point}:{n}"):
        os.kill(os.getpid(), signal.SIGKILL)
