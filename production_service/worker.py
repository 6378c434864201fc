"""gunicorn's gthread worker, plus what one model replica needs from it:

- a deadline for the request head: a client that has not sent its request line
  and headers `header_timeout` seconds after the worker took its connection has
  that connection shut down, so trickling clients cannot hold the request threads
  (gunicorn already hands idle connections back to its poller and closes them
  after `keepalive` seconds);
- a deadline for the body, `body_timeout` seconds from the end of the head, after
  which the client gets a 408 and its connection is closed. A Content-Length body
  is gathered without holding a request thread: what has arrived is read without
  blocking, and the connection goes back to gunicorn's poller until more comes
  (a pause longer than `keepalive` ends it too), so the app only ever sees whole
  bodies (nginx's request buffering). A chunked body is read on its thread, cut
  at the deadline;
- retries that come early: a connection refused with 429 that asks again before
  its `Retry-After` is up is held, without a thread, until it is, then served if the
  queue has room or refused again; so a client retrying every few milliseconds costs
  about what a polite one does (a request parsed per `Retry-After`), not a parse and
  a write each time, which take the GIL from the engine's loop;
- the probe port: /health, /ready, /metrics and /openapi.json on their own
  listener with a thread per connection, so probes answer while every request
  thread is taken (the admin/inference split of production model servers); its
  /ready also asks the API port for /health, so a replica whose request threads
  are all stuck is taken out of the Service;
- gunicorn's own error responses (431 header too large, 400 bad request line)
  in the OpenAI error shape instead of its HTML page.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass

from gunicorn import util
from gunicorn.http.body import ChunkedReader, LengthReader
from gunicorn.workers import gthread
from werkzeug.serving import WSGIRequestHandler, make_server

from production_service.errors import error_body
from production_service.settings import ServiceConfig

log = logging.getLogger(__name__)

PROBE_READ_TIMEOUT_S = 5
# The probe port's /ready asks the API port for /health; no answer within this long
# (kubelet's readiness timeout is 5 s) means the API cannot take a request.
API_CHECK_TIMEOUT_S = 2


QUEUED_PATHS = ("/v1/completions", "/v1/chat/completions", "/predict")  # what the engine's queue takes
RETRY_AFTER_S = 1
_QUEUE_FULL_BODY = json.dumps(
    error_body(429, "The server's queue is full; retry shortly.", "queue_full")
).encode()
_QUEUE_FULL = (
    "HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\n"
    f"Retry-After: {RETRY_AFTER_S}\r\n"
    f"Content-Length: {len(_QUEUE_FULL_BODY)}\r\n"
).encode()


@dataclass
class _PendingBody:
    """A Content-Length body being gathered between the poller's wake-ups."""

    req: object
    length: int
    deadline: float
    data: bytearray


_HOLD = object()  # handle()'s answer for a request held until its Retry-After is up


class ThreadWorker(gthread.ThreadWorker):
    def load_wsgi(self):
        super().load_wsgi()
        config = ServiceConfig.from_env()
        self.header_timeout = config.header_timeout
        self.body_timeout = config.body_timeout
        self.max_body_bytes = config.max_body_bytes
        self.held_conns = []  # early retries, each with its request and release time
        util.write_error = write_json_error  # every error page gunicorn writes goes through it
        if config.probe_port:
            start_probe_server(self.wsgi, config.host, config.probe_port, api_port=config.port)

    def handle(self, conn):
        pending, held = getattr(conn, "body", None), getattr(conn, "held", None)
        if pending is not None or held is not None:  # more of a body arrived, or a hold ended
            conn.held = None
            try:
                if held is not None:
                    return self._keepalive_after(conn, self._dispatch(held, conn, was_held=True))
                return self._keepalive_after(conn, self._gather(conn))
            except (StopIteration, OSError):  # the client left, or the response failed midway
                return False
            except Exception as exc:
                self.handle_error(held or pending.req, conn.sock, conn.client, exc)
                return False
        timer = threading.Timer(self.header_timeout, _cut, (conn.sock, self.header_timeout))
        timer.daemon = True
        conn.head_timer = timer
        timer.start()
        try:
            return super().handle(conn)
        finally:
            timer.cancel()

    def handle_request(self, req, conn):
        """The head is in: gather the body within the deadline, then hand the request to the app."""
        conn.head_timer.cancel()
        deadline = time.monotonic() + self.body_timeout
        reader = req.body.reader
        if req._expected_100_continue:  # gunicorn would send it only once the app reads
            conn.sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            req._expected_100_continue = False
        if isinstance(reader, LengthReader) and 0 < reader.length <= self.max_body_bytes:
            data = bytearray(conn.parser.unreader.take_buffered())
            conn.parser.unreader.unread(bytes(data[reader.length :]))  # a pipelined next request
            del data[reader.length :]
            conn.body = _PendingBody(req, reader.length, deadline, data)
            return self._gather(conn)
        if isinstance(reader, LengthReader) and reader.length > self.max_body_bytes:
            req.must_close = True  # the app answers 413 unread; nothing is drained after it
        elif isinstance(reader, ChunkedReader) and not self._read_chunked(req, conn, deadline):
            return False
        return self._dispatch(req, conn)

    def _gather(self, conn):
        """Read what has arrived of the pending body without blocking: the whole body
        goes to the app; a partial one goes back to the poller (gunicorn's _DEFER)."""
        pending = conn.body
        conn.sock.setblocking(False)
        try:
            while len(pending.data) < pending.length:
                chunk = conn.sock.recv(min(1 << 16, pending.length - len(pending.data)))
                if not chunk:  # the client left mid-body
                    return False
                pending.data += chunk
        except BlockingIOError:
            if time.monotonic() < pending.deadline:
                return gthread._DEFER
            self._late(conn)
            return False
        finally:
            conn.sock.setblocking(True)
        conn.body = None
        pending.req.body = io.BytesIO(pending.data)  # wsgi.input: the app reads from memory
        return self._dispatch(pending.req, conn)

    def _dispatch(self, req, conn, was_held: bool = False):
        """The request to the app; or, for a completion while the queue is full, the 429
        written from here (a parse and a write, not the app's request handling), or,
        for a retry before the last 429's Retry-After is up, a hold until it is.
        Counted on /metrics like any request; not access-logged one by one (a retry
        storm would flood the log)."""
        if req.method == "POST" and req.path in QUEUED_PATHS and self._queue_full(req):
            now = time.monotonic()
            refused_at = getattr(conn, "refused_at", None)
            if not was_held and self.alive and refused_at is not None and now < refused_at + RETRY_AFTER_S:
                conn.held, conn.release_at = req, refused_at + RETRY_AFTER_S
                return _HOLD
            started = time.perf_counter()
            close = req.should_close()
            util.write(
                conn.sock,
                _QUEUE_FULL + (b"Connection: close\r\n" if close else b"") + b"\r\n" + _QUEUE_FULL_BODY,
            )
            conn.refused_at = now
            self.wsgi.extensions["lmops.http"].count("POST", req.path, 429, time.perf_counter() - started)
            return not close
        return super().handle_request(req, conn)

    def finish_request(self, conn, fs):
        """A held connection waits in `held_conns`, off the poller (its client sent its
        request and reads nothing more until the answer)."""
        if not fs.cancelled() and fs.exception() is None and fs.result() is _HOLD:
            self.held_conns.append(conn)
            return
        super().finish_request(conn, fs)

    def _queue_full(self, req) -> bool:
        """Full, for a request the app would otherwise take (model ready, key right)."""
        runtime = self.wsgi.extensions["lmops"]
        loop = runtime.loop
        if not runtime.ready or loop is None or loop.num_waiting < loop.max_queued:
            return False
        authorization = next((v for h, v in req.headers if h == "AUTHORIZATION"), "")
        return runtime.config.authorizes(authorization)

    def _read_chunked(self, req, conn, deadline: float) -> bool:
        """Read a chunked body (up to one byte over the limit, for the app's 413) on this
        thread, its socket's reading side shut at the deadline; False after a 408."""
        timer = threading.Timer(max(deadline - time.monotonic(), 0), _shut_reading, (conn.sock,))
        timer.daemon = True
        timer.start()
        try:
            data = req.body.read(self.max_body_bytes + 1)
        except OSError:  # gunicorn's NoMoreData and chunk errors are OSErrors too
            if time.monotonic() < deadline:
                raise
            self._late(conn)
            return False
        finally:
            timer.cancel()
        if len(data) > self.max_body_bytes:
            req.must_close = True  # the rest of the body is never read
        req.body = io.BytesIO(data)
        return True

    def _keepalive_after(self, conn, keepalive):
        if keepalive is gthread._DEFER or keepalive is _HOLD:  # not answered yet: nothing to drain
            return keepalive
        return super()._keepalive_after(conn, keepalive)

    def murder_pending(self):
        """Release the held retries whose time has come (all of them when the worker
        stops); answer 408 to connections whose body missed its deadline or paused
        longer than `keepalive` (gunicorn would close them silently), then let gunicorn
        close the rest. Runs on every turn of the worker's loop (at least once a second)."""
        now = time.monotonic()
        due = [c for c in self.held_conns if not self.alive or now >= c.release_at]
        for conn in due:
            self.held_conns.remove(conn)
            self.enqueue_req(conn)
        late = [
            c
            for c in self.pending_conns
            if getattr(c, "body", None) and now >= min(c.body.deadline, c.timeout)
        ]
        for conn in late:
            self.pending_conns.remove(conn)
            with contextlib.suppress(OSError, KeyError, ValueError):
                self.poller.unregister(conn.sock)
            self.nr_conns -= 1
            self._late(conn)
            conn.close()
        super().murder_pending()

    def _late(self, conn) -> None:
        log.warning("answered 408 to a connection whose body did not arrive within %.0f s", self.body_timeout)
        with contextlib.suppress(OSError):
            write_json_error(
                conn.sock,
                408,
                "Request Timeout",
                f"The request body did not arrive within {self.body_timeout:g} s (LMOPS_BODY_TIMEOUT).",
            )


def _cut(sock: socket.socket, after: float) -> None:
    """Wake the thread blocked reading this connection's head: it sees the end of the
    stream and closes the connection."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed
        return
    log.warning("closed a connection that sent no complete request head within %.0f s", after)


def _shut_reading(sock: socket.socket) -> None:
    """Wake the thread blocked reading a late body: it sees the end of the stream, and
    can still write the 408."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RD)


def api_answers(host: str, port: int) -> bool:
    """Whether the API port takes a request now: GET /health through it, as a client
    would (listener, poller, a request thread, the app); any answer counts."""
    loopback = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    conn = http.client.HTTPConnection(loopback, port, timeout=API_CHECK_TIMEOUT_S)
    try:
        conn.request("GET", "/health")
        conn.getresponse().read()
        return True
    except OSError:
        return False
    finally:
        conn.close()


def write_json_error(sock, status_int: int, reason: str, mesg: str) -> None:
    """gunicorn's util.write_error, in the service's error shape."""
    code = reason.lower().replace(" ", "_")
    body = json.dumps(error_body(status_int, mesg or reason, code)).encode()
    head = (
        f"HTTP/1.1 {status_int} {reason}\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    util.write_nonblock(sock, head.encode("latin-1") + body)


class _ProbeHandler(WSGIRequestHandler):
    timeout = PROBE_READ_TIMEOUT_S  # a slow probe client loses its own thread, nobody else's

    def log_request(self, code="-", size="-"):  # the app writes the access log
        pass


def start_probe_server(app, host: str, port: int, api_port: int):
    """Serve `app`'s ops endpoints on `port` from a daemon thread, /ready checking that the
    API port (`api_port`) answers; returns the server."""
    from production_service.app import probe_app

    probe = probe_app(app, api_answers=lambda: api_answers(host, api_port))
    server = make_server(host, port, probe, threaded=True, request_handler=_ProbeHandler)
    threading.Thread(target=server.serve_forever, name="lmops-probes", daemon=True).start()
    log.info("probes on http://%s:%d (/health, /ready, /metrics)", host, port)
    return server
