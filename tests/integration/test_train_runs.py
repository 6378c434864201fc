"""Training as users run it: killed and resumed, and under torchrun with 2 processes."""

from __future__ import annotations

import json
import shutil
import signal

import pytest
import torch
from safetensors.torch import load_file

from lmops.train import FAULT_ENV
from tests.conftest import BIN, env, run

pytestmark = pytest.mark.slow


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _weights(project):
    return load_file(str(project / "artifacts/model/model.safetensors"))


def test_sigkilled_training_resumes_to_the_same_weights(tokenized_project, tmp_path):
    straight = _copy(tokenized_project, tmp_path / "straight")
    run([str(BIN / "lmops"), "train"], straight)

    killed = _copy(tokenized_project, tmp_path / "killed")
    crash = run([str(BIN / "lmops"), "train"], killed, check=False, env={**env(), FAULT_ENV: "15"})
    assert crash.returncode == -signal.SIGKILL
    state = json.loads((killed / "artifacts/checkpoints/state.json").read_text())
    assert state["step"] == 10  # steps 11..15 were lost with the process
    assert not (killed / "artifacts/model").exists()

    resumed = run([str(BIN / "lmops"), "train"], killed)
    assert "resuming from artifacts/checkpoints at step 10" in resumed.stderr

    a, b = _weights(straight), _weights(killed)
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


def test_changed_params_ignore_an_old_checkpoint(tokenized_project, tmp_path):
    project = _copy(tokenized_project, tmp_path / "p")
    run([str(BIN / "lmops"), "train"], project, env={**env(), FAULT_ENV: "12"}, check=False)
    text = (project / "params.yaml").read_text().replace("max_steps: 20", "max_steps: 12")
    (project / "params.yaml").write_text(text)
    out = run([str(BIN / "lmops"), "train"], project)
    assert "ignoring checkpoint" in out.stderr and "resuming" not in out.stderr


def test_corrupt_checkpoint_stops_with_a_clear_error(tokenized_project, tmp_path):
    project = _copy(tokenized_project, tmp_path / "p")
    run([str(BIN / "lmops"), "train"], project, env={**env(), FAULT_ENV: "10"}, check=False)
    weights = project / "artifacts/checkpoints/optimizer.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    out = run([str(BIN / "lmops"), "train"], project, check=False)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "optimizer.safetensors is corrupt or truncated" in out.stderr
    assert not (project / "artifacts/model").exists()


def test_ddp_with_two_processes_on_cpu(tokenized_project, tmp_path):
    project = _copy(tokenized_project, tmp_path / "ddp")
    run(
        [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", "-m", "lmops.cli", "train"],
        project,
        timeout=400,
    )
    meta = json.loads((project / "artifacts/model/lmops.json").read_text())
    from mlflow import MlflowClient

    params = MlflowClient(tracking_uri=f"sqlite:///{project}/mlflow.db").get_run(meta["run_id"]).data.params
    assert params["world_size"] == "2"
    assert meta["metrics"]["tokens"] == 2 * 20 * 8 * 64  # both ranks' batches counted
    from lmops.model import Llama

    Llama.from_pretrained(project / "artifacts/model")  # a complete, loadable model
