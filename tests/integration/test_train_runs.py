"""Training as users run it: under torchrun with 2 processes, keeping the best weights,
stopping early, on a plateau schedule (killed and resumed too), with Muon and wsd trained
longer. The plain resume and checkpoint tests are in test_train_resume.py."""

from __future__ import annotations

import hashlib
import json
import signal

import numpy as np
import pytest
import torch
import yaml

from lmops.crash_points import ENV as CRASH_AT
from tests.conftest import BIN, env, run
from tests.integration.training import copy_project, mlflow_run, val_losses, weights, with_dropout

pytestmark = pytest.mark.slow


def test_ddp_with_two_processes_on_cpu(tokenized_project, tmp_path):
    """With Muon: the DDP path is the optimizer's either way, and Muon's is the one with more
    to share (both optimizers' steps on the all-reduced gradients)."""
    project = copy_project(tokenized_project, tmp_path / "ddp")
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train"]["optimizer"] = "muon"
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run(
        [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", "-m", "lmops.pipeline.cli", "train"],
        project,
        timeout=400,
    )
    meta = json.loads((project / "artifacts/model/lmops.json").read_text())
    from mlflow import MlflowClient

    params = MlflowClient(tracking_uri=f"sqlite:///{project}/mlflow.db").get_run(meta["run_id"]).data.params
    assert params["world_size"] == "2" and params["train.optimizer"] == "muon"
    assert meta["metrics"]["tokens"] == 2 * 20 * 8 * 64  # both ranks' batches counted
    from lmops.runtime.model import Llama

    Llama.from_pretrained(project / "artifacts/model")  # a complete, loadable model


def replace_tokens(tokens_dir, split, ids) -> None:
    """Make `split`'s token files one shard holding `ids` (its index entry too)."""
    index = json.loads((tokens_dir / "index.json").read_text())
    for shard in index["splits"][split]["shards"]:
        (tokens_dir / shard["file"]).unlink()
    ids.tofile(tokens_dir / f"{split}-000-00000.bin")
    digest = hashlib.sha256(ids.tobytes()).hexdigest()
    index["splits"][split] = {
        "tokens": len(ids),
        "shards": [{"file": f"{split}-000-00000.bin", "tokens": len(ids), "sha256": digest}],
    }
    (tokens_dir / "index.json").write_text(json.dumps(index))


def _overfitting_project(tokenized_project, dst, train_overrides):
    """A project whose validation loss falls, then rises: train and val follow different rules.

    Both splits use the same 16 tokens, so learning their frequencies helps on both; the
    next-token rule differs (two permutations), so learning train's rule hurts on val.
    """
    project = copy_project(tokenized_project, dst)
    rng = np.random.default_rng(0)
    symbols = np.arange(100, 116)
    for split, seed in (("train", 1), ("val", 2)):
        follow = dict(zip(symbols, np.random.default_rng(seed).permutation(symbols), strict=True))
        tokens = [int(rng.choice(symbols))]
        for _ in range(20_000):  # the rule, with 10% noise so the split is not one short cycle
            tokens.append(int(rng.choice(symbols)) if rng.random() < 0.1 else int(follow[tokens[-1]]))
        replace_tokens(project / "data/processed/tokens", split, np.asarray(tokens, dtype=np.uint16))
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["model"]["dropout"] = 0.1
    params["train"].update(
        {
            "max_steps": 30,
            "optimizer": "adamw",  # with the next line: val is lowest near step 8, then rises for good
            "learning_rate": 1.0e-2,
            "eval_interval": 2,
            "checkpoint_interval": 10,
            "log_interval": 2,
            **train_overrides,
        }
    )
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return project


def test_keep_best_exports_the_lowest_validation_loss_and_survives_sigkill(tokenized_project, tmp_path):
    straight = _overfitting_project(tokenized_project, tmp_path / "straight", {})
    run([str(BIN / "lmops"), "train"], straight)
    val = val_losses(straight)
    best_step = min(val, key=val.get)
    assert best_step < 20 and val[30] > val[best_step] + 0.1, val  # validation rose again at the end

    meta = json.loads((straight / "artifacts/model/lmops.json").read_text())
    assert meta["metrics"]["best_step"] == meta["metrics"]["exported_step"] == best_step
    assert meta["metrics"]["val_loss"] == pytest.approx(val[best_step], rel=1e-5)
    assert meta["metrics"]["steps"] == 30 and meta["stop_reason"] == "reached max_steps (30)"
    assert mlflow_run(straight, meta["run_id"]).data.metrics["best_step"] == best_step
    # The exported weights are the best ones: they score the best validation loss again.
    from lmops.pipeline.params import load_params
    from lmops.pipeline.tokenize_stage import read_tokens
    from lmops.pipeline.train import estimate_val_loss
    from lmops.runtime.model import Llama

    cfg = load_params(straight / "params.yaml").train
    tokens = read_tokens(straight / "data/processed/tokens", "val")
    exported = Llama.from_pretrained(straight / "artifacts/model")
    assert estimate_val_loss(exported, tokens, cfg, 64, torch.device("cpu")) == pytest.approx(
        val[best_step], abs=1e-5
    )

    # Killed after the best step and after a checkpoint: the best weights come from the checkpoint.
    killed = _overfitting_project(tokenized_project, tmp_path / "killed", {})
    crash = run([str(BIN / "lmops"), "train"], killed, check=False, env={**env(), CRASH_AT: "train.step:25"})
    assert crash.returncode == -signal.SIGKILL
    assert (
        "resuming from artifacts/checkpoints at step 20" in run([str(BIN / "lmops"), "train"], killed).stderr
    )
    assert json.loads((killed / "artifacts/model/lmops.json").read_text())["metrics"] == meta["metrics"]
    a, b = weights(straight), weights(killed)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=name)


def test_early_stopping_stops_and_says_why(tokenized_project, tmp_path):
    project = _overfitting_project(tokenized_project, tmp_path / "p", {"early_stopping_patience": 3})
    out = run([str(BIN / "lmops"), "train"], project)
    val = val_losses(project)
    best_step, last_step = min(val, key=val.get), max(val)
    assert last_step == best_step + 3 * 2 < 30  # three evaluations (every 2 steps) without improvement
    reason = f"early stopping at step {last_step}: validation loss did not improve for 3 evaluations"
    assert reason in out.stderr
    meta = json.loads((project / "artifacts/model/lmops.json").read_text())
    assert meta["stop_reason"].startswith(reason) and meta["metrics"]["steps"] == last_step
    assert meta["metrics"]["best_step"] == best_step
    assert mlflow_run(project, meta["run_id"]).data.tags["stop_reason"] == meta["stop_reason"]
    # Run again: the finished (stopped) checkpoint is not trained further.
    again = run([str(BIN / "lmops"), "train"], project)
    assert f"resuming from artifacts/checkpoints at step {last_step}" in again.stderr
    assert max(val_losses(project)) == last_step


def _history(project, keys=("step", "tokens", "train_loss", "val_loss", "lr")):
    """The run's logged rows without their timings (which differ between runs)."""
    state = json.loads((project / "artifacts/checkpoints/state.json").read_text())
    return [{k: row.get(k) for k in keys} for row in state["history"]]


def test_a_longer_plateau_run_is_the_shorter_one_continued(tokenized_project, tmp_path):
    """Under lr_schedule: plateau nothing depends on max_steps, so a run twice as long passes
    through every state of the shorter one and, keeping the best, cannot export a worse model."""
    # Eager: four compiles would cost about 50 s; compiled steps are shown bitwise reproducible
    # in tests/unit/test_train.py and resuming exactly in test_train_resume.py.
    plateau = {"lr_schedule": "plateau", "lr_plateau_patience": 1, "compile": False}
    short = _overfitting_project(tokenized_project, tmp_path / "short", {**plateau, "max_steps": 14})
    out = run([str(BIN / "lmops"), "train"], short)
    assert "plateau: validation loss did not improve for 1 evaluations; learning rate now 0.005" in out.stderr
    longer = _overfitting_project(tokenized_project, tmp_path / "longer", {**plateau, "max_steps": 28})
    run([str(BIN / "lmops"), "train"], longer)

    short_rows, longer_rows = _history(short), _history(longer)
    assert longer_rows[: len(short_rows)] == short_rows
    lrs = [r["lr"] for r in longer_rows if r["step"] > 4]  # after warmup
    assert lrs[0] == 1.0e-2 and lrs[-1] < lrs[0] / 8, lrs  # validation stalled: cut again and again
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))
    short_meta, longer_meta = (
        json.loads((p / "artifacts/model/lmops.json").read_text()) for p in (short, longer)
    )
    assert longer_meta["metrics"]["val_loss"] <= short_meta["metrics"]["val_loss"]

    # Killed after cuts and a checkpoint: the resumed run makes the same cuts, ends the same.
    killed = _overfitting_project(tokenized_project, tmp_path / "killed", {**plateau, "max_steps": 28})
    crash = run([str(BIN / "lmops"), "train"], killed, check=False, env={**env(), CRASH_AT: "train.step:25"})
    assert crash.returncode == -signal.SIGKILL
    assert (
        "resuming from artifacts/checkpoints at step 20" in run([str(BIN / "lmops"), "train"], killed).stderr
    )
    assert _history(killed) == longer_rows
    a, b = weights(longer), weights(killed)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=name)


def _muon_wsd_project(tokenized_project, dst, max_steps):
    project = with_dropout(copy_project(tokenized_project, dst), compile=False)
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train"].update(optimizer="muon", lr_schedule="wsd", cooldown_fraction=0.25, max_steps=max_steps)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return project


def test_a_finished_muon_wsd_run_trains_longer_from_its_cooldown_and_ends_as_the_longer_run(
    tokenized_project, tmp_path
):
    """Muon's state and wsd's plan resume exactly: a 20-step run (cooldown from step 15), then
    max_steps raised to 28, ends with the weights and rows of a run planned for 28 steps."""
    longer = _muon_wsd_project(tokenized_project, tmp_path / "longer", 28)
    run([str(BIN / "lmops"), "train"], longer)
    project = _muon_wsd_project(tokenized_project, tmp_path / "p", 20)
    run([str(BIN / "lmops"), "train"], project)
    short_run = json.loads((project / "artifacts/model/lmops.json").read_text())["run_id"]
    text = (project / "params.yaml").read_text().replace("max_steps: 20", "max_steps: 28")
    (project / "params.yaml").write_text(text)

    out = run([str(BIN / "lmops"), "train"], project).stderr
    assert "ignoring checkpoint in artifacts/checkpoints: step 20 of a 20-step wsd run" in out
    assert "resuming from artifacts/checkpoints-before-cooldown at step 15" in out
    assert _history(project) == _history(longer)
    a, b = weights(longer), weights(project)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # A new MLflow run with every row from the first step; the 20-step run keeps its own.
    meta = json.loads((project / "artifacts/model/lmops.json").read_text())
    assert meta["run_id"] != short_run and meta["metrics"]["steps"] == 28
    continued = mlflow_run(project, meta["run_id"])
    assert continued.data.tags["continued_from"] == f"{short_run} at step 15"
    assert (
        continued.data.params["train.optimizer"] == "muon"
        and continued.data.params["train.max_steps"] == "28"
    )
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{project}/mlflow.db")
    assert [m.step for m in client.get_metric_history(meta["run_id"], "loss/val")] == [10, 20, 28]
    assert mlflow_run(project, short_run).data.params["train.max_steps"] == "20"
    # The optimizer leaves the architecture alone: transformers loads the export unchanged.
    from transformers import AutoModelForCausalLM

    from lmops.runtime.model import Llama

    x = torch.arange(1, 17)[None]
    hf = AutoModelForCausalLM.from_pretrained(project / "artifacts/model").eval()
    with torch.no_grad():
        ours = Llama.from_pretrained(project / "artifacts/model")(x)[0]
        torch.testing.assert_close(hf(x).logits, ours, atol=1e-4, rtol=1e-4)
