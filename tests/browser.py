"""Headless Chromium (Debian's `chromium`, installed by `make browser-tools`): the DOM of a
page after its scripts ran, and a screenshot of it, from one browser run.

Offline on purpose: every request except to loopback goes to a dead proxy, so a page that
needs the internet (a CDN) renders here as it would on a machine without one.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--proxy-server=http://127.0.0.1:9",  # discard: nothing listens there (loopback bypasses it)
)


# A loaded 2-core host has taken over 120 s for the MLflow run page.
ATTEMPT_S = 200


def chromium() -> str:
    """Path of the browser; skip the test, saying how to get it, when it is missing."""
    path = shutil.which("chromium")
    if path is None:
        pytest.skip("chromium is not installed: run `make browser-tools` (Debian's chromium)")
    return path


def render(url: str, screenshot: Path, width: int = 1400, height: int = 900, budget_ms: int = 15_000) -> str:
    """The page's DOM once its scripts have run for `budget_ms` of virtual time (which waits
    for pending requests), and its screenshot in `screenshot`.

    A browser that has not finished in ATTEMPT_S is killed and started once more with a
    fresh profile: headless Chromium has hung for good at times (300 s on an MLflow page
    that renders in 30-50 s on the same loaded 2-core host), where a second run does not."""
    screenshot.parent.mkdir(parents=True, exist_ok=True)
    hung = None
    for _ in range(2):
        with tempfile.TemporaryDirectory() as profile:
            try:
                proc = subprocess.run(
                    [
                        chromium(),
                        *FLAGS,
                        f"--user-data-dir={profile}",
                        f"--window-size={width},{height}",
                        f"--virtual-time-budget={budget_ms}",
                        f"--screenshot={screenshot}",
                        "--dump-dom",
                        url,
                    ],
                    capture_output=True,
                    text=True,
                    timeout=ATTEMPT_S,
                )
            except subprocess.TimeoutExpired as exc:
                hung = exc
                continue
        assert proc.returncode == 0 and screenshot.is_file(), proc.stderr[-3000:]
        return proc.stdout
    raise AssertionError(f"chromium did not finish {url} in {ATTEMPT_S} s, twice: {hung}")


def visible_text(dom: str) -> str:
    """The words a reader sees: no scripts, styles or tags."""
    body = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S)
    return " ".join(re.sub(r"<[^>]+>", " ", body).split())


def colours(screenshot: Path) -> int:
    """How many distinct colours the screenshot has (a blank page has one or two)."""
    from PIL import Image

    with Image.open(screenshot) as image:
        return len(image.convert("RGB").getcolors(maxcolors=1 << 24))
