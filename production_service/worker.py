"""gunicorn's gthread worker, plus what one model replica needs from it:

- a deadline for the request head: a client that has not sent its request line
  and headers `header_timeout` seconds after the worker took its connection has
  that connection shut down, so trickling clients cannot hold the request threads
  (gunicorn already hands idle connections back to its poller and closes them
  after `keepalive` seconds);
- the probe port: /health, /ready, /metrics and /openapi.json on their own
  listener with a thread per connection, so probes answer while every request
  thread is taken (the admin/inference split of production model servers);
- gunicorn's own error responses (431 header too large, 400 bad request line)
  in the OpenAI error shape instead of its HTML page.
"""

from __future__ import annotations

import json
import logging
import socket
import threading

from gunicorn import util
from gunicorn.workers import gthread
from werkzeug.serving import WSGIRequestHandler, make_server

from production_service.errors import error_body
from production_service.settings import ServiceConfig

log = logging.getLogger(__name__)

PROBE_READ_TIMEOUT_S = 5


class ThreadWorker(gthread.ThreadWorker):
    def load_wsgi(self):
        super().load_wsgi()
        config = ServiceConfig.from_env()
        self.header_timeout = config.header_timeout
        util.write_error = write_json_error  # every error page gunicorn writes goes through it
        if config.probe_port:
            start_probe_server(self.wsgi, config.host, config.probe_port)

    def handle(self, conn):
        timer = threading.Timer(self.header_timeout, _cut, (conn.sock, self.header_timeout))
        timer.daemon = True
        conn.head_timer = timer
        timer.start()
        try:
            return super().handle(conn)
        finally:
            timer.cancel()

    def handle_request(self, req, conn):
        conn.head_timer.cancel()  # the head is in: the request is the app's now
        return super().handle_request(req, conn)


def _cut(sock: socket.socket, after: float) -> None:
    """Wake the thread blocked reading this connection's head: it sees the end of the
    stream and closes the connection."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed
        return
    log.warning("closed a connection that sent no complete request head within %.0f s", after)


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


def start_probe_server(app, host: str, port: int):
    """Serve `app`'s ops endpoints on `port` from a daemon thread; returns the server."""
    from production_service.app import probe_app

    server = make_server(host, port, probe_app(app), threaded=True, request_handler=_ProbeHandler)
    threading.Thread(target=server.serve_forever, name="lmops-probes", daemon=True).start()
    log.info("probes on http://%s:%d (/health, /ready, /metrics)", host, port)
    return server
