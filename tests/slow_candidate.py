"""A candidate that serves slower by construction: 50 ms of sleep before each engine step.

Sleep adds wall time whatever else the machine runs; a structurally slower model does not
reliably: 4x the layers once measured 0.92x under -n 2 on a 2-core machine, as a preempted
champion round cost more than the extra layers. With 50 ms a step the champion would need
rounds some 20x slower than its unloaded ~0.1 s to hide a 1.5x gap.

Run as a script, it is the `lmops` command with the promotion gate's candidate slowed
(tests/integration/test_gate.py): `python tests/slow_candidate.py promote`.
"""

from __future__ import annotations

import sys
import time

from lmops.runtime.engine import LLMEngine

STEP_SLEEP_S = 0.05


def slow_down(engine: LLMEngine) -> LLMEngine:
    """`engine`, each of whose steps now starts with STEP_SLEEP_S of sleep."""
    step = engine.step

    def slow_step():
        time.sleep(STEP_SLEEP_S)
        return step()

    engine.step = slow_step
    return engine


if __name__ == "__main__":
    from lmops.pipeline import latency
    from lmops.pipeline.cli import main

    compare = latency.compare
    latency.compare = lambda candidate, champion, **kw: compare(slow_down(candidate), champion, **kw)
    sys.exit(main())
