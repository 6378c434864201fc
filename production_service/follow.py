"""Follow the champion (and the challenger): every LMOPS_MODEL_POLL_S seconds look where
each moving source points now (the registry alias's version, the export's `.current`
link: `Source.locate`, no download) and swap a new version in (`Runtime.swap`), without
a restart.

A look that fails (the registry is down) keeps the version serving, is logged once
until one succeeds again, and the next look waits twice as long, up to 16 polls or
MAX_BACKOFF_S, whichever is shorter. A version that was refused (corrupt, unloadable) is not tried again
until the source names another; two moves in quick succession end on the later one,
since each look reads where the source points now.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from production_service.runtime import Runtime

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 60.0


class Follower:
    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.sources = [s for s in runtime.sources.values() if s.follows]
        self.poll_s = runtime.config.model_poll_s
        self.max_delay = max(self.poll_s, min(MAX_BACKOFF_S, 16 * self.poll_s))
        self.refused: dict[str, str] = {}  # role -> the version refused last
        self.failing: set[str] = set()  # roles whose last look failed

    def start(self) -> None:
        log.info("following %s: a look every %g s", ", ".join(map(str, self.sources)), self.poll_s)
        threading.Thread(target=self._run, name="lmops-model-follower", daemon=True).start()

    def _run(self) -> None:
        delay = self.poll_s
        while not self.runtime.stopping.wait(delay):
            failed = [s for s in self.sources if not self.look(s)]
            delay = min(delay * 2, self.max_delay) if failed else self.poll_s

    def look(self, source) -> bool:
        """Swap `source`'s new version in if it names one; False when the look failed."""
        runtime = self.runtime
        try:
            target = source.locate()
        except Exception as exc:  # noqa: BLE001 - whatever the registry client raises, keep serving
            runtime.metrics.poll_errors.labels(source.role).inc()
            if source.role not in self.failing:
                self.failing.add(source.role)
                log.warning(
                    "cannot look for a new version of %s (%s); version %s keeps serving, retrying with backoff",
                    source,
                    _one_line(exc),
                    runtime.served[source.role].model.version,
                )
            return False
        if source.role in self.failing:
            self.failing.discard(source.role)
            log.info("%s answers again", source)
        serving = source.located(runtime.served[source.role].model)
        if target not in (serving, self.refused.get(source.role)) and runtime.state == "ready":
            log.info("%s now names %s (serving %s): swapping", source, target, serving)
            if not runtime.swap(source, target):
                self.refused[source.role] = target
        return True


def _one_line(exc: Exception) -> str:
    text = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    return text.strip().splitlines()[0][:300]
