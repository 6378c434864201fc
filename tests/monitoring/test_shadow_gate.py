"""The promotion gate's live comparison (lmops.pipeline.shadow) on a real Prometheus with
the lmops rules, scraping an exporter whose shadow series are set by the test: a worse
challenger is refused, a better or equal one passes, too few prompts or another served
version are not judged, and a Prometheus that does not answer is one line naming the key.
The served path (real service, real registry, `lmops promote`) is
tests/integration/test_shadow_gate.py; here each verdict is reached on purpose."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lmops.errors import LmopsError
from lmops.pipeline import shadow
from lmops.pipeline.params import PromoteConfig
from tests.conftest import free_port
from tests.monitoring.conftest import prometheus  # noqa: F401 (the real-Prometheus fixture)

pytestmark = pytest.mark.slow

PROMPTS_PER_S = 10  # mirrored prompts both models score, on each replica


class Exporter:
    """A replica's shadow series as /metrics shows them: the histogram's _count and _sum
    by role and challenger, growing at PROMPTS_PER_S with each role's given mean."""

    def __init__(self, means: dict[tuple[str, str], float]):
        self.means = means  # (role, challenger version) -> mean bits/byte
        self.started = time.monotonic()
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                body = exporter.text().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.address = f"127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def text(self) -> str:
        count = int(PROMPTS_PER_S * (time.monotonic() - self.started))
        lines = []
        for (role, version), mean in self.means.items():
            labels = f'role="{role}",challenger_model="lmops",challenger_version="{version}"'
            lines.append(f"lmops:shadow_prompt_bits_per_byte_count{{{labels}}} {count}")
            lines.append(f"lmops:shadow_prompt_bits_per_byte_sum{{{labels}}} {count * mean}")
        return "\n".join(lines) + "\n"


def test_the_gate_reads_each_verdict_from_the_live_series(prometheus):  # noqa: F811
    # Two replicas: both mirrored to v2 (worse than the champion on one, better on the
    # other), and one mirrored earlier to v3, which is better by far (its prompts must not
    # count for v2).
    replicas = [
        Exporter(
            {
                ("champion", "2"): 2.0,
                ("challenger", "2"): 2.5,
                ("champion", "3"): 2.0,
                ("challenger", "3"): 1.0,
            }
        ),
        Exporter({("champion", "2"): 3.0, ("challenger", "2"): 2.9}),
    ]
    try:
        prom = prometheus({"lmops": [r.address for r in replicas]})
        prom.targets_up()
        cfg = PromoteConfig(shadow_prometheus_url=prom.url, min_shadow_prompts=50, shadow_window="5m")
        counted = 'sum(increase(lmops:shadow_prompt_bits_per_byte_count{role="champion",challenger_version="2"}[5m]))'
        prom.wait_for(counted, lambda r: bool(r) and float(r[0]["value"][1]) >= 120)

        # v2: (2.5 + 2.9) / 2 against (2.0 + 3.0) / 2 on the same prompts: +0.2, refused (each
        # replica weighs by its prompts' increase, which Prometheus extrapolates per target).
        refused = shadow.compare(cfg, 2)
        assert refused["judged"] and not refused["passed"], refused
        assert refused["champion_bits_per_byte"] == pytest.approx(2.5, abs=0.05)
        assert refused["challenger_bits_per_byte"] == pytest.approx(2.7, abs=0.05)
        assert refused["delta_bits_per_byte"] == pytest.approx(0.2, abs=0.03)
        assert refused["prompts"] >= 120
        assert "bits/byte against the champion's" in refused["reason"]
        assert "; at most +0.0 promotes)" in refused["reason"]
        # An allowance of 0.3 bits passes the same evidence; v3's passes as it is.
        assert shadow.compare(cfg.model_copy(update={"max_shadow_regression": 0.3}), 2)["passed"]
        better = shadow.compare(cfg, 3)
        assert better["passed"] and better["delta_bits_per_byte"] == pytest.approx(-1.0, abs=0.01)

        few = shadow.compare(cfg.model_copy(update={"min_shadow_prompts": 10**6}), 2)
        assert few == {
            "judged": False,
            "prompts": few["prompts"],
            "reason": f"v2 as the challenger scored {few['prompts']} mirrored prompts in the last 5m, "
            "fewer than promote.min_shadow_prompts=1000000",
        }
        never = shadow.compare(cfg, 4)
        assert not never["judged"] and never["prompts"] == 0
    finally:
        for replica in replicas:
            replica.server.shutdown()


def test_a_prometheus_that_does_not_answer_is_one_line_naming_the_key():
    cfg = PromoteConfig(shadow_prometheus_url=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(LmopsError) as err:
        shadow.compare(cfg, 2)
    message = str(err.value)
    assert message.startswith("promote.shadow_prometheus_url: cannot read the live comparison: no answer")
    assert "\n" not in message
