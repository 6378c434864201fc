"""/openapi.json matches the behaviour: schemathesis (its CLI, every check:
status codes, bodies, SSE events, headers, no 5xx, invalid data rejected, valid
data accepted, auth enforced, 405s) against the live server's own document,
bounded in examples and time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.service.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_live_server_matches_its_openapi_document(server, tmp_path):
    # schemathesis' pytest integration breaks on pytest 9 (it sets the private
    # `node._nodeid`), so its CLI runs the same generators and checks instead.
    cli = Path(sys.executable).parent / "schemathesis"
    env = {**os.environ, "PYTHONPATH": str(REPO), "SCHEMATHESIS_HOOKS": "tests.service.schemathesis_hooks"}
    result = subprocess.run(
        [
            str(cli),
            "run",
            f"{server.url}/openapi.json",
            "--checks",
            "all",
            "--max-examples",
            "12",
            "--max-time",
            "25",
            "--request-timeout",
            "30",
            "--seed",
            "4",
            "--generation-database",
            "none",
            "--header",
            "Authorization: Bearer test-key",
            "--no-color",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )  # its cache goes there
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "No issues found" in result.stdout
