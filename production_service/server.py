"""Starting the service, the one way: gunicorn with production_service/gunicorn.conf.py
(which names the app), in `serving_env`, and waiting until /ready says 200. Used by
`lmops serve` (`python -m production_service.server`), `make serve`, the tests and the load
benchmark; standard library only."""

from __future__ import annotations

import ctypes.util
import math
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

GUNICORN_CONF = Path(__file__).resolve().with_name("gunicorn.conf.py")


# A CPU step allocates and frees dozens of small tensors (the compiled decode graph's
# buffers, each step). torch asks for 64-byte-aligned memory (posix_memalign), which glibc's
# malloc serves on its slow path (perf: _mid_memalign, _int_malloc, malloc_consolidate);
# tcmalloc and jemalloc serve it from their size classes: one compiled stream decodes
# 1.03x-1.08x as fast at 1 thread, 1.08x-1.12x at 2, on a 2-core Xeon with AVX-512
# (benchmarks/README.md, "The allocator").
# torch's own CPU launcher (torch.backends.xeon.run_cpu) preloads them the same way.
# In order of preference:
MALLOC_LIBRARIES = ("tcmalloc_minimal", "tcmalloc", "jemalloc")


def gunicorn_argv(python: str = sys.executable) -> list[str]:
    """The command line that serves the app (host, port and the rest from the environment)."""
    return [python, "-m", "gunicorn", "--config", str(GUNICORN_CONF)]


def serving_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's environment) to serve in: where it sets no LD_PRELOAD,
    the first of MALLOC_LIBRARIES installed here preloaded. An LD_PRELOAD already set, even
    empty (glibc's malloc), is the caller's choice and stays."""
    env = dict(os.environ if env is None else env)
    if "LD_PRELOAD" not in env:
        found = next(filter(None, map(ctypes.util.find_library, MALLOC_LIBRARIES)), None)
        if found:
            env["LD_PRELOAD"] = found
    return env


# torch's threads and inductor's compile workers: both count the cores this process may run
# on, which in a container are all of its host's, whatever its CPU quota.
THREAD_SETTINGS = ("OMP_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS")
CGROUP = Path("/sys/fs/cgroup")


def cpu_quota(cgroup: Path = CGROUP) -> int | None:
    """The CPUs this process's cgroup may use, rounded up (`docker run --cpus`, a Kubernetes
    CPU limit, systemd's CPUQuota), or None where it has no quota: cgroup v2's cpu.max, else
    v1's cpu.cfs_quota_us over cpu.cfs_period_us."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()
    except (OSError, ValueError):
        try:
            quota = (cgroup / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (cgroup / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    if quota in ("max", "-1"):
        return None
    return max(1, math.ceil(int(quota) / int(period)))


def thread_env(env: Mapping[str, str], cgroup: Path = CGROUP) -> dict[str, str]:
    """What to add to `env` so that torch runs as many threads as the CPU quota allows, not
    one per core of the host (throttled, and written into the compiled decode graphs), and
    inductor starts as many compile workers: each of THREAD_SETTINGS that `env` does not set,
    where a quota is below the cores this process may run on."""
    quota = cpu_quota(cgroup)
    if quota is None or quota >= len(os.sched_getaffinity(0)):
        return {}
    return {name: str(quota) for name in THREAD_SETTINGS if name not in env}


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
    os.execve(argv[0], argv, serving_env())
