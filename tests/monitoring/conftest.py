"""A real Prometheus for tests: `prometheus(targets)` starts one on a free 127.0.0.1 port
that scrapes `targets` every second, evaluates the lmops rules every second, and answers
PromQL through its HTTP API. Reusable by any test that wants real queries (canary analysis).

    def test_x(prometheus):
        prom = prometheus({"lmops": ["127.0.0.1:5001"]})
        prom.wait_for("job:lmops_requests:rate5m")     # -> the query's result vector

Skips (naming the missing binary) where Debian's prometheus package is not installed;
CI installs it (`make monitoring-tools`), so there it never skips.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import yaml

from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "deploy" / "monitoring"
RULES = MONITORING / "rules.yml"


def binary(name: str) -> str:
    """Path of a Prometheus tool; skip the test, saying how to get it, when it is missing."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed: run `make monitoring-tools` (Debian's prometheus packages)")
    return path


class PromQLError(RuntimeError):
    pass


@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen
    log: Path

    def api(self, path: str, **params) -> object:
        r = requests.get(f"{self.url}/api/v1/{path}", params=params, timeout=10)
        body = r.json()
        if body.get("status") != "success":
            raise PromQLError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """Instant query: the result vector (`[{"metric": {...}, "value": [t, "v"]}, ...]`)."""
        return self.api("query", query=expr)["result"]

    def value(self, expr: str) -> float:
        """The single value of a one-element result."""
        result = self.query(expr)
        assert len(result) == 1, f"{expr}: expected one series, got {result}"
        return float(result[0]["value"][1])

    def wait_for(
        self, expr: str, check: Callable[[list[dict]], bool] = bool, timeout: float = 60
    ) -> list[dict]:
        """Poll `expr` until `check(result)` (default: any result); fail with the last result."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if check(result):
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"{expr}: still {result} after {timeout} s\n{self.tail()}")
            time.sleep(0.5)

    def alerts(self, name: str | None = None) -> list[dict]:
        """Active (pending or firing) alerts, optionally only those named `name`."""
        found = self.api("alerts")["alerts"]
        return [a for a in found if name is None or a["labels"].get("alertname") == name]

    def targets_up(self, timeout: float = 30) -> None:
        self.wait_for("up", lambda r: bool(r) and all(s["value"][1] == "1" for s in r), timeout)

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def prometheus(tmp_path_factory) -> Iterator[Callable[..., Prometheus]]:
    """Factory: `prometheus(targets, rule_files=(RULES,), metrics_path="/metrics")` where
    `targets` maps a job name to its "host:port" list (a plain list means job "lmops")."""
    exe = binary("prometheus")
    started: list[Prometheus] = []

    def start(
        targets: dict[str, list[str]] | list[str],
        rule_files: tuple[Path, ...] = (RULES,),
        metrics_path: str = "/metrics",
    ) -> Prometheus:
        if not isinstance(targets, dict):
            targets = {"lmops": list(targets)}
        folder = tmp_path_factory.mktemp("prometheus")
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [
                {"job_name": job, "metrics_path": metrics_path, "static_configs": [{"targets": hosts}]}
                for job, hosts in targets.items()
            ],
        }
        (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        log = folder / "prometheus.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [
                    exe,
                    f"--config.file={folder / 'prometheus.yml'}",
                    f"--storage.tsdb.path={folder / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                    "--web.enable-lifecycle",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        prom = Prometheus(f"http://127.0.0.1:{port}", proc, log)
        started.append(prom)
        deadline = time.monotonic() + 30
        while True:
            try:
                if requests.get(f"{prom.url}/-/ready", timeout=1).status_code == 200:
                    return prom
            except requests.RequestException:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"prometheus did not start:\n{prom.tail()}")
            time.sleep(0.2)

    yield start
    for prom in started:
        prom.stop()
