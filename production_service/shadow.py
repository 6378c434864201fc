"""Shadow mode: a share of the champion's live prompts (LMOPS_SHADOW_SHARE) is mirrored to
the challenger, and both models' bits/byte on those same prompts go to /metrics
(`lmops:shadow_prompt_bits_per_byte{role, challenger_model, challenger_version}`), so the
challenger is judged on the traffic it would serve before it is promoted: the series carry
the challenger version that scored them, so a version's evidence never mixes with its
predecessor's (the promotion gate reads them: lmops.pipeline.shadow).

The drift signal's machinery does the scoring: the champion's request is scored as it
is prefilled (the engine's `score_prompt`), the challenger prefills the same text with
its own tokenizer and generates one token, which is discarded. The caller only hands
the prompt to a bounded queue: a mirror never delays it, and one the challenger cannot
take (queue full, prompt too long for it) is dropped and counted. A pair is observed
once both scores are in, so the two series always cover the same prompts.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING

from lmops.runtime.engine import SamplingParams
from production_service.model_source import CHALLENGER, CHAMPION

if TYPE_CHECKING:
    from production_service.completions import Job
    from production_service.runtime import Runtime

log = logging.getLogger(__name__)

QUEUE_SIZE = 64  # mirrors waiting for the challenger; more are dropped
_MIRROR = SamplingParams(temperature=0, max_tokens=1)


class Shadow:
    def __init__(self, runtime: Runtime, share: float):
        self.runtime, self.share = runtime, share
        self.metrics = runtime.metrics
        self._credit = 0.0
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(QUEUE_SIZE)
        threading.Thread(target=self._run, name="lmops-shadow", daemon=True).start()

    def pick(self) -> bool:
        """Whether to mirror the next champion prompt: every 1/share-th one (systematic,
        as the drift sample is)."""
        with self._lock:
            self._credit += self.share
            if self._credit < 1:
                return False
            self._credit -= 1
            return True

    def mirror(self, job: Job) -> None:
        """Send a picked job's prompt to the challenger; its own score comes from its stream
        (it was submitted with `score_prompt`)."""
        pair = _Pair(self.metrics)
        job.stream = _Scored(job.stream, pair)
        try:
            self._queue.put_nowait((job.prompt_text, pair))
        except queue.Full:
            self.metrics.shadow_dropped.inc()

    def _run(self) -> None:
        while True:
            text, pair = self._queue.get()
            served = self.runtime.pin(None, CHALLENGER)
            try:
                outputs = list(served.loop.submit(text, _MIRROR, score_prompt=True))
                score = outputs[-1].metrics.prompt_bits_per_byte
            except (ValueError, RuntimeError) as exc:  # too long for it, its queue full, shutting down
                log.debug("a mirrored prompt was dropped: %s", exc)
                score = None
            finally:
                served.release()
            if score is None:
                self.metrics.shadow_dropped.inc()
            else:
                pair.add(CHALLENGER, score, scored_by=(served.model.name, served.model.version or "none"))


class _Pair:
    """The two scores of one mirrored prompt, observed together once both are in."""

    def __init__(self, metrics):
        self.metrics = metrics
        self.scores: dict[str, float] = {}
        self.challenger: tuple[str, str] | None = None  # its name and version
        self._lock = threading.Lock()

    def add(self, role: str, score: float, scored_by: tuple[str, str] | None = None) -> None:
        with self._lock:
            self.scores[role] = score
            self.challenger = scored_by or self.challenger
            if len(self.scores) < 2:
                return
        for each, value in self.scores.items():
            self.metrics.shadow_bpb.labels(each, *self.challenger).observe(value)


class _Scored:
    """A champion job's stream that hands the prompt's score to its pair when it comes."""

    def __init__(self, stream, pair: _Pair):
        self.stream, self.pair = stream, pair
        self.waiting = True

    def get(self, timeout: float | None = None):
        out = self.stream.get(timeout)
        if self.waiting and out is not None and out.metrics.prompt_bits_per_byte is not None:
            self.waiting = False
            self.pair.add(CHAMPION, out.metrics.prompt_bits_per_byte)
        return out

    def cancel(self) -> None:
        self.stream.cancel()
