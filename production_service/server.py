"""Starting the service, the one way: gunicorn with production_service/gunicorn.conf.py
(which names the app), and waiting until /ready says 200. Used by `lmops serve`
(`python -m production_service.server`), `make serve`, the tests and the load benchmark;
standard library only."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

GUNICORN_CONF = Path(__file__).resolve().with_name("gunicorn.conf.py")


def gunicorn_argv(python: str = sys.executable) -> list[str]:
    """The command line that serves the app (host, port and the rest from the environment)."""
    return [python, "-m", "gunicorn", "--config", str(GUNICORN_CONF)]


def wait_ready(url: str, proc: subprocess.Popen | None = None, timeout: float = 60) -> bool:
    """Poll `url`/ready until it answers 200; False if `proc` exits or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (proc is None or proc.poll() is None):
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=2) as response:
                if response.status == 200:
                    return True
        except (OSError, urllib.error.URLError):  # not listening yet, loading (503), or busy
            pass
        time.sleep(0.1)
    return False


if __name__ == "__main__":  # `lmops serve`: become gunicorn
    argv = gunicorn_argv()
    os.execv(argv[0], argv)
