"""deploy/monitoring: rules (promtool unit tests), Alertmanager routing (amtool), the Grafana
dashboard against a real /metrics, the compose profile, and the kustomize component against
prometheus-operator's CRD schemas. Malformed files are reported with file and line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from deploy.monitoring import check
from production_service.app import create_app
from production_service.settings import ServiceConfig
from tests.conftest import make_tiny_model_dir
from tests.monitoring.conftest import MONITORING, REPO, RULES, binary

DASHBOARD = MONITORING / "grafana" / "lmops.json"


def run(*cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=120, cwd=REPO, **kw)


def test_rule_unit_tests_pass():
    proc = run(binary("promtool"), "test", "rules", MONITORING / "rules_test.yml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_every_rule_has_a_unit_test():
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    tests = yaml.safe_load((MONITORING / "rules_test.yml").read_text())["tests"]
    exprs = {t["expr"] for group in tests for t in group.get("promql_expr_test", [])}
    fired = {
        t["alertname"] for group in tests for t in group.get("alert_rule_test", []) if t.get("exp_alerts")
    }
    assert {r["record"] for r in rules if "record" in r} <= exprs
    assert {r["alert"] for r in rules if "alert" in r} <= fired


def test_drift_alert_is_labelled_for_the_retraining_route():
    rules = {r.get("alert"): r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    assert rules["LmopsPromptDrift"]["labels"]["action"] == "retrain"
    config = MONITORING / "alertmanager.yml"
    amtool = binary("amtool")
    proc = run(amtool, "check-config", config)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for labels, receiver in [
        (["alertname=LmopsPromptDrift", "action=retrain", "severity=warning"], "retrain"),
        (["alertname=LmopsNoReadyReplica", "severity=critical"], "pager"),
        (["alertname=LmopsKVCacheFull", "severity=warning"], "team"),
    ]:
        proc = run(amtool, "config", "routes", "test", f"--config.file={config}", *labels)
        assert proc.stdout.split() == [receiver], proc.stdout + proc.stderr


def test_malformed_rules_are_reported_with_file_and_line(tmp_path):
    binary("promtool")
    assert check.check_rules(RULES) == []
    lines = RULES.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if "record: job:lmops_kv_cache_usage:max" in line)
    bad_expr = list(lines)
    bad_expr[at + 1] = "        expr: max by (job) (lmops:kv_cache_usage_perc"
    broken = tmp_path / "rules.yml"
    broken.write_text("\n".join(bad_expr) + "\n")
    [problem] = check.check_rules(broken)
    assert problem.startswith(f"{broken}:{at + 2}:") and "parse error" in problem
    bad_template = RULES.read_text().replace("{{ $labels.job }}: no replica", "{{ $labels.job: no replica")
    broken.write_text(bad_template)
    line = next(i for i, x in enumerate(bad_template.splitlines(), 1) if "alert: LmopsNoReadyReplica" in x)
    [problem] = check.check_rules(broken)
    assert problem.startswith(f"{broken}:{line}:") and "LmopsNoReadyReplica" in problem
    broken.write_text(RULES.read_text().replace("    rules:\n      - record", "    rules:\n     - record", 1))
    [problem] = check.check_rules(broken)
    assert problem.startswith(f"{broken}:") and "not YAML" in problem


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> set[str]:
    """The sample names a real /metrics exposes after some traffic, with a reference model
    and a challenger shadowing it."""
    model = make_tiny_model_dir(
        tmp_path_factory.mktemp("model"), meta={"metrics": {"test_bits_per_byte": 3.0}}
    )
    config = ServiceConfig(
        model_dir=model, challenger_dir=model, shadow_share=1.0, device="cpu", drift_sample=1.0
    )
    app = create_app(config)
    runtime = app.extensions["lmops"]
    assert runtime.wait_ready(60), runtime.error
    client = app.test_client()
    body = {"prompt": "def f1(x):\n    return", "max_tokens": 3, "temperature": 0}
    client.post("/v1/completions", json=body).close()
    client.post("/v1/completions", json={"prompt": 1}).close()  # a 400, for the status series
    text = client.get("/metrics").get_data(as_text=True)
    runtime.shutdown(5)
    return check.exported_names(text)


def test_rules_and_dashboard_read_only_exported_metrics(exported):
    binary("promtool")
    recorded = check.recorded_names()
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            assert check.metric_names(rule["expr"]) <= exported | recorded, rule
    assert check.check_dashboard(DASHBOARD, exported | recorded) == []
    panels = {p["title"] for p in json.loads(DASHBOARD.read_text())["panels"]}
    for want in ("Requests per second", "Tokens per second", "Time to first token", "Inter-token latency"):
        assert want in panels
    for want in ("Errors by status", "Queue and running", "KV cache usage", "Prefix cache hit rate"):
        assert want in panels
    assert "Drift: prompt bits per byte vs reference" in panels
    assert {
        "Shadow: challenger vs champion bits per byte on live prompts",
        "Served versions and swaps",
    } <= panels


def test_metric_names_reads_only_metrics():
    expr = 'sum by (job, le) (rate(a:b_bucket{x="y",le=~"1|2"}[5m] offset 1h)) / on (job) c_total > bool 2e3'
    assert check.metric_names(expr) == {"a:b_bucket", "c_total"}
    assert check.metric_names("histogram_quantile(0.5, sum without (i) (rate(d[1m:10s])))") == {"d"}


def test_malformed_dashboard_is_reported_with_file_and_line(tmp_path, exported):
    binary("promtool")
    known = exported | check.recorded_names()
    text = DASHBOARD.read_text()
    broken = tmp_path / "lmops.json"
    broken.write_text(text.replace("lmops:kv_cache_usage_perc{", "lmops:kv_cache_usage{"))
    line = next(i for i, x in enumerate(text.splitlines(), 1) if "lmops:kv_cache_usage_perc{" in x)
    [problem] = check.check_dashboard(broken, known)
    assert (
        problem.startswith(f"{broken}:{line}: panel 'KV cache usage'") and "lmops:kv_cache_usage" in problem
    )
    broken.write_text(text.replace("sum(lmops:num_requests_running{", "sum(lmops:num_requests_running{{"))
    line = next(i for i, x in enumerate(text.splitlines(), 1) if "sum(lmops:num_requests_running{" in x)
    [problem] = check.check_dashboard(broken, known)
    assert problem.startswith(f"{broken}:{line}: panel 'Queue and running'") and "parse error" in problem
    broken.write_text(text.replace('"panels": [', '"panels": [,', 1))
    line = next(i for i, x in enumerate(text.splitlines(), 1) if '"panels": [' in x)
    assert check.check_dashboard(broken, known) == [f"{broken}:{line}: not JSON: Expecting value"]


def test_compose_monitoring_profile_is_wired_to_these_files():
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    for name in ("prometheus", "grafana", "alertmanager"):
        assert services[name]["profiles"] == ["monitoring"]
        for volume in services[name]["volumes"]:
            source = volume.split(":")[0]
            assert not source.startswith("./") or (REPO / source).exists(), source
    proc = run(binary("promtool"), "check", "config", MONITORING / "prometheus.yml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    assert config["scrape_configs"][0]["static_configs"][0]["targets"] == ["lmops:5002"]
    provisioned = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert provisioned["datasources"][0]["url"] == "http://prometheus:9090"


def test_kustomize_component_is_valid_against_the_operator_crds(tmp_path):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    assert (MONITORING / "kubernetes" / "prometheusrule.yaml").read_text() == check.render_prometheus_rule()
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(REPO / "deploy" / "eks", overlay)],
                "components": [os.path.relpath(MONITORING / "kubernetes", overlay)],
            }
        )
    )
    rendered = run(kubectl, "kustomize", overlay)
    assert rendered.returncode == 0, rendered.stderr
    docs = {d["kind"]: d for d in yaml.safe_load_all(rendered.stdout)}
    assert docs["PrometheusRule"]["spec"] == yaml.safe_load(RULES.read_text())
    pod_labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    monitor = docs["PodMonitor"]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= pod_labels.items()
    ports = {
        p["name"] for c in docs["Deployment"]["spec"]["template"]["spec"]["containers"] for p in c["ports"]
    }
    assert {e["port"] for e in monitor["podMetricsEndpoints"]} <= ports
    validate = run(sys.executable, "deploy/validate.py", "-", input=rendered.stdout)
    assert validate.returncode == 0, validate.stdout
    assert "ok   -: PodMonitor/lmops" in validate.stdout and "ok   -: PrometheusRule/lmops" in validate.stdout
    # Strict: a misspelt field is an error.
    bad = rendered.stdout.replace("podMetricsEndpoints:", "podMetricEndpoints:")
    validate = run(sys.executable, "deploy/validate.py", "-", input=bad)
    assert validate.returncode == 1 and "podMetricEndpoints" in validate.stdout
