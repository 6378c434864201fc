"""gunicorn settings for one model replica: `gunicorn --config production_service/gunicorn.conf.py`
(the app, `wsgi_app`, is named here; `production_service.server` builds that command).

One worker (production_service.worker: gthread plus a request-head deadline, the
probe port and JSON error pages) holds the engine and its loop thread (scale out
with replicas, not workers), and with LMOPS_KV_EVENTS_CONFIG the one publisher that
binds the replica's event endpoints (a respawned worker binds them again once the dead
one is gone); the app is built in that worker after the fork (no preload), so nothing
of the engine ever runs in the master. Every value comes from
ServiceConfig.from_env, the same parser the app uses.
"""

import os
import signal
import sys
import threading

from lmops.errors import LmopsError
from production_service.server import thread_env
from production_service.settings import ServiceConfig

try:
    _config = ServiceConfig.from_env()
except LmopsError as exc:
    sys.exit(f"lmops: {exc}")

# The container's CPU quota, not its host's cores, sets torch's threads and inductor's compile
# workers: set here, in the master, before the worker imports torch (nothing here does).
os.environ.update(thread_env(os.environ))

# The worker exits with gunicorn's WORKER_BOOT_ERROR when the model cannot load, so
# the master stops with a non-zero status instead of respawning it forever.
os.environ.setdefault("LMOPS_EXIT_ON_LOAD_FAILURE", "1")

wsgi_app = "production_service.app:create_app()"
bind = f"{_config.host}:{_config.port}"
workers = 1
worker_class = "production_service.worker.ThreadWorker"
threads = _config.worker_threads
timeout = _config.timeout
graceful_timeout = _config.graceful_timeout
keepalive = 5
preload_app = False
control_socket_disable = True  # no runtime control socket: one replica per container
accesslog = None  # the app writes one JSON line per request
errorlog = "-"
loglevel = "info"


def post_worker_init(worker):
    """On SIGTERM: refuse new requests (503, /ready 503) at once, then let in-flight
    ones finish while gunicorn drains, aborting what is left just before its
    graceful timeout, so the worker exits cleanly and the master with status 0."""
    runtime = worker.wsgi.extensions["lmops"]
    gunicorn_handler = signal.getsignal(signal.SIGTERM)
    drain_s = max(worker.cfg.graceful_timeout - 2, 1)

    def on_sigterm(signum, frame):
        threading.Thread(target=runtime.shutdown, args=(drain_s,), name="lmops-drain", daemon=True).start()
        gunicorn_handler(signum, frame)

    signal.signal(signal.SIGTERM, on_sigterm)
