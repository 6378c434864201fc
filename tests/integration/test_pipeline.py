"""The whole pipeline through real `dvc repro`, real MLflow (sqlite) and a DVC remote.

One project is built once for the module; the tests are the steps of a user's
story on it and run in file order.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sqlite3
import stat
import subprocess
import time

import pytest
import requests
import torch

from lmops.crash_points import ENV as CRASH_AT
from lmops.pipeline.tokenize_stage import read_tokens
from lmops.runtime.model import Llama
from lmops.runtime.model_dir import MODEL_FILES
from tests.browser import colours, render, visible_text
from tests.conftest import BIN, REPO, assert_pull_restores, env, free_port, make_project, run, write_params

pytestmark = pytest.mark.slow
REPORTS = REPO / "reports"  # the browser tests' screenshots, for people to look at


def repro(project) -> str:
    return run([str(BIN / "dvc"), "repro"], project).stdout


def ran_stages(output: str) -> list[str]:
    return [line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage")]


def registry(project):
    from mlflow import MlflowClient

    return MlflowClient(
        tracking_uri=f"sqlite:///{project}/mlflow.db", registry_uri=f"sqlite:///{project}/mlflow.db"
    )


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    project = make_project(tmp_path_factory.mktemp("pipeline") / "repo")
    (project / "production_service/model").mkdir(parents=True)  # the empty skeleton template.py makes
    out = run([str(BIN / "dvc"), "repro"], project)
    assert ran_stages(out.stdout) == ["get_data", "split", "tokenize", "train", "evaluate", "promote"]
    assert "re-exporting" not in out.stderr  # an empty skeleton is no "unknown model" to replace
    # A log file's worth of output (stderr is no terminal here): no progress bars, no MLflow advice.
    for noise in ("step/s", "Downloading artifacts", "UserWarning", "\r"):
        assert noise not in out.stderr, f"{noise!r} in the pipeline's log:\n{out.stderr[-3000:]}"
    return project


def test_repro_produces_every_output(project):
    manifest = json.loads((project / "data/raw/manifest.json").read_text())
    assert manifest["source"].startswith("python-stdlib") and 0 < manifest["bytes"] <= 400_000
    for split in ("train", "val", "test"):
        assert len(read_tokens(project / "data/processed/tokens", split)) > 0
    metrics = json.loads((project / "artifacts/metrics.json").read_text())
    assert 0 < metrics["test_bits_per_byte"] < 12 and metrics["test_perplexity"] > 1
    assert "```python" in (project / "artifacts/samples.md").read_text()
    promotion = json.loads((project / "artifacts/promotion.json").read_text())
    assert promotion["promoted"] and promotion["reason"] == "no champion yet" and promotion["version"] == 1
    served = project / "production_service/model"
    assert all((served / f).is_file() for f in (*MODEL_FILES, "lmops.json"))
    meta = json.loads((served / "lmops.json").read_text())
    assert meta["model_version"] == 1 and meta["run_id"] == promotion["run_id"]
    assert meta["data_sha256"] == manifest["sha256"]
    log_rows = [r.split(",") for r in (project / "artifacts/plots/train_log.csv").read_text().splitlines()]
    assert log_rows[0][0] == "step" and len(log_rows) == 1 + 20 // 5
    mfu = [float(r[log_rows[0].index("mfu")]) for r in log_rows[1:]]
    assert all(0 < m <= 1 for m in mfu), mfu  # against the best matmul measured in the run
    val_rows = (project / "artifacts/plots/val_log.csv").read_text().splitlines()
    assert val_rows[0] == "step,tokens,val_loss" and [r.split(",")[0] for r in val_rows[1:]] == ["10", "20"]
    shown = run([str(BIN / "dvc"), "metrics", "show", "--json"], project).stdout
    assert "test_bits_per_byte" in shown
    # One readable table: the data report's headline numbers (not its ~40 nested fields), the
    # test's numbers and the gate's decision.
    columns = run([str(BIN / "dvc"), "metrics", "show"], project).stdout.splitlines()[0].split()
    data = json.loads((project / "artifacts/data_metrics.json").read_text())
    assert set(data) | {"test_bits_per_byte", "test_units", "promoted", "checks_failed"} <= set(columns)
    assert len(columns) < 24 and "document_bytes.p50" not in columns, columns
    run([str(BIN / "dvc"), "plots", "show", "-o", str(project / "plots-html")], project)
    assert (project / "plots-html/index.html").is_file()


def test_the_plots_page_draws_the_measured_curves_offline(project, tmp_path):
    """`dvc plots show`'s page (written by the test above) in a browser without internet:
    the five titled plots drawn, validation a line through its measured points only. The
    same page from DVC's own template (Vega from a CDN) draws nothing: the check can fail."""
    page = project / "plots-html/index.html"
    dom = render(page.as_uri(), REPORTS / "plots.png", height=1100)
    text = visible_text(dom)
    titles = (
        "Loss (validation",
        "Learning rate",
        "Training throughput",
        "Model FLOPs utilization",
        "per slice",
    )
    for title in titles:
        assert title in text, text[:2000]
    line = r'<path aria-label="[^"]*val_log\.csv::val_loss"[^>]*aria-roledescription="line mark"[^>]* d="([^"]+)"'
    val_line = re.search(line, dom)
    assert val_line, "no validation curve in the rendered page"
    assert val_line.group(1).count("L") + 1 == 2  # one vertex per evaluation (steps 10 and 20), no zeros
    assert colours(REPORTS / "plots.png") > 50

    from dvc_render.html import PAGE_HTML

    (tmp_path / "cdn.html").write_text(PAGE_HTML)
    cdn = tmp_path / "cdn"
    run(
        [str(BIN / "dvc"), "plots", "show", "--html-template", str(tmp_path / "cdn.html"), "-o", str(cdn)],
        project,
    )
    assert 'aria-roledescription="line mark"' not in render(
        (cdn / "index.html").as_uri(), tmp_path / "cdn.png"
    )


@contextlib.contextmanager
def mlflow_ui(project, port: int):
    """`make mlflow-ui`'s command on the project's tracking store, started now; the block
    waits for it with `ready()`."""
    cmd = [str(BIN / "mlflow"), "ui", "--backend-store-uri", f"sqlite:///{project}/mlflow.db"]
    proc = subprocess.Popen(
        [*cmd, "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        cwd=project,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its server and workers go with it
    )

    def ready() -> None:
        deadline = time.monotonic() + 90
        while not _answers(f"http://127.0.0.1:{port}/health"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"mlflow ui did not come up: {proc.stderr.read()[-3000:]}")
            time.sleep(0.3)

    try:
        yield ready
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=5).ok
    except requests.RequestException:  # not listening yet, or too busy starting to answer
        return False


def test_mlflow_ui_links_open_on_the_runs_and_the_models(project):
    """The links `lmops links` (`make mlflow-ui`) prints, in a fresh browser: the experiment's
    runs with the newest one listed and the Models and Model registry links, not MLflow's
    GenAI view (which a bare #/experiments/<id> opens in a browser MLflow has not seen)."""
    port = free_port()
    with mlflow_ui(project, port) as ready:
        printed = run([str(BIN / "lmops"), "links", "--url", f"http://127.0.0.1:{port}"], project).stdout
        promotion = json.loads((project / "artifacts/promotion.json").read_text())
        urls = re.findall(r"http://\S+", printed)
        assert len(urls) == 3 and urls[1].endswith(
            f"/runs/{promotion['run_id']}?workflowType=machine_learning"
        )
        assert urls[2] == f"http://127.0.0.1:{port}/#/models/lmops?workflowType=machine_learning"
        run_name = re.search(r"newest run (\S+):", printed).group(1)
        ready()
        dom = render(urls[0], REPORTS / "mlflow-ui.png")
        if "Something went wrong" in visible_text(dom):
            # The page's requests run on virtual time: on a host at load 7 one CI run saw a
            # request give up before a busy single-worker server answered, and the page show
            # its error boundary. A second load meets a warm server; a broken page fails twice.
            dom = render(urls[0], REPORTS / "mlflow-ui.png")
        run_page, query = urls[1].split("?")
        charts = visible_text(render(f"{run_page}/model-metrics?{query}", REPORTS / "mlflow-run-charts.png"))
    # the run's charts open on the section of the two loss curves, before MLflow's
    # alphabetical one (the charts themselves draw once scrolled into view)
    assert 0 <= charts.find("loss (2)") < charts.find("Model metrics ("), charts
    text = visible_text(dom)
    assert run_name in text and "1 matching run" in text, text[:2000]
    assert 'href="#/models"' in dom and "Model registry" in text  # the sidebar's registry link
    assert re.search(r'href="#/experiments/\d+/models\?', dom)  # and the experiment's Models
    assert "Training runs" not in text and "Token Usage" not in text  # GenAI's sidebar and overview
    assert colours(REPORTS / "mlflow-ui.png") > 50


def test_second_repro_does_nothing(project):
    assert ran_stages(repro(project)) == []
    assert "up to date" in run([str(BIN / "dvc"), "status"], project).stdout


def test_transformers_loads_the_promoted_model(project):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    served = project / "production_service/model"
    hf = AutoModelForCausalLM.from_pretrained(served, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(served)
    ids = torch.tensor([tok("def main():\n    return")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, Llama.from_pretrained(served)(ids)[0], atol=1e-4, rtol=0)


def test_int8_weights_cost_under_1pct_bits_per_byte(project):
    from lmops.pipeline.evaluate import score
    from lmops.runtime.quantize import quantize
    from lmops.runtime.tokenizer import chunks, load_tokenizer

    served = project / "production_service/model"
    text, tok = (project / "data/processed/test.txt").read_text(), load_tokenizer(served)
    fp32 = score(Llama.from_pretrained(served), tok, chunks(text))["bits_per_byte"]  # the whole test split
    int8 = score(quantize(Llama.from_pretrained(served), "int8"), tok, chunks(text))["bits_per_byte"]
    assert int8 != fp32 and abs(int8 / fp32 - 1) < 0.01, (fp32, int8)


def test_registry_champion_and_pyfunc(project, monkeypatch):
    import mlflow

    client = registry(project)
    champion = client.get_model_version_by_alias("lmops", "champion")
    promotion = json.loads((project / "artifacts/promotion.json").read_text())
    assert int(champion.version) == 1 and champion.run_id == promotion["run_id"]
    run_ = client.get_run(promotion["run_id"])
    assert (
        run_.data.tags["data_sha256"]
        == json.loads((project / "data/raw/manifest.json").read_text())["sha256"]
    )
    # the loss curves under loss/ (the UI's first section of charts), the rest by their names
    assert {"loss/train", "loss/val", "lr", "tokens_per_sec", "mfu", "test_bits_per_byte"} <= set(
        run_.data.metrics
    )
    assert run_.data.params["model.n_layer"] == "2"
    # params.yaml's `auto`s: the run logs what trained, and what chose it
    logged = run_.data.params
    assert logged["auto.train.lr_schedule"] == logged["train.lr_schedule"] == "wsd"  # a twentieth of a pass
    assert logged["auto.model.dropout"] == logged["model.dropout"] == "0.0"
    assert logged["auto.train.weight_decay"] == logged["train.weight_decay"] == "0.1"
    assert 0 < float(logged["epochs"]) < 1 and 0 < float(logged["tokens_per_parameter"]) < 1
    # evaluate logs its test numbers only: the validation curve has no stray point at step 0
    assert all(m.step > 0 for m in client.get_metric_history(run_.info.run_id, "loss/val"))
    # the UI opens the experiment on its runs and models, not on the GenAI traces view
    experiment = client.get_experiment(run_.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{project}/mlflow.db")  # not global state
    model = mlflow.pyfunc.load_model("models:/lmops@champion")
    out = model.predict(["def ", "import "], params={"max_tokens": 5, "temperature": 0.0})
    from lmops.runtime.engine import LLMEngine, SamplingParams

    engine = LLMEngine.from_pretrained(project / "production_service/model")
    greedy = engine.generate(["def ", "import "], SamplingParams(max_tokens=5, temperature=0.0))
    assert out == [o.text for o in greedy]
    assert all(len(o.token_ids) <= 5 for o in greedy)


def test_param_change_reruns_only_train_onwards_and_a_worse_model_is_not_promoted(project):
    write_params(project, {"train": {"max_steps": 4}}, base=project / "params.yaml")
    assert ran_stages(repro(project)) == ["train", "evaluate", "promote"]
    promotion = json.loads((project / "artifacts/promotion.json").read_text())
    assert not promotion["promoted"] and promotion["version"] == 2 and promotion["champion_version"] == 1
    assert promotion["candidate_bits_per_byte"] > promotion["champion_bits_per_byte"]
    assert "measured on the same test units" in promotion["reason"]
    client = registry(project)
    assert int(client.get_model_version_by_alias("lmops", "champion").version) == 1
    assert client.get_model_version("lmops", "2").tags["promotion"] == promotion["reason"]
    assert json.loads((project / "production_service/model/lmops.json").read_text())["model_version"] == 1

    run([str(BIN / "lmops"), "promote", "--force"], project)
    # --force promotes the same registered version; it does not register the run twice.
    assert int(registry(project).get_model_version_by_alias("lmops", "champion").version) == 2
    assert json.loads((project / "production_service/model/lmops.json").read_text())["model_version"] == 2
    assert json.loads((project / "artifacts/promotion.json").read_text())["reason"].startswith(
        "forced with --force"
    )


def test_new_data_re_evaluates_the_champion(project):
    write_params(project, {"split": {"seed": 99}}, base=project / "params.yaml")
    assert ran_stages(repro(project))[0] == "split"
    promotion = json.loads((project / "artifacts/promotion.json").read_text())
    assert "scored on the current test units" in promotion["reason"]
    assert promotion["champion_trained_on_other_data"] is False  # a new split of the same corpus
    tags = registry(project).get_model_version("lmops", str(promotion["champion_version"])).tags
    assert (
        tags["test_split_sha256"]
        == json.loads((project / "artifacts/metrics.json").read_text())["test_split_sha256"]
    )


def served_meta(project) -> dict:
    return json.loads((project / "production_service/model/lmops.json").read_text())


def test_a_promotion_killed_after_the_alias_moved_is_recovered(project):
    write_params(project, {"train": {"max_steps": 20}}, base=project / "params.yaml")  # beats 4 steps
    held = served_meta(project)["model_version"]
    crash = run(
        [str(BIN / "dvc"), "repro"], project, check=False, env={**env(), CRASH_AT: "promote.alias_moved"}
    )
    assert crash.returncode != 0
    champion = registry(project).get_model_version_by_alias("lmops", "champion")
    assert int(champion.version) != held and served_meta(project)["model_version"] == held  # apart

    out = run([str(BIN / "dvc"), "repro"], project)  # the stage never finished: it runs again
    assert ran_stages(out.stdout) == ["promote"]
    assert f"holds lmops v{held}, not @champion v{champion.version}: re-exporting" in out.stderr
    promotion = json.loads((project / "artifacts/promotion.json").read_text())
    assert not promotion["promoted"] and promotion["reason"] == f"v{champion.version} is already @champion"
    # the rerun keeps the evidence that made it champion (the card renders it)
    tags = registry(project).get_model_version("lmops", champion.version).tags
    assert json.loads(tags["promotion_evidence"])["promoted"] is True
    meta = served_meta(project)
    assert meta["model_version"] == int(champion.version) and meta["run_id"] == champion.run_id
    # The promoted model's test bits/byte (the drift reference) travels with it.
    assert meta["metrics"]["test_bits_per_byte"] == promotion["candidate_bits_per_byte"]
    assert ran_stages(repro(project)) == []


def test_promote_restores_a_missing_export_from_the_registry(project):
    served, candidate, aside = (
        project / "production_service/model",
        project / "artifacts/model",
        project / "model-aside",
    )
    shutil.rmtree(served)
    candidate.rename(aside)  # the champion must come from the registry, not the working tree
    try:
        out = run([str(BIN / "lmops"), "promote"], project, check=False)
    finally:
        aside.rename(candidate)
    assert out.returncode == 1 and "missing lmops.json" in out.stderr.splitlines()[-1]  # no candidate...
    champion = registry(project).get_model_version_by_alias("lmops", "champion")
    meta = served_meta(project)  # ...but the reconciliation ran first
    assert meta["model_version"] == int(champion.version) and meta["run_id"] == champion.run_id
    assert meta["metrics"]["test_bits_per_byte"] == float(champion.tags["test_bits_per_byte"])
    assert stat.S_IMODE(served.stat().st_mode) == 0o755
    assert {stat.S_IMODE(f.stat().st_mode) for f in served.iterdir() if not f.name.startswith(".")} == {0o644}
    for name in MODEL_FILES:
        assert (served / name).read_bytes() == (candidate / name).read_bytes()


def registry_state(project) -> tuple:
    client = registry(project)
    versions = client.search_model_versions("name = 'lmops'")
    return (
        client.get_model_version_by_alias("lmops", "champion").version,
        sorted((v.version, tuple(sorted(v.tags.items()))) for v in versions),
        (project / "production_service/model/lmops.json").read_bytes(),
        (project / "artifacts/promotion.json").read_bytes(),
    )


def lock(project, how: str) -> sqlite3.Connection:
    """Hold a real sqlite lock on mlflow.db, as another writer would."""
    conn = sqlite3.connect(project / "mlflow.db", isolation_level=None, check_same_thread=False)
    conn.execute(f"BEGIN {how}")
    return conn


def test_a_locked_tracking_store_is_one_clear_line_and_changes_nothing(project):
    before = registry_state(project)
    conn = lock(project, "IMMEDIATE")  # reads go through, the first write waits and fails
    try:
        started = time.monotonic()
        # --force: a new "promotion" tag to write (a promote with nothing to change needs no write).
        out = run([str(BIN / "lmops"), "promote", "--force"], project, check=False)
        waited = time.monotonic() - started
    finally:
        conn.rollback()
        conn.close()
    assert out.returncode == 1 and "Traceback" not in out.stderr and "[SQL:" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("lmops promote: error: MLflow tracking store sqlite:///mlflow.db is locked")
    assert waited > 20  # MLflow's busy timeout retried first
    assert registry_state(project) == before


def test_a_brief_lock_is_waited_out(project):
    conn = lock(project, "EXCLUSIVE")  # even reads wait
    try:
        proc = subprocess.Popen(
            [str(BIN / "lmops"), "promote"], cwd=project, env=env(), stderr=subprocess.PIPE, text=True
        )
        db = os.path.realpath(project / "mlflow.db")
        deadline = time.monotonic() + 120
        while db not in _open_files(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        time.sleep(2)  # promote is now waiting on the lock
    finally:
        conn.rollback()
        conn.close()
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert "is already @champion" in stderr


def _open_files(pid: int) -> set[str]:
    """The files `pid` has open now; a descriptor closed while we look is skipped."""
    found = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:
        return found
    for fd in fds:
        with contextlib.suppress(OSError):
            found.add(os.path.realpath(f"/proc/{pid}/fd/{fd}", strict=True))
    return found


def test_push_and_pull_through_a_local_remote(project, tmp_path):
    remote = tmp_path / "remote"
    dvc = str(BIN / "dvc")
    run([dvc, "remote", "add", "-d", "local", str(remote)], project)
    run([dvc, "push"], project)
    run(["git", "add", "-A"], project)
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "pipeline outputs"], project)
    clone = tmp_path / "clone"
    run(["git", "clone", "-q", str(project), str(clone)], tmp_path)
    assert not (clone / "artifacts/model").exists()
    assert_pull_restores(clone, project, dvc)
    shutil.rmtree(clone)
