"""Canary releases through deploy/deploy.sh (CANARY=true, Argo Rollouts), run for real
against a scripted stand-in for the cluster: a promoted canary, and the faults that
must end the release with the stable version serving and a non-zero exit: an analysis
that fails, a canary that never becomes ready, an analysis that cannot reach
Prometheus, an analysis stuck inconclusive. Rendering and validation are real."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy.conftest import run_script

REPORT_FAILED = """analysis lmops-6f9c-2-1: Failed Metric "error-ratio" assessed Failed due to failed (2) > failureLimit (1)
  error-ratio: Failed (2 measurements, 2 failed, 0 inconclusive, 0 errors) last value [0.31]
  ttft-p95: Running (2 measurements, 0 failed, 0 inconclusive, 0 errors) last value [1.02]"""
REPORT_ERROR = """analysis lmops-6f9c-2-1: Error Metric "ttft-p95" assessed Error due to consecutiveErrors (3) > consecutiveErrorLimit (2): "Error Message: Post "http://prometheus-operated.monitoring.svc:9090/api/v1/query": dial tcp: lookup prometheus-operated.monitoring.svc: no such host"
  ttft-p95: Error (3 measurements, 0 failed, 0 inconclusive, 3 errors) last value []"""


def cluster(tmp_path: Path, kubectl: str, states: list[str], report: str = "") -> tuple[str, Path]:
    """Stand-ins for az and kubectl (kustomize is the real one). Each `get rollout`
    answers the next line of `states` (the last one repeats); every call is logged."""
    log, queue = tmp_path / "calls.log", tmp_path / "states"
    queue.write_text("\n".join(states) + "\n")
    (tmp_path / "report").write_text(report)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "az").write_text(f'#!/bin/sh\necho "az $*" >> {log}\n')
    (bin_dir / "kubectl").write_text(f"""#!/bin/sh
[ "$1" = kustomize ] && exec {kubectl} "$@"
echo "kubectl $*" >> {log}
case "$*" in
  *"get rollout lmops"*)
    head -n 1 {queue}
    [ "$(wc -l < {queue})" -gt 1 ] && sed -i 1d {queue}
    exit 0 ;;
  *"get analysisruns"*) cat {tmp_path / "report"} ;;
esac
""")
    for fake in bin_dir.iterdir():
        fake.chmod(0o755)
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
                'Degraded RolloutAborted: ProgressDeadlineExceeded: ReplicaSet "lmops-6f9c" has timed out progressing.',
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
    if states[-1].startswith("Degraded"):  # "never ready": the controller's view, generation observed
        states[-1] = "2 2 " + states[-1]
    proc, calls = deploy(tmp_path, kubectl, states, report, ROLLOUT_TIMEOUT="1s")
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
