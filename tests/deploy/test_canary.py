"""Canary releases through deploy/deploy.sh (CANARY=true, Argo Rollouts), run for real
against a scripted stand-in for the cluster: a promoted canary, and the faults that
must end the release with the stable version serving and a non-zero exit: an analysis
that fails, a canary that never becomes ready, an analysis that cannot reach
Prometheus, an analysis stuck inconclusive. Rendering and validation are real."""

from __future__ import annotations

import importlib.util
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.conftest import CLUSTER_SCOPED, REPO, fake_cluster, run_script, script_env, tool
from tests.deploy.test_kubernetes import validate
from tests.deploy.test_smoke import free_port

CANARY_OVERLAYS = ["aks/canary", "aks/canary/gpu", "eks/canary", "eks/canary/gpu"]


def render(kubectl: str, overlay: str) -> str:
    proc = subprocess.run(
        [kubectl, "kustomize", f"deploy/{overlay}"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("overlay", CANARY_OVERLAYS)
def test_canary_overlay_is_the_plain_one_with_a_rollout(kubectl, overlay, tmp_path):
    """Valid against the Argo Rollouts CRD schemas; the Rollout runs exactly the pods
    of the plain overlay's Deployment; everything else is unchanged but the HPA's target."""
    text = render(kubectl, overlay)
    (tmp_path / "rendered.yaml").write_text(text)
    proc = validate(tmp_path / "rendered.yaml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    canary = {d["kind"]: d for d in yaml.safe_load_all(text)}
    plain = {
        d["kind"]: d
        for d in yaml.safe_load_all(render(kubectl, overlay.replace("canary/", "").replace("/canary", "")))
    }
    assert "Deployment" not in canary and set(canary) == set(plain) - {"Deployment"} | {
        "Rollout",
        "AnalysisTemplate",
    }
    rollout, deployment = canary["Rollout"], plain["Deployment"]
    assert rollout["spec"]["template"] == deployment["spec"]["template"]
    assert rollout["spec"]["selector"] == deployment["spec"]["selector"]
    assert rollout["spec"]["progressDeadlineAbort"] is True
    steps = rollout["spec"]["strategy"]["canary"]["steps"]
    assert [s.get("setWeight") for s in steps if "setWeight" in s] == [10, 50]
    analyses = [s["analysis"] for s in steps if "analysis" in s]
    assert len(analyses) == 2 and steps[-1] == {"analysis": analyses[0]}  # the last gate before 100 %
    template = canary["AnalysisTemplate"]
    for analysis in analyses:
        assert analysis["templates"] == [{"templateName": template["metadata"]["name"]}]
        given = {a["name"] for a in analysis["args"]}
        needed = {a["name"] for a in template["spec"]["args"] if "value" not in a}
        assert given == needed == {"canary-hash", "stable-hash", "namespace"}
    target = canary["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert target == {"apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout", "name": "lmops"}
    for kind in set(plain) - {"Deployment", "HorizontalPodAutoscaler"}:  # the compile cache's too
        assert canary[kind] == plain[kind]
    assert all(
        d["metadata"].get("namespace") == "lmops" for k, d in canary.items() if k not in CLUSTER_SCOPED
    )


def test_analysis_metrics_compare_canary_with_stable_within_margins(kubectl):
    template = next(
        d for d in yaml.safe_load_all(render(kubectl, "aks/canary")) if d["kind"] == "AnalysisTemplate"
    )
    margins = {a["name"]: float(a["value"]) for a in template["spec"]["args"] if a["name"].startswith("max-")}
    assert margins == {
        "max-5xx-ratio-increase": 0.01,
        "max-ttft-p95-ratio": 1.5,
        "max-prompt-drift-ratio": 1.1,
    }
    metrics = {m["name"]: m for m in template["spec"]["metrics"]}
    assert set(metrics) == {"error-ratio", "ttft-p95", "prompt-drift"}
    for metric in metrics.values():
        query = metric["provider"]["prometheus"]["query"]
        assert "{{args.canary-hash}}" in query and "{{args.stable-hash}}" in query
        assert metric["provider"]["prometheus"]["address"] == "{{args.prometheus-address}}"
        # Pass within the margin, fail beyond it, inconclusive on NaN (neither holds).
        margin = metric["successCondition"].split("<= ")[1]
        assert metric["successCondition"] == f"result[0] <= {margin}" and margin.startswith("{{args.max-")
        assert metric["failureCondition"] == f"result[0] > {margin}"
        assert metric["failureLimit"] <= 1 and metric["consecutiveErrorLimit"] <= 2


REPORT_FAILED = """analysis lmops-6f9c-2-1: Failed Metric "error-ratio" assessed Failed due to failed (2) > failureLimit (1)
  error-ratio: Failed (2 measurements, 2 failed, 0 inconclusive, 0 errors) last value [0.31]
  ttft-p95: Running (2 measurements, 0 failed, 0 inconclusive, 0 errors) last value [1.02]"""
REPORT_ERROR = """analysis lmops-6f9c-2-1: Error Metric "ttft-p95" assessed Error due to consecutiveErrors (3) > consecutiveErrorLimit (2): "Error Message: Post "http://prometheus-operated.monitoring.svc:9090/api/v1/query": dial tcp: lookup prometheus-operated.monitoring.svc: no such host"
  ttft-p95: Error (3 measurements, 0 failed, 0 inconclusive, 3 errors) last value []"""


def cluster(tmp_path: Path, kubectl: str, states: list[str], report: str = "") -> tuple[str, Path]:
    """Stand-ins for az and kubectl (kustomize is the real one). Each `get rollout`
    answers the next line of `states` (the last one repeats); every call is logged."""
    queue = tmp_path / "states"
    queue.write_text("\n".join(states) + "\n")
    (tmp_path / "report").write_text(report)
    bin_dir, log = fake_cluster(
        tmp_path,
        kubectl,
        f"""  *"get rollout lmops"*)
    head -n 1 {queue}
    [ "$(wc -l < {queue})" -gt 1 ] && sed -i 1d {queue}
    exit 0 ;;
  *"get analysisruns"*) cat {tmp_path / "report"} ;;
""",
    )
    return str(bin_dir), log


def deploy(tmp_path, kubectl, states, report="", **env):
    bin_dir, log = cluster(tmp_path, kubectl, states, report)
    proc = run_script("deploy.sh", path_prefix=bin_dir, CLOUD="aks", CANARY="true", ROLLOUT_POLL="0", **env)
    calls = [line.split(" --kubeconfig")[0] for line in log.read_text().splitlines()] if log.exists() else []
    return proc, calls


def test_promoted_canary_retires_the_old_deployment(tmp_path, kubectl):
    # The controller first reports the previous generation, then the canary steps.
    proc, calls = deploy(
        tmp_path, kubectl, ["3 2 Healthy", "3 3 Paused CanaryPauseStep", "3 3 Progressing", "3 3 Healthy"]
    )
    assert proc.returncode == 0, proc.stderr
    assert sum("get rollout lmops" in c for c in calls) == 4
    assert calls[-1] == "kubectl --namespace lmops delete deployment lmops --ignore-not-found"
    assert not any("patch rollout" in c for c in calls)
    assert "canary promoted" in proc.stderr


@pytest.mark.parametrize(
    ("states", "report", "says"),
    [
        pytest.param(
            ["2 2 Progressing", "2 2 Degraded RolloutAborted: Metric error-ratio assessed Failed"],
            REPORT_FAILED,
            ["error-ratio: Failed", "last value [0.31]"],
            id="analysis-fails",
        ),
        pytest.param(
            [
                "2 2 Progressing",
                '2 2 Degraded RolloutAborted: ProgressDeadlineExceeded: ReplicaSet "lmops-6f9c" timed out',
            ],
            "",
            ["ProgressDeadlineExceeded", "(no analysis run"],
            id="canary-never-ready",
        ),
        pytest.param(
            ["2 2 Progressing", "2 2 Degraded RolloutAborted: Metric ttft-p95 assessed Error"],
            REPORT_ERROR,
            ["no such host", "the analysis was inconclusive", "not promoting"],
            id="prometheus-unreachable",
        ),
        pytest.param(
            ["2 2 Paused InconclusiveAnalysisRun"],
            "analysis lmops-6f9c-2-1: Inconclusive Metric prompt-drift assessed Inconclusive",
            ["did not finish within 1s", "the analysis was inconclusive"],
            id="inconclusive-until-timeout",
        ),
    ],
)
def test_unpromoted_canary_is_aborted_and_fails(tmp_path, kubectl, states, report, says):
    # Only a rollout that never settles may meet the timeout (a slow box must not).
    timeout = "60s" if "Degraded" in states[-1] else "1s"
    proc, calls = deploy(tmp_path, kubectl, states, report, ROLLOUT_TIMEOUT=timeout)
    assert proc.returncode == 1, proc.stderr
    aborts = [c for c in calls if "patch rollout lmops" in c]
    assert aborts and '{"status":{"abort":true}}' in aborts[0] and "--subresource status" in aborts[0]
    assert any("wait rollout/lmops" in c and "Degraded" in c for c in calls)
    assert "the stable version keeps serving" in proc.stderr
    assert not any("delete deployment" in c for c in calls)
    for text in says:
        assert text in proc.stderr, f"missing `{text}` in:\n{proc.stderr}"


def test_rollout_timeout_must_be_a_duration(tmp_path, kubectl):
    proc, calls = deploy(tmp_path, kubectl, ["1 1 Healthy"], ROLLOUT_TIMEOUT="soon")
    assert proc.returncode == 1 and "not a duration: 'soon'" in proc.stderr
    assert calls == []  # stopped before touching the cluster


def test_argo_rollouts_kinds_are_validated_strictly(kubectl, tmp_path):
    """An unknown field, or a wrong type anywhere (the pod template included), is an
    error that says where."""
    docs = {d["kind"]: d for d in yaml.safe_load_all(render(kubectl, "eks/canary"))}
    rollout, template = docs["Rollout"], docs["AnalysisTemplate"]
    rollout["spec"]["strategy"]["canary"]["stepz"] = []
    template["spec"]["metrics"][0]["interval"] = 60  # a duration string
    broken = yaml.safe_load(yaml.safe_dump(rollout))
    del broken["spec"]["strategy"]["canary"]["stepz"]
    broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump_all([rollout, template, broken]))
    proc = validate(tmp_path / "bad.yaml")
    assert proc.returncode == 1 and proc.stdout.count("FAIL") == 3, proc.stdout
    assert "spec.strategy.canary: Additional properties are not allowed ('stepz'" in proc.stdout
    assert "spec.metrics.0.interval: 60 is not of type 'string'" in proc.stdout
    assert "spec.template.spec.containers.0.ports.0.containerPort: 'http' is not of type" in proc.stdout


def kubeflow_cluster(tmp_path: Path, kubectl: str, ready: bool, revisions: str) -> tuple[str, Path]:
    """A stand-in for the Kubeflow cluster: `wait` succeeds when `ready`, the
    InferenceService reports `revisions` (latest, previous); applied manifests are kept."""
    log = tmp_path / "calls.log"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl").write_text(f"""#!/bin/sh
[ "$1" = kustomize ] && exec {kubectl} "$@"
echo "kubectl $*" >> {log}
case "$*" in
  apply*) cp "$3" {tmp_path / "applied.yaml"} ;;
  *"wait inferenceservice/lmops"*) {"exit 0" if ready else "exit 1"} ;;
  *"get inferenceservice lmops --output"*) echo "{revisions}" ;;
esac
""")
    (bin_dir / "kubectl").chmod(0o755)
    return str(bin_dir), log


def kubeflow_deploy(
    tmp_path, kubectl, ready=True, revisions="lmops-predictor-00002 lmops-predictor-00001", **env
):
    bin_dir, log = kubeflow_cluster(tmp_path, kubectl, ready, revisions)
    env = {
        "CANARY": "1",
        "PROMETHEUS_URL": f"http://127.0.0.1:{free_port()}",
        "ANALYSIS_INTERVAL": "0",
        **env,
    }
    proc = run_script("kubeflow.sh", "deploy", path_prefix=bin_dir, **env)
    calls = log.read_text().splitlines() if log.exists() else []
    return proc, calls


def traffic(calls: list[str]) -> list[int]:
    """The canaryTrafficPercent values patched, in order."""
    return [
        int(re.search(r'"canaryTrafficPercent":(\d+)', c).group(1))
        for c in calls
        if "patch inferenceservice" in c
    ]


def test_kubeflow_canary_gets_its_share_and_a_never_ready_one_is_rolled_back(tmp_path, kubectl):
    proc, calls = kubeflow_deploy(tmp_path, kubectl, ready=False, CANARY_PERCENT="25")
    isvc = yaml.safe_load((tmp_path / "applied.yaml").read_text().split("\n---\n")[-1])
    assert isvc["kind"] == "InferenceService" and isvc["spec"]["predictor"]["canaryTrafficPercent"] == 25
    assert proc.returncode == 1 and "the previous revision keeps serving" in proc.stderr
    assert traffic(calls) == [0]
    assert "canary_analysis" not in proc.stderr  # nothing to analyse


def test_kubeflow_canary_without_prometheus_is_rolled_back(tmp_path, kubectl):
    """The analysis for real, against a Prometheus that is not there: inconclusive."""
    proc, calls = kubeflow_deploy(tmp_path, kubectl)
    assert proc.returncode == 1, proc.stderr
    assert traffic(calls) == [0]
    for text in (
        "did not answer",
        "analysis: Error",
        "the analysis was inconclusive",
        "not promoted: rolled back",
    ):
        assert text in proc.stdout + proc.stderr, text
    assert "lmops-predictor-00001 serves all traffic" in proc.stderr


def test_kubeflow_first_revision_needs_no_analysis(tmp_path, kubectl):
    proc, calls = kubeflow_deploy(tmp_path, kubectl, revisions="lmops-predictor-00001")
    assert proc.returncode == 0, proc.stderr
    assert traffic(calls) == [100] and "no previous revision" in proc.stderr


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PROMETHEUS_URL": ""}, "set PROMETHEUS_URL"),
        ({"CANARY_PERCENT": "100"}, "CANARY_PERCENT must be 1 to 99 (got '100')"),
    ],
)
def test_kubeflow_canary_settings_are_checked_first(tmp_path, kubectl, env, message):
    proc, calls = kubeflow_deploy(tmp_path, kubectl, **env)
    assert proc.returncode == 1 and message in proc.stderr and calls == []


def retrain(tmp_path: Path, promotion_after: str | None, promotion_before: str | None = None):
    """deploy/dvc.sh pull refresh repro push in a copy of the deploy scripts (so the
    workspace is tmp_path) with a stand-in dvc: `dvc repro` writes `promotion_after`."""
    shutil.copytree(REPO / "deploy", tmp_path / "deploy", ignore=shutil.ignore_patterns("__pycache__"))
    promotion = tmp_path / "artifacts" / "promotion.json"
    promotion.parent.mkdir()
    if promotion_before is not None:
        promotion.write_text(promotion_before)
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "new-champion").write_text("left by an earlier build")
    log = tmp_path / "calls.log"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write = f"printf '%s' '{promotion_after}' > {promotion}" if promotion_after is not None else ":"
    (bin_dir / "dvc").write_text(f"""#!/bin/sh
echo "dvc $*" >> {log}
[ "$*" = repro ] && {write}
exit 0
""")
    (bin_dir / "dvc").chmod(0o755)
    proc = subprocess.run(
        [str(tmp_path / "deploy" / "dvc.sh"), "pull", "refresh", "repro", "push"],
        capture_output=True,
        text=True,
        env=script_env(str(bin_dir)),
        timeout=60,
    )
    marker = tmp_path / "reports" / "new-champion"
    return proc, log.read_text().splitlines(), marker.read_text() if marker.exists() else None


NEW = '{"promoted": true, "version": 7, "reason": "beats v6"}'
OLD = '{"promoted": true, "version": 6, "reason": "beats v5"}'


def test_retraining_marks_a_new_champion_for_release(tmp_path):
    proc, calls, marker = retrain(tmp_path, NEW, OLD)
    assert proc.returncode == 0, proc.stderr
    assert calls == [
        "dvc stage list",
        "dvc pull --allow-missing",
        "dvc repro --force --single-item get_data",
        "dvc repro",
        "dvc push",
    ]
    assert marker is not None and '"version": 7' in marker and "new champion" in proc.stderr


@pytest.mark.parametrize(
    ("before", "after"),
    [
        pytest.param(OLD, None, id="data-unchanged-nothing-retrained"),
        pytest.param(OLD, '{"promoted": false, "version": 7, "reason": "worse than v6"}', id="not-better"),
    ],
)
def test_retraining_without_a_new_champion_releases_nothing(tmp_path, before, after):
    proc, _, marker = retrain(tmp_path, after, before)
    assert proc.returncode == 0, proc.stderr
    assert marker is None and "nothing to release" in proc.stderr


def test_a_champion_whose_image_does_not_build_is_not_released(tmp_path):
    """The build step fails (here: docker), so the Jenkins build stops before Push and
    Deploy (test_jenkinsfile checks that no step forgives a failure)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(
        "#!/bin/sh\necho 'failed to solve: process \"pip install\" exit code 1' >&2\nexit 1\n"
    )
    (bin_dir / "docker").chmod(0o755)
    proc = run_script("build_image.sh", path_prefix=str(bin_dir))
    assert proc.returncode != 0 and "failed to solve" in proc.stderr


def analysis_module():
    """deploy/canary_analysis.py (a script, not a package module)."""
    if "canary_analysis" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "canary_analysis", REPO / "deploy" / "canary_analysis.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules["canary_analysis"]


ARGS = {"canary-hash": "c1", "stable-hash": "s1", "namespace": "lmops"}


def test_analysis_judges_each_measurement_like_argo_rollouts():
    ca = analysis_module()
    metrics = {m.name: m for m in ca.load(ca.TEMPLATE, {**ARGS, "max-ttft-p95-ratio": "2"})}
    ttft = metrics["ttft-p95"]
    assert 'rollouts_pod_template_hash="c1"' in ttft.query and "{{" not in ttft.query
    assert ttft.success == "result[0] <= 2" and ttft.interval == 60 and ttft.count == 5
    assert [ca.judge(ttft, r) for r in ([1.9], [2.1], [math.nan], [])] == [
        "Successful",
        "Failed",
        "Inconclusive",  # nothing to compare
        "Error",  # no result at all
    ]
    with pytest.raises(SystemExit, match="needs --arg stable-hash"):
        ca.load(ca.TEMPLATE, {"canary-hash": "c1", "namespace": "lmops"})
    with pytest.raises(SystemExit, match="has no arg max-latency"):
        ca.load(ca.TEMPLATE, {**ARGS, "max-latency": "1"})


@pytest.mark.parametrize(
    ("phases", "decided"),
    [
        (["Successful"] * 5, "Successful"),
        (["Failed", "Successful", "Failed"], "Failed"),  # failureLimit 1
        (["Inconclusive", "Successful", "Inconclusive"], "Inconclusive"),  # inconclusiveLimit 1
        (["Error", "Successful", "Error", "Error", "Error"], "Error"),  # 3 in a row > 2
        (["Error", "Error", "Successful", "Error", "Successful"], "Successful"),
        (["Successful"] * 4 + ["Error"], "Error"),  # the last one must answer
    ],
)
def test_analysis_limits_decide_the_metric(phases, decided):
    ca = analysis_module()
    metric = next(m for m in ca.load(ca.TEMPLATE, ARGS) if m.name == "error-ratio")
    tally, outcome = ca.Tally(), None
    for phase in phases:
        assert outcome is None, "decided before its last measurement"
        outcome = tally.add(metric, phase)
    assert outcome == decided


def test_the_drift_alert_starts_the_retraining_job():
    """Alertmanager (its own amtool) accepts the config and routes the drift alert, with
    the labels rules.yml gives it, to the Jenkins remote trigger with RETRAIN=true; the
    credential comes from a file, never from the config."""
    amtool = tool("amtool")
    config = REPO / "deploy" / "monitoring" / "alertmanager.yml"
    check = subprocess.run([amtool, "check-config", str(config)], capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr
    rules = yaml.safe_load((REPO / "deploy" / "monitoring" / "rules.yml").read_text())
    (drift,) = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "LmopsPromptDrift"]
    labels = [
        f"{k}={v}" for k, v in {"alertname": "LmopsPromptDrift", "job": "lmops", **drift["labels"]}.items()
    ]
    routed = subprocess.run(
        [amtool, "config", "routes", "test", f"--config.file={config}", *labels],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert routed.returncode == 0 and routed.stdout.split()[0] == "retrain", routed.stdout + routed.stderr
    (receiver,) = [r for r in yaml.safe_load(config.read_text())["receivers"] if r["name"] == "retrain"]
    (hook,) = receiver["webhook_configs"]
    assert re.fullmatch(
        r"https?://[^?]+/job/[^?]+/buildWithParameters\?(.+&)?RETRAIN=true(&.+)?", hook["url"]
    )
    assert "token=" not in hook["url"] and "password" not in hook["http_config"]["basic_auth"]
    assert hook["http_config"]["basic_auth"]["password_file"].startswith("/etc/alertmanager/secrets/")
    assert hook["send_resolved"] is False
