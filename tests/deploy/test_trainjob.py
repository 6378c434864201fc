"""`lmops trainjob`, the KFP train step's launcher, against a stand-in for the Kubernetes API
server on 127.0.0.1 (a cluster we cannot reach): the real `kubernetes` client, pointed at it
by a kubeconfig, creates the TrainJob at Trainer v2's path and polls it; the stand-in's
"trainer" runs the TrainJob's own command (a fake torchrun in place of the real one) in a
temporary directory standing in for the shared /workspace volume, then reports how it ended."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import threading
from http.server import ThreadingHTTPServer

import pytest
import yaml

from deploy.validate import problems
from lmops.pipeline import cli
from tests.deploy.conftest import REPO, JsonStandIn

MANIFEST = REPO / "kubeflow" / "trainjob.yaml"
TEMPLATE = next(d for d in yaml.safe_load_all(MANIFEST.read_text()) if d["kind"] == "TrainJob")
NAMESPACE, IMAGE, TRACKING = "team", "registry.example/lmops:abc-pipeline", "http://mlflow.team:5000"
TRAINJOBS = f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{NAMESPACE}/trainjobs"
STAGED = ("params.yaml", "data/raw/manifest.json", "artifacts/data_report.json")
STAGED += ("data/processed/tokens/index.json", "artifacts/tokenizer/tokenizer.json")
# Stands in for torchrun in the TrainJob's pods: checks how it is called and what it finds in
# its working directory, then writes what `lmops train` writes.
FAKE_TORCHRUN = f"""#!/bin/sh
set -eu
test "$*" = "-m lmops.pipeline.cli train"
test "$MLFLOW_TRACKING_URI" = {TRACKING}
for f in {" ".join(STAGED)}; do test -f "$f"; done
mkdir -p artifacts/plots
echo step,loss > artifacts/plots/train_log.csv
echo step,loss > artifacts/plots/val_log.csv
cp -R "$TINY_MODEL" artifacts/model
"""


class StandInApi(JsonStandIn):
    """The TrainJob endpoints of an API server whose trainer runs each job's command at once;
    `server.outcome` says what it then reports: Complete (as the command ended), Failed, a
    job that never ends (Running), or a 403 for the create."""

    def do_POST(self):
        server = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server.calls.append(("POST", self.path))
        if self.path != TRAINJOBS:
            return self.answer(404, {"kind": "Status", "message": "the server could not find the resource"})
        if server.outcome == "forbidden":
            message = 'trainjobs.trainer.kubeflow.org is forbidden: User "x" cannot create resource'
            return self.answer(403, {"kind": "Status", "message": message})
        server.created = body
        trainer = body["spec"]["trainer"]
        env = {**os.environ, **{e["name"]: e["value"] for e in trainer["env"]}, **server.pod_env}
        server.ran = subprocess.run(  # where the runtime's pods start: the volume's root
            trainer["command"], cwd=server.volume, env=env, capture_output=True, text=True, timeout=30
        )
        self.answer(201, body)

    def do_GET(self):
        server = self.server
        server.calls.append(("GET", self.path))
        job = copy.deepcopy(server.created)
        job["status"] = {"jobsStatus": [{"name": "node", "active": 2, "ready": 2}]}
        server.polls += 1
        outcome = server.outcome
        if outcome == "Complete" and server.ran.returncode:
            outcome = "Failed"
        if server.polls > 1 and outcome in ("Complete", "Failed"):
            reason = "AllJobsCompleted" if outcome == "Complete" else "FailedJobs"
            job["status"] = {
                "conditions": [{"type": outcome, "status": "True", "reason": reason, "message": "x"}]
            }
        self.answer(200, job)

    def do_DELETE(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.calls.append(("DELETE", self.path))
        self.answer(200, {"kind": "Status", "status": "Success"})


@pytest.fixture(scope="module")
def api(tiny_model_dir, tmp_path_factory):
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandInApi)
    bin_dir = tmp_path_factory.mktemp("pod-bin")
    (bin_dir / "torchrun").write_text(FAKE_TORCHRUN)
    (bin_dir / "torchrun").chmod(0o755)
    server.pod_env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "TINY_MODEL": str(tiny_model_dir)}
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()


@pytest.fixture
def launch(api, tmp_path, monkeypatch, capsys):
    """Run `lmops trainjob` in a staged working directory, the stand-in reporting `outcome`:
    its exit status and output, the working directory and the stand-in volume."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{api.server_port}"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u", "namespace": NAMESPACE}}],
                "current-context": "c",
            }
        )
    )
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", TRACKING)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod
    work, volume = tmp_path / "work", tmp_path / "volume"
    for path in STAGED:
        (work / path).parent.mkdir(parents=True, exist_ok=True)
        (work / path).write_text("x")
    volume.mkdir()
    monkeypatch.chdir(work)

    def run(outcome: str, *extra: str):
        api.outcome, api.calls, api.polls, api.created, api.ran = outcome, [], 0, None, None
        api.volume = volume
        argv = ["trainjob", "--image", IMAGE, "--manifest", str(MANIFEST), "--workspace", str(volume)]
        rc = cli.main([*argv, "--poll", "0.01", *extra])
        out = capsys.readouterr()
        return rc, out.out, out.err, work, volume

    return run


def run_fields_dropped(job: dict) -> dict:
    """The TrainJob less what the launcher sets for each run."""
    job = copy.deepcopy(job)
    del job["metadata"]["name"], job["spec"]["activeDeadlineSeconds"]
    for field in ("image", "command", "env"):
        job["spec"]["trainer"].pop(field, None)
    return job


def test_dry_run_prints_the_manifests_trainjob_patched_for_one_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", TRACKING)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))  # no cluster to talk to
    volume = tmp_path / "volume"
    argv = [
        "trainjob",
        "--image",
        IMAGE,
        "--manifest",
        str(MANIFEST),
        "--workspace",
        str(volume),
        "--dry-run",
    ]
    assert cli.main(argv) == 0
    job = yaml.safe_load(capsys.readouterr().out)
    assert problems(job) == []  # strictly valid against Trainer v2.3.0's CRD
    assert run_fields_dropped(job) == run_fields_dropped(TEMPLATE)
    name, trainer = job["metadata"]["name"], job["spec"]["trainer"]
    assert re.fullmatch(r"lmops-train-\d{8}-\d{6}-[0-9a-f]{4}", name)  # a DNS label, fresh per run
    assert trainer["image"] == IMAGE
    assert trainer["env"] == [{"name": "MLFLOW_TRACKING_URI", "value": TRACKING}]
    run_dir = volume / "runs" / name
    assert trainer["command"] == [
        "sh",
        "-c",
        'cd "$0" && exec "$@"',
        str(run_dir),
        *TEMPLATE["spec"]["trainer"]["command"],
    ]
    assert job["spec"]["activeDeadlineSeconds"] == TEMPLATE["spec"]["activeDeadlineSeconds"]
    assert not volume.exists()  # nothing staged


def test_the_trainjob_runs_in_its_own_directory_and_the_model_comes_back(launch, api, tiny_model_dir):
    rc, out, err, work, volume = launch("Complete")
    assert rc == 0, err
    assert api.ran.returncode == 0, api.ran.stderr  # the pod found the staged inputs
    name = api.created["metadata"]["name"]
    assert api.created["spec"]["trainer"]["command"][3] == str(volume / "runs" / name)
    assert run_fields_dropped(api.created) == run_fields_dropped(TEMPLATE)
    assert [c[0] for c in api.calls] == ["POST", "GET", "GET", "DELETE"]
    assert api.calls[-1][1] == f"{TRAINJOBS}/{name}"
    for file in tiny_model_dir.rglob("*"):
        if file.is_file():
            assert (
                work / "artifacts/model" / file.relative_to(tiny_model_dir)
            ).read_bytes() == file.read_bytes()
    assert (work / "artifacts/plots/train_log.csv").read_text() == "step,loss\n"
    assert list((volume / "runs").iterdir()) == []  # the run's directory is gone
    assert f"trainjob {name}: Running (node: 2 active, 2 ready, 0 succeeded, 0 failed)\n" in out
    assert f"trainjob {name}: Complete (AllJobsCompleted: x)\n" in out


@pytest.mark.parametrize(
    ("outcome", "extra", "message", "kept"),
    [
        (
            "Failed",
            (),
            r"TrainJob {name} failed \(FailedJobs: x\); logs: kubectl -n team logs -l "
            r"jobset\.sigs\.k8s\.io/jobset-name={name}; kept for inspection",
            False,
        ),
        ("Running", ("--timeout", "1"), r"TrainJob {name} did not finish within 1 s .*; logs: kubectl", True),
        (
            "forbidden",
            (),
            r"creating TrainJob {name} in namespace team: HTTP 403: .* is forbidden: .* \(the "
            r"step's service account needs the RBAC of kubeflow/trainjob.yaml\)",
            False,
        ),
    ],
)
def test_a_failed_or_unfinished_trainjob_fails_the_step_in_one_line(
    launch, api, outcome, extra, message, kept
):
    rc, out, err, work, volume = launch(outcome, *extra)
    [name] = (
        [p.name for p in (volume / "runs").iterdir()] if kept else [re.search(r"lmops-train-[\w-]+", err)[0]]
    )
    assert rc == 1
    [line] = err.splitlines()
    assert re.fullmatch(f"lmops trainjob: error: {message.format(name=name)}.*", line), line
    assert not (work / "artifacts/model").exists()
    assert "DELETE" not in [c[0] for c in api.calls]  # left for inspection
    # the run's files stay only while its pods may still use them
    assert (volume / "runs" / name).exists() == kept
