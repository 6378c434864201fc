"""`EngineLoop`: the thread-safe front of one `LLMEngine`, for the service.

One background thread owns the engine and drives `step()`; any thread may `submit`
(validated synchronously, so bad input fails in the caller) and iterate the returned
stream of incremental outputs, or cancel it. Bounded queue, health check, graceful
shutdown.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque

from lmops.runtime.engine.config import positive_int
from lmops.runtime.engine.engine import LLMEngine
from lmops.runtime.engine.metrics import now
from lmops.runtime.engine.sampling import SamplingParams
from lmops.runtime.engine.sequence import Request, RequestOutput

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the caller should retry later (HTTP 429/503)."""


class RequestStream:
    """Blocking iterator over one request's incremental outputs; ends after the finished one."""

    def __init__(self, loop: EngineLoop, request_id: str):
        self.request_id = request_id
        self._loop = loop
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._done = False

    def _put(self, item) -> None:
        self._queue.put(item)

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> RequestOutput:
        item = self.get()
        if item is None:
            raise StopIteration
        return item

    def get(self, timeout: float | None = None) -> RequestOutput | None:
        """The next output; None once finished. Raises queue.Empty after `timeout` seconds."""
        if self._done:
            return None
        item = self._queue.get(timeout=timeout)
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item

    def cancel(self) -> None:
        """Abort the request (its blocks are freed); the stream ends with finish_reason "abort"."""
        self._loop._cancel(self.request_id)


class EngineLoop:
    """One background thread drives `engine.step()`; any thread may submit and stream."""

    def __init__(self, engine: LLMEngine, max_queued: int = 256, stall_timeout: float = 60.0):
        self.engine = engine
        self.max_queued = positive_int("max_queued", max_queued)
        self.stall_timeout = stall_timeout
        self._cv = threading.Condition()
        self._inbox: deque[Request] = deque()
        self._cancels: deque[str] = deque()
        self._streams: dict[str, RequestStream] = {}
        self._accepting = True
        self._deadline: float | None = None  # set by shutdown
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._last_progress = now()
        self._waiting = self._running = 0

    def start(self) -> EngineLoop:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lmops-engine-loop", daemon=True)
            self._thread.start()
        return self

    @property
    def num_waiting(self) -> int:
        return len(self._inbox) + self._waiting

    @property
    def num_running(self) -> int:
        return self._running

    def _pending(self) -> bool:
        return bool(self._inbox or self._streams)

    def submit(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        score_prompt: bool = False,
    ) -> RequestStream:
        req = self.engine.make_request(
            request_id, prompt, params, priority, score_prompt
        )  # raises ValueError here
        with self._cv:
            if not self._accepting:
                raise RuntimeError("shutting down")
            if self._error is not None or self._thread is None or not self._thread.is_alive():
                raise RuntimeError("engine loop is not running")
            if self.num_waiting >= self.max_queued:
                raise QueueFullError(
                    f"{self.num_waiting} requests are already waiting (max_queued={self.max_queued})"
                )
            if req.request_id in self._streams:
                raise ValueError(f"request_id {req.request_id!r} is already in use")
            if not self._pending():
                self._last_progress = now()
            stream = self._streams[req.request_id] = RequestStream(self, req.request_id)
            self._inbox.append(req)
            self._cv.notify()
        return stream

    def _cancel(self, request_id: str) -> None:
        with self._cv:
            self._cancels.append(request_id)
            self._cv.notify()

    def healthy(self) -> bool:
        """Thread alive, no crash, and steps completing while there is work."""
        if self._error is not None or self._thread is None or not self._thread.is_alive():
            return False
        with self._cv:
            return not self._pending() or now() - self._last_progress < self.stall_timeout

    def shutdown(self, timeout: float = 30.0) -> None:
        """Refuse new work, let in-flight requests finish for `timeout` s, abort the rest, join."""
        with self._cv:
            self._accepting = False
            self._deadline = now() + timeout
            self._cv.notify()
        if self._thread is not None and self._thread.is_alive():
            # The loop aborts what is left at the deadline, between steps (a step is short).
            self._thread.join(max(timeout, 0.0) + 30.0)
        elif self._error is None:  # never started: end whatever was queued
            self._abort_all()
        self.engine.close()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        with self._cv:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream._put(out)
                    if out.finished:
                        del self._streams[out.request_id]

    def _abort_all(self) -> None:
        with self._cv:
            inbox, self._inbox = list(self._inbox), deque()
        for req in inbox:
            self.engine.add_request(None, req)
        self._deliver([o for rid in list(self.engine.requests) if (o := self.engine.abort(rid))])

    def _run(self) -> None:
        eng = self.engine
        try:
            while True:
                with self._cv:
                    while not (
                        self._inbox
                        or self._cancels
                        or self._deadline is not None
                        or eng.has_unfinished_requests()
                    ):
                        self._cv.wait()
                    for req in self._inbox:  # under the lock: num_waiting never undercounts
                        try:
                            eng.add_request(None, req)
                        except ValueError as exc:  # e.g. a request id reused outside this loop
                            self._streams.pop(req.request_id)._put(exc)
                    if self._inbox:
                        self._inbox.clear()
                        self._waiting = eng.num_waiting
                    cancels, self._cancels = list(self._cancels), deque()
                    deadline = self._deadline
                self._deliver([o for rid in cancels if (o := eng.abort(rid))])
                if deadline is not None and (now() >= deadline or not eng.has_unfinished_requests()):
                    self._abort_all()
                    return
                if eng.has_unfinished_requests():
                    outputs = eng.step()
                    with self._cv:
                        self._last_progress = now()
                        self._waiting, self._running = eng.num_waiting, eng.num_running
                    self._deliver(outputs)
        except BaseException as exc:  # noqa: BLE001 - any failure must reach every waiting stream
            log.exception("engine loop failed")
            self._error = exc
            with self._cv:
                streams, self._streams = list(self._streams.values()), {}
            for stream in streams:
                failure = RuntimeError(f"engine loop failed: {exc!r}")
                failure.__cause__ = exc
                stream._put(failure)
