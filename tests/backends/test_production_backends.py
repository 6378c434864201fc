"""The pipeline against production backends: `dvc repro` tracking to `mlflow server` on
PostgreSQL with its artifacts in an S3 bucket (moto), the service loading @champion through
that server, the faults a team meets in the first weeks, and DVC's remote on the same S3 API.

One pipeline run is shared by the module; the tests are steps of a story on it, in file order.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.entities import LoggedModelStatus

from lmops.crash_points import PAUSE_ENV
from lmops.runtime.model_dir import MODEL_FILES
from tests.backends.conftest import BUCKET, S3_KEYS
from tests.conftest import BIN, assert_pull_restores, env, make_project, run, write_params
from tests.service.conftest import start_server

pytestmark = pytest.mark.slow


def pipeline_env(backends, **extra: str) -> dict[str, str]:
    """What the pipeline gets: the tracking server's URL, no bucket credentials."""
    e = {**env(), "MLFLOW_TRACKING_URI": backends.tracking_uri, **extra}
    assert not {*S3_KEYS, "AWS_SESSION_TOKEN", "AWS_PROFILE", "MLFLOW_S3_ENDPOINT_URL"} & set(e)
    return e


# MLflow's REST client retries a server that does not answer for ~4 minutes by default.
NO_RETRIES = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}


def lmops(project: Path, backends, *args: str, check: bool = True, **extra: str):
    return run([str(BIN / "lmops"), *args], project, check=check, env=pipeline_env(backends, **extra))


def repro(project: Path, backends, **extra: str) -> subprocess.CompletedProcess:
    return run([str(BIN / "dvc"), "repro"], project, env=pipeline_env(backends, **extra))


def ran_stages(out: subprocess.CompletedProcess) -> list[str]:
    return [line.split("'")[1] for line in out.stdout.splitlines() if line.startswith("Running stage")]


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def project(backends, tokenized_project, tmp_path_factory):
    """A project run through `dvc repro` against the backends. The data stages, which never
    touch MLflow, are the session's tokenized project's, committed to dvc.lock as they are."""
    project = make_project(tmp_path_factory.mktemp("backends") / "repo")
    (project / "production_service/model").mkdir(parents=True)  # the empty skeleton template.py makes
    for rel in ("data", "artifacts"):
        shutil.copytree(tokenized_project / rel, project / rel, dirs_exist_ok=True)
    run([str(BIN / "dvc"), "commit", "-f", "-q", "get_data", "split", "tokenize"], project)
    shown = "default::DeprecationWarning,default::FutureWarning"  # Python hides most by default
    out = repro(project, backends, PYTHONWARNINGS=shown)
    assert ran_stages(out) == ["train", "evaluate", "promote"]
    # MLflow 3's API in our own calls (name=, LoggedModel): no deprecation pointing at lmops
    # (MLflow's and DVC's own internal ones are theirs).
    ours = re.findall(r"^.*/lmops/.*\.py:\d+: (?:Deprecation|Future)Warning.*$", out.stderr, re.M)
    assert not ours and "DeprecationWarning" in out.stderr, ours  # shown, none of them ours
    return project


def test_runs_registry_and_alias_live_in_postgres_and_the_model_in_the_bucket(project, backends):
    promotion = read_json(project / "artifacts/promotion.json")
    assert promotion["promoted"] and promotion["version"] == 1
    run_id, pg = promotion["run_id"], backends.postgres
    assert pg.query("SELECT value FROM params WHERE run_uuid = %s AND key = 'model.n_layer'", run_id) == [
        ("2",)
    ]
    steps = pg.query(
        "SELECT step FROM metrics WHERE run_uuid = %s AND key = 'loss/train' ORDER BY step", run_id
    )
    assert [s for (s,) in steps] == [5, 10, 15, 20]
    [(bpb,)] = pg.query(
        "SELECT value FROM metrics WHERE run_uuid = %s AND key = 'test_bits_per_byte'", run_id
    )
    assert bpb == pytest.approx(read_json(project / "artifacts/metrics.json")["test_bits_per_byte"])
    assert pg.query(
        "SELECT version FROM registered_model_aliases WHERE name = 'lmops' AND alias = 'champion'"
    ) == [(1,)]
    [(model_id, status)] = pg.query(
        "SELECT model_id, status FROM logged_models WHERE source_run_id = %s", run_id
    )
    assert LoggedModelStatus.from_int(status) == LoggedModelStatus.READY
    assert pg.query("SELECT source, run_id FROM model_versions WHERE name = 'lmops' AND version = 1") == [
        (f"models:/{model_id}", run_id)
    ]
    [(artifact_uri,)] = pg.query("SELECT artifact_uri FROM runs WHERE run_uuid = %s", run_id)
    assert artifact_uri.startswith("mlflow-artifacts:/")  # proxied: the server writes the bucket

    # The model's files, byte for byte (the ETag of a single-part upload is its MD5), in the bucket
    # under the logged model; the run's evaluation files under the run.
    keys = backends.bucket_keys("mlartifacts/")
    model = project / "artifacts/model"
    for name in MODEL_FILES:
        assert keys[f"mlartifacts/1/models/{model_id}/artifacts/artifacts/model/{name}"] == md5(model / name)
    assert {f"mlartifacts/1/{run_id}/artifacts/{f}" for f in ("samples.md", "metrics.json")} <= set(keys)
    assert not (project / "mlflow.db").exists() and not (project / "artifacts/mlruns").exists()


def test_the_service_loads_the_champion_through_the_tracking_server(project, backends, tmp_path):
    server = start_server(
        None,
        tmp_path / "server.log",
        LMOPS_MODEL_URI="models:/lmops@champion",
        LMOPS_MODEL_CACHE=str(tmp_path / "cache"),
        MLFLOW_TRACKING_URI=backends.tracking_uri,
    )
    try:
        with urllib.request.urlopen(f"{server.url}/v1/models", timeout=10) as resp:
            [card] = json.load(resp)["data"]
    finally:
        server.stop()
    assert (card["id"], card["version"], card["source"]) == ("lmops", "1", "models:/lmops@champion")
    served = project / "production_service/model"
    assert card["run_id"] == read_json(served / "lmops.json")["run_id"]
    [cached] = (tmp_path / "cache").glob("lmops-v1")
    assert md5(cached / "model.safetensors") == md5(served / "model.safetensors")


def paused(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def test_a_tracking_server_down_stops_training_with_a_checkpoint_and_a_stage_in_one_line(
    project, backends, tmp_path
):
    """Mid-training (the choice documented in README): a checkpoint and one line; the rerun
    resumes into the same MLflow run and logs what the server missed. At a stage's start: one
    line naming the server, nothing written."""
    uri = backends.tracking_uri
    # refused, or (a pooled connection the kill cut) closed without a response
    unreachable = re.compile(
        rf"MLflow tracking server {re.escape(uri)} is unreachable \((\[Errno 111\] Connection refused|"
        r"Remote end closed connection without response), after 0 retries\): start it, or point "
        "MLFLOW_TRACKING_URI at one"
    )
    copy = tmp_path / "copy"  # trains afresh, beside the module's project
    # checkpoints*: wsd keeps checkpoints-before-cooldown beside checkpoints
    shutil.copytree(project, copy, ignore=shutil.ignore_patterns("checkpoints*", ".git"))
    model_meta = (copy / "artifacts/model/lmops.json").read_bytes()
    train = subprocess.Popen(
        [str(BIN / "lmops"), "train"],
        cwd=copy,
        env=pipeline_env(backends, **NO_RETRIES, **{PAUSE_ENV: "train.step:7"}),
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not paused(train.pid):
        assert train.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    with backends.tracking_server_down():
        os.kill(train.pid, signal.SIGCONT)
        _, stderr = train.communicate(timeout=120)
        assert train.returncode == 1 and "Traceback" not in stderr, stderr
        last = stderr.strip().splitlines()[-1]
        assert last.startswith("lmops train: error: ") and unreachable.search(last), last
        assert last.endswith(
            "; training stopped at step 10 with a checkpoint in artifacts/checkpoints: "
            "run `lmops train` again to resume (into the same MLflow run)"
        )
        state = read_json(copy / "artifacts/checkpoints/state.json")
        assert (state["step"], state["tracked_rows"], len(state["history"])) == (10, 1, 2)
        assert (copy / "artifacts/model/lmops.json").read_bytes() == model_meta

        outputs = {p: p.read_bytes() for p in (project / "artifacts").glob("*.*") if p.is_file()}
        out = lmops(project, backends, "evaluate", check=False, **NO_RETRIES)
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
        last = out.stderr.strip().splitlines()[-1]
        assert last.startswith("lmops evaluate: error: ") and unreachable.search(last), last
        assert {p: p.read_bytes() for p in outputs} == outputs
    resumed = lmops(copy, backends, "train")
    assert "resuming from artifacts/checkpoints at step 10" in resumed.stderr
    run_id = read_json(copy / "artifacts/model/lmops.json")["run_id"]
    assert run_id == state["run_id"]
    pg = backends.postgres
    steps = pg.query(
        "SELECT step FROM metrics WHERE run_uuid = %s AND key = 'loss/train' ORDER BY step", run_id
    )
    assert [s for (s,) in steps] == [5, 10, 15, 20]  # no gap, nothing twice
    assert pg.query("SELECT status FROM runs WHERE run_uuid = %s", run_id) == [("FINISHED",)]
    assert pg.query("SELECT value FROM tags WHERE run_uuid = %s AND key = 'resumed_at_steps'", run_id) == [
        ("10",)
    ]


def test_postgres_restarted_between_stages_then_new_data_re_evaluates_the_champion(project, backends):
    backends.postgres.pg_ctl("restart")  # the tracking server's pooled connections are now dead
    write_params(project, {"split": {"seed": 99}, "train": {"max_steps": 4}}, base=project / "params.yaml")
    assert ran_stages(repro(project, backends)) == ["split", "tokenize", "train", "evaluate", "promote"]
    promotion = read_json(project / "artifacts/promotion.json")
    assert not promotion["promoted"] and promotion["version"] == 2 and promotion["champion_version"] == 1
    assert "scored on the current test units" in promotion["reason"]
    test_sha = read_json(project / "artifacts/metrics.json")["test_split_sha256"]
    tags = dict(
        backends.postgres.query(
            "SELECT key, value FROM model_version_tags WHERE name = 'lmops' AND version = 1"
        )
    )
    assert tags["test_split_sha256"] == test_sha
    assert float(tags["test_bits_per_byte"]) == pytest.approx(promotion["champion_bits_per_byte"])


def test_promote_force_moves_the_alias_in_postgres(project, backends):
    lmops(project, backends, "promote", "--force")
    assert backends.postgres.query(
        "SELECT version FROM registered_model_aliases WHERE name = 'lmops' AND alias = 'champion'"
    ) == [(2,)]
    assert read_json(project / "production_service/model/lmops.json")["model_version"] == 2
    assert read_json(project / "artifacts/promotion.json")["reason"].startswith("forced with --force")


def test_dvc_push_and_pull_through_the_s3_api(project, backends, tmp_path):
    dvc = str(BIN / "dvc")

    def use_remote(repo: Path) -> None:
        # The keys go to .dvc/config.local, which git does not carry.
        run([dvc, "remote", "modify", "--local", "s3", "access_key_id", S3_KEYS["AWS_ACCESS_KEY_ID"]], repo)
        run(
            [dvc, "remote", "modify", "--local", "s3", "secret_access_key", S3_KEYS["AWS_SECRET_ACCESS_KEY"]],
            repo,
        )

    run([dvc, "remote", "add", "-d", "s3", f"s3://{BUCKET}/dvc"], project)
    run([dvc, "remote", "modify", "s3", "endpointurl", backends.s3_endpoint], project)
    use_remote(project)
    run([dvc, "push"], project)
    assert backends.bucket_keys("dvc/files/md5/")
    run(["git", "add", "-A"], project)
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "outputs, S3 remote"], project)
    clone = tmp_path / "clone"
    run(["git", "clone", "-q", str(project), str(clone)], tmp_path)
    assert not (clone / "artifacts/model").exists()
    use_remote(clone)
    assert_pull_restores(clone, project, dvc)
