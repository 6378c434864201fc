"""Training killed and resumed (eager and compiled; with Muon, the default optimizer), and the
checkpoints it must not trust."""

from __future__ import annotations

import json
import signal

import pytest
import torch
import yaml

from lmops.crash_points import ENV as CRASH_AT
from tests.conftest import BIN, env, run
from tests.integration.training import copy_project, mlflow_run, val_losses, weights, with_dropout

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def eager(tokenized_project, tmp_path_factory):
    """One uninterrupted eager run with dropout: what a resumed run must reproduce, and what
    a compiled run must track."""
    project = with_dropout(copy_project(tokenized_project, tmp_path_factory.mktemp("eager") / "p"), False)
    run([str(BIN / "lmops"), "train"], project)
    return project


def test_sigkilled_training_resumes_to_the_same_weights(eager, tokenized_project, tmp_path):
    killed = with_dropout(copy_project(tokenized_project, tmp_path / "killed"), compile=False)
    crash = run([str(BIN / "lmops"), "train"], killed, check=False, env={**env(), CRASH_AT: "train.step:15"})
    assert crash.returncode == -signal.SIGKILL
    state = json.loads((killed / "artifacts/checkpoints/state.json").read_text())
    assert state["step"] == 10  # steps 11..15 were lost with the process
    assert not (killed / "artifacts/model").exists()

    resumed = run([str(BIN / "lmops"), "train"], killed)
    assert "resuming from artifacts/checkpoints at step 10" in resumed.stderr

    a, b = weights(eager), weights(killed)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=name)
    # The resumed run continues the same MLflow run and the same log.
    meta = json.loads((killed / "artifacts/model/lmops.json").read_text())
    assert meta["run_id"] == state["run_id"]
    steps = [
        int(r.split(",")[0]) for r in (killed / "artifacts/plots/train_log.csv").read_text().splitlines()[1:]
    ]
    assert steps == [5, 10, 15, 20]


def test_compiled_training_follows_eager_and_resumes_exactly(eager, tokenized_project, tmp_path):
    straight = with_dropout(copy_project(tokenized_project, tmp_path / "straight"), compile=True)
    out = run([str(BIN / "lmops"), "train"], straight, env={**env(), "TORCH_LOGS": "recompiles"})
    assert "compiled the training step in" in out.stderr
    # The step compiled up front is the one the steps run: a warm-up batch laid out unlike
    # the real ones (contiguous, not views of one (B, T + 1) tensor) compiled it all again.
    assert "Recompiling" not in out.stderr, out.stderr[-2000:]
    # Same math, other kernels: the compiled run's losses track the eager run's.
    for (step, a), (_, b) in zip(val_losses(eager).items(), val_losses(straight).items(), strict=True):
        assert b == pytest.approx(a, rel=0.02), step

    killed = with_dropout(copy_project(tokenized_project, tmp_path / "killed"), compile=True)
    crash = run([str(BIN / "lmops"), "train"], killed, check=False, env={**env(), CRASH_AT: "train.step:15"})
    assert crash.returncode == -signal.SIGKILL
    assert (
        "resuming from artifacts/checkpoints at step 10" in run([str(BIN / "lmops"), "train"], killed).stderr
    )
    a, b = weights(straight), weights(killed)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=name)
    run_id = json.loads((straight / "artifacts/model/lmops.json").read_text())["run_id"]
    assert mlflow_run(straight, run_id).data.params["compiled"] == "True"


def test_training_without_a_compiler_falls_back_to_eager(tokenized_project, tmp_path):
    project = with_dropout(copy_project(tokenized_project, tmp_path / "p"), compile=True)
    out = run([str(BIN / "lmops"), "train"], project, env={**env(), "CXX": "/nonexistent/g++"})
    assert "torch.compile unavailable, training eagerly" in out.stderr and "Traceback" not in out.stderr
    run_id = json.loads((project / "artifacts/model/lmops.json").read_text())["run_id"]
    assert mlflow_run(project, run_id).data.params["compiled"] == "False"


def test_changed_params_ignore_an_old_checkpoint(tokenized_project, tmp_path):
    """Even max_steps: under cosine it changes every step's learning rate after warmup."""
    project = copy_project(tokenized_project, tmp_path / "p")
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train"]["lr_schedule"] = "cosine"  # auto would choose wsd, which resumes here
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run([str(BIN / "lmops"), "train"], project, env={**env(), CRASH_AT: "train.step:12"}, check=False)
    text = (project / "params.yaml").read_text().replace("max_steps: 20", "max_steps: 12")
    (project / "params.yaml").write_text(text)
    out = run([str(BIN / "lmops"), "train"], project)
    assert "ignoring checkpoint" in out.stderr and "resuming" not in out.stderr


def test_corrupt_checkpoint_stops_with_a_clear_error(tokenized_project, tmp_path):
    project = copy_project(tokenized_project, tmp_path / "p")
    run([str(BIN / "lmops"), "train"], project, env={**env(), CRASH_AT: "train.step:10"}, check=False)
    weights = project / "artifacts/checkpoints/optimizer.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    out = run([str(BIN / "lmops"), "train"], project, check=False)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "optimizer.safetensors is corrupt or truncated" in out.stderr
    assert not (project / "artifacts/model").exists()
