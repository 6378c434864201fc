"""The Kubeflow pipeline: the committed YAML is what pipeline.py compiles to, its
steps are the DVC stages with the same inputs and outputs, and the shell each step
runs moves artifacts in and out around `lmops <stage>` as intended."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from types import SimpleNamespace

import pytest
import yaml

from lmops.runtime.engine.config import EngineConfig
from production_service.settings import ServiceConfig
from tests.deploy.conftest import BIN, REPO
from tests.deploy.test_kubernetes import validate

PIPELINE = REPO / "kubeflow" / "pipeline.yaml"
SWEEP = REPO / "kubeflow" / "sweep.yaml"


def load_pipeline(path=PIPELINE) -> tuple[dict, dict]:
    """The compiled pipeline spec and its Kubernetes platform spec (empty without one)."""
    spec, *platform = yaml.safe_load_all(path.read_text())
    return spec, (platform[0]["platforms"]["kubernetes"] if platform else {})


def compile_pipeline(output, *extra: str) -> None:
    subprocess.run(
        [str(BIN / "python"), "kubeflow/pipeline.py", "compile", "--output", str(output), *extra],
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=120,
    )


def pipeline_module():
    """kubeflow/pipeline.py, a script, as a module."""
    spec = importlib.util.spec_from_file_location("pipeline", REPO / "kubeflow" / "pipeline.py")
    pipeline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pipeline)
    return pipeline


def run_stage(args: list[str], bin_dir, app) -> subprocess.CompletedProcess:
    """The steps' shell on `args`, with the `lmops` of `bin_dir` and `app` for the image's /app."""
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "LMOPS_APP": str(app)}
    return subprocess.run(
        ["sh", "-c", pipeline_module().RUN_STAGE, "run_stage", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_committed_pipeline_yaml_is_up_to_date(tmp_path):
    compile_pipeline(tmp_path / "pipeline.yaml")
    assert (tmp_path / "pipeline.yaml").read_text() == PIPELINE.read_text(), (
        "kubeflow/pipeline.yaml is stale: run `make kfp-compile` and commit it"
    )


def test_committed_sweep_yaml_is_up_to_date(tmp_path):
    compile_pipeline(tmp_path / "sweep.yaml", "--sweep")
    assert (tmp_path / "sweep.yaml").read_text() == SWEEP.read_text(), (
        "kubeflow/sweep.yaml is stale: run `make kfp-compile` and commit it"
    )


def test_sweep_tokenizes_once_then_trains_and_scores_each_override_on_its_own_trainjob(tmp_path):
    """The sweep: the data steps once, then a loop over the `sweep` input, SWEEP_PARALLELISM at
    a time, whose train (a TrainJob on the shared volume) and evaluate steps both get the
    item as their params overrides; nothing is promoted. Every item of the default grid is
    a valid params.yaml change."""
    pipeline = pipeline_module()
    spec, platform = load_pipeline(SWEEP)
    tasks = spec["root"]["dag"]["tasks"]
    sweep = next(
        t
        for name, t in tasks.items()
        if t.get("parameterIterator", {}).get("items", {}).get("inputParameter")
    )
    assert sweep["parameterIterator"]["items"]["inputParameter"] == "pipelinechannel--sweep"
    assert sweep["iteratorPolicy"]["parallelismLimit"] == pipeline.SWEEP_PARALLELISM
    assert {"get-data", "split", "train-tokenizer", "merge-tokens"} <= set(tasks)
    assert "promote" not in tasks and not any("promote" in c for c in spec["components"])
    inner = spec["components"][sweep["componentRef"]["name"]]["dag"]["tasks"]
    assert set(inner) == {"train", "evaluate"}
    item = sweep["parameterIterator"]["itemInput"]
    for task in inner.values():
        assert task["inputs"]["parameters"]["overrides"] == {"componentInputParameter": item}
    train = spec["deploymentSpec"]["executors"]["exec-train"]["container"]
    assert train["args"][0] == "trainjob" and "--update" in train["args"]
    assert "exec-train" in platform["deploymentSpec"]["executors"]  # the volume its pods share
    assert spec["root"]["inputDefinitions"]["parameters"]["sweep"]["parameterType"] == "LIST"
    from lmops.pipeline.params import update_params

    for overrides in pipeline.DEFAULT_SWEEP:
        (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text())
        assert update_params(tmp_path / "params.yaml", overrides).train.muon_lr == overrides["train.muon_lr"]


def test_image_option_sets_every_step_image_and_train_in_pod_needs_no_trainjob(tmp_path):
    compile_pipeline(tmp_path / "p.yaml", "--image", "registry.example/lmops:abc", "--train-in-pod")
    spec, platform = load_pipeline(tmp_path / "p.yaml")
    executors = spec["deploymentSpec"]["executors"]
    assert {e["container"]["image"] for e in executors.values()} == {"registry.example/lmops:abc"}
    train = executors["exec-train"]["container"]
    assert train["args"][0] == "train" and train["resources"]["resourceMemoryLimit"] == "8G"
    assert platform == {}  # no volume: nothing of Trainer v2 is needed


def test_train_step_runs_the_trainjob_on_the_volume_its_pods_share():
    """The committed pipeline's train step: `lmops trainjob` with the step's own image and the
    TrainJob file the pipeline image carries, the runtime's volume mounted where its pods
    mount it, and no resources of its own (the TrainJob's are in kubeflow/trainjob.yaml)."""
    spec, platform = load_pipeline()
    train = spec["deploymentSpec"]["executors"]["exec-train"]["container"]
    assert train["args"][:9] == [
        "trainjob",
        "--arg",
        "--image",
        "--arg",
        train["image"],
        "--arg",
        "--manifest",
        "--arg",
        "/app/kubeflow/trainjob.yaml",
    ]
    assert "resources" not in train
    pvc, runtime = list(yaml.safe_load_all((REPO / "kubeflow/trainjob.yaml").read_text()))[:2]
    pod = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    [volume] = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    [mount] = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
    assert platform["deploymentSpec"]["executors"] == {
        "exec-train": {
            "pvcMount": [
                {
                    "constant": pvc["metadata"]["name"],
                    "mountPath": mount["mountPath"],
                    "pvcNameParameter": {"runtimeValue": {"constant": pvc["metadata"]["name"]}},
                }
            ]
        }
    }
    # the launcher's default workspace is that mount; the pipeline image has the file where named
    from lmops.pipeline.cli import build_parser

    assert str(build_parser().parse_args(["trainjob", "--image", "x"]).workspace) == mount["mountPath"]
    dockerfile = (REPO / "Dockerfile").read_text()
    pipeline_stage = dockerfile[dockerfile.index("AS pipeline\n") : dockerfile.index("AS runtime\n")]
    assert "WORKDIR /app\n" in pipeline_stage and "COPY kubeflow/trainjob.yaml kubeflow/\n" in pipeline_stage


def step_paths() -> dict[str, dict[str, set[str]]]:
    """stage -> {"in": paths, "out": paths}: what the compiled steps stage in (--in) and export
    (--out), the steps of one stage (tokenize's three) together."""
    spec, _ = load_pipeline()
    found: dict[str, dict[str, set[str]]] = {}
    for executor in spec["deploymentSpec"]["executors"].values():
        args = executor["container"]["args"]
        stage = {"trainjob": "train"}.get(args[0], args[0])  # the train stage on a TrainJob
        step = found.setdefault(stage, {"in": set(), "out": set()})
        for flag in ("in", "out"):
            step[flag] |= {args[i + 1] for i, a in enumerate(args) if a == f"--{flag}"}
    return found


def mismatches(stages: dict, found: dict[str, dict[str, set[str]]]) -> list[str]:
    """Where dvc.yaml's `stages` and the steps' paths `found` disagree: a stage's deps must be
    what its steps stage in (but what one of them hands another, tokenize's tokenizer), its
    outs and metrics what they export; a directory stands for the files under it."""

    def declared(stage: dict, *keys: str) -> set[str]:
        return {e if isinstance(e, str) else next(iter(e)) for key in keys for e in stage.get(key) or []}

    def covered(path: str, by: set[str]) -> bool:
        return any(path == p or path.startswith(p + "/") for p in by)

    problems = [f"{name}: no step runs it" for name in stages if name not in found]
    problems += [f"{name}: not a stage of dvc.yaml" for name in found if name not in stages]
    for name in (n for n in stages if n in found):
        steps = found[name]
        for verb, dvc, moved in (
            ("stages in", declared(stages[name], "deps"), steps["in"] - steps["out"]),
            ("exports", declared(stages[name], "outs", "metrics"), steps["out"]),
        ):
            problems += [f"{name}: no step {verb} {p}" for p in sorted(dvc) if not covered(p, moved)]
            problems += [
                f"{name}: a step {verb} {p}, not in dvc.yaml"
                for p in sorted(moved)
                if not any(covered(d, {p}) for d in dvc)
            ]
    return problems


def test_steps_stage_in_and_export_just_the_dvc_stages_deps_and_outs():
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    assert mismatches(stages, step_paths()) == []


def test_steps_and_dvc_yaml_mismatches_are_reported():
    """The check above can fail: an out that only dvc.yaml declares, and a path a step stages
    in that is no longer a dep, are each reported."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    stages["split"]["outs"].append("artifacts/extra.json")
    stages["train"]["deps"].remove("data/raw/manifest.json")
    assert mismatches(stages, step_paths()) == [
        "split: no step exports artifacts/extra.json",
        "train: a step stages in data/raw, not in dvc.yaml",
    ]


def test_dag_runs_in_stage_order_and_shares_one_mlflow_server():
    spec, _ = load_pipeline()
    tasks = spec["root"]["dag"]["tasks"]
    loop = next(t for t in tasks if t.startswith("for-loop"))
    assert set(tasks) == {
        "get-data",
        "split",
        "train-tokenizer",
        loop,
        "merge-tokens",
        "train",
        "evaluate",
        "promote",
    }
    assert tasks["split"]["dependentTasks"] == ["get-data"]
    # tokenize: the tokenizer, then the parts in parallel, then their merge, before training
    assert set(tasks[loop]["dependentTasks"]) == {"split", "train-tokenizer"}
    assert tasks[loop]["parameterIterator"]["items"]["raw"] == "[0, 1, 2, 3]"
    assert tasks["merge-tokens"]["dependentTasks"] == [loop]
    assert {"merge-tokens", "train-tokenizer"} <= set(tasks["train"]["dependentTasks"])
    assert set(tasks["promote"]["dependentTasks"]) == {"evaluate", "get-data", "split", "train"}
    assert tasks["promote"]["cachingOptions"] == {}  # caching off: the registry changes
    assert spec["root"]["inputDefinitions"]["parameters"]["mlflow_tracking_uri"]["parameterType"] == "STRING"


@pytest.fixture
def fake_lmops(tmp_path):
    """An `lmops` that checks the train stage's inputs and writes a model, like the real one."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "lmops"
    fake.write_text("""#!/bin/sh
set -eu
test "$1" = train
test -f params.yaml
test -f data/raw/manifest.json
test -f data/processed/tokens/index.json
test -f artifacts/tokenizer/tokenizer.json
mkdir -p artifacts/model
echo "$MLFLOW_TRACKING_URI" > artifacts/model/tracking_uri
""")
    fake.chmod(0o755)
    return bin_dir


def test_step_shell_copies_inputs_runs_the_stage_and_exports_outputs(tmp_path, fake_lmops):
    app = tmp_path / "app"
    (app).mkdir()
    (app / "params.yaml").write_text("train: {}\n")
    for rel, name in (("raw", "manifest.json"), ("tokens", "index.json"), ("tokenizer", "tokenizer.json")):
        (tmp_path / "in" / rel).mkdir(parents=True)
        (tmp_path / "in" / rel / name).write_text("x")
    model = tmp_path / "out" / "model"
    args = [
        "train",
        "--mlflow",
        "http://mlflow:5000",
        "--in",
        "data/raw",
        str(tmp_path / "in/raw"),
        "--in",
        "data/processed/tokens",
        str(tmp_path / "in/tokens"),
        "--in",
        "artifacts/tokenizer",
        str(tmp_path / "in/tokenizer"),
        "--out",
        "artifacts/model",
        str(model),
    ]
    proc = run_stage(args, fake_lmops, app)
    assert proc.returncode == 0, proc.stderr
    assert (model / "tracking_uri").read_text().strip() == "http://mlflow:5000"

    # A missing input artifact stops the step before the stage runs; nothing is exported.
    args[-1] = str(tmp_path / "out" / "again")
    args[5] = str(tmp_path / "in" / "missing")
    proc = run_stage(args, fake_lmops, app)
    assert proc.returncode != 0 and not (tmp_path / "out" / "again").exists()


def test_step_shell_sets_the_sweep_overrides_before_the_stage_and_stops_on_a_bad_one(tmp_path):
    """`--update JSON` (a sweep item) goes through the real `lmops params`: the stage sees the
    new value; a key params.yaml does not have stops the step, naming it, before the stage."""
    bin_dir, app = tmp_path / "bin", tmp_path / "app"
    bin_dir.mkdir()
    app.mkdir()
    (app / "params.yaml").write_text((REPO / "params.yaml").read_text())
    (bin_dir / "lmops").write_text(f"""#!/bin/sh
set -eu
[ "$1" = params ] && exec {BIN / "lmops"} "$@"
test "$1" = train
grep -q "muon_lr: 0.01" params.yaml
mkdir -p artifacts/model && echo trained > artifacts/model/done
""")
    (bin_dir / "lmops").chmod(0o755)
    model = tmp_path / "out" / "model"
    args = ["train", "--update", '{"train.muon_lr": 0.01}', "--out", "artifacts/model", str(model)]
    proc = run_stage(args, bin_dir, app)
    assert proc.returncode == 0, proc.stderr
    assert (model / "done").read_text() == "trained\n"
    args[2], args[-1] = '{"train.muon_lrr": 0.01}', str(tmp_path / "out" / "again")
    proc = run_stage(args, bin_dir, app)
    assert proc.returncode != 0 and "unknown key 'train.muon_lrr' (did you mean 'muon_lr'?)" in proc.stderr
    assert not (tmp_path / "out" / "again").exists()


class FakeKfp:
    """Stands in for kfp.client.Client (the KFP API is a cloud API): records the calls."""

    calls: list = []

    def __init__(self, host, namespace=None, existing_token=None):
        self.calls.append(("client", host, namespace))

    def create_experiment(self, name, namespace=None):
        self.calls.append(("experiment", name, namespace))
        return SimpleNamespace(experiment_id="exp-1")

    def list_recurring_runs(self, experiment_id, namespace=None, page_size=10):
        runs = [
            SimpleNamespace(display_name="lmops-retrain", recurring_run_id="old-1"),
            SimpleNamespace(display_name="someone-elses", recurring_run_id="other"),
        ]
        return SimpleNamespace(recurring_runs=runs)

    def delete_recurring_run(self, recurring_run_id):
        self.calls.append(("delete", recurring_run_id))

    def create_recurring_run(self, experiment_id, job_name, **kwargs):
        self.calls.append(("create", experiment_id, job_name, kwargs))
        return SimpleNamespace(recurring_run_id="new-1")

    def create_run_from_pipeline_package(self, package, arguments, **kwargs):
        self.calls.append(("run", package, arguments))
        return SimpleNamespace(run_id="run-1")


def test_submit_gives_the_sweep_its_grid_and_refuses_a_grid_for_the_main_pipeline(monkeypatch):
    import kfp.client

    pipeline = pipeline_module()
    monkeypatch.setattr(kfp.client, "Client", FakeKfp)
    argv = ["submit", "--host", "https://kfp.invalid", "--mlflow-tracking-uri", "http://mlflow:5000"]
    FakeKfp.calls = []
    assert pipeline.main([*argv, "--package", str(SWEEP)]) == 0
    assert FakeKfp.calls[-1][2]["sweep"] == pipeline.DEFAULT_SWEEP
    grid = [{"train.muon_lr": 0.01}, {"model.n_layer": 8}]
    assert pipeline.main([*argv, "--package", str(SWEEP), "--sweep", json.dumps(grid)]) == 0
    assert FakeKfp.calls[-1][2] == {"mlflow_tracking_uri": "http://mlflow:5000", "sweep": grid}
    calls = len(FakeKfp.calls)
    for bad in (
        ["--package", str(PIPELINE), "--sweep", json.dumps(grid)],
        ["--package", str(SWEEP), "--sweep", "[]"],
    ):
        with pytest.raises(SystemExit):
            pipeline.main([*argv, *bad])
    assert len(FakeKfp.calls) == calls  # nothing submitted


def test_schedule_replaces_the_recurring_run_of_the_same_name(tmp_path, monkeypatch, capsys):
    import kfp.client

    pipeline = pipeline_module()
    monkeypatch.setattr(kfp.client, "Client", FakeKfp)
    FakeKfp.calls = []
    package = str(tmp_path / "p.yaml")
    argv = ["schedule", "--host", "https://kfp.invalid", "--package", package, "--namespace", "team"]
    assert pipeline.main([*argv, "--mlflow-tracking-uri", "http://mlflow:5000"]) == 0
    assert FakeKfp.calls[:3] == [
        ("client", "https://kfp.invalid", "team"),
        ("experiment", "lmops", "team"),
        ("delete", "old-1"),
    ]
    (_, experiment, name, kwargs) = FakeKfp.calls[3]
    assert (experiment, name) == ("exp-1", "lmops-retrain")
    assert kwargs["cron_expression"] == "0 0 2 * * *" and kwargs["pipeline_package_path"] == package
    assert kwargs["params"] == {"mlflow_tracking_uri": "http://mlflow:5000"}
    assert kwargs["max_concurrency"] == 1 and kwargs["no_catchup"] is True
    assert "recurring run new-1" in capsys.readouterr().out
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(SystemExit):
        pipeline.main(argv)  # no MLflow server: a usage error, nothing scheduled
    assert len(FakeKfp.calls) == 4


def test_merge_step_collects_the_parts_and_passes_its_options(tmp_path):
    """The merge step gets the parts as KFP's JSON list of artifacts: each lands in its own
    directory, and `--arg` reaches the stage's command line."""
    bin_dir, app = tmp_path / "bin", tmp_path / "app"
    bin_dir.mkdir()
    app.mkdir()
    (app / "params.yaml").write_text("tokenizer: {}\n")
    (bin_dir / "lmops").write_text("""#!/bin/sh
set -eu
test "$*" = "tokenize --merge data/processed/token-parts"
test -f data/processed/token-parts/0/index.json && test -f data/processed/token-parts/1/index.json
mkdir -p data/processed/tokens && echo merged > data/processed/tokens/index.json
""")
    (bin_dir / "lmops").chmod(0o755)
    parts = []
    for k in range(2):
        (tmp_path / f"part{k}").mkdir()
        (tmp_path / f"part{k}" / "index.json").write_text(str(k))
        parts.append({"name": f"tokens-{k}", "uri": str(tmp_path / f"part{k}"), "metadata": {}})
    args = ["tokenize", "--arg", "--merge", "--arg", "data/processed/token-parts"]
    args += ["--in-list", "data/processed/token-parts", json.dumps(parts)]
    args += ["--out", "data/processed/tokens", str(tmp_path / "out")]
    proc = run_stage(args, bin_dir, app)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "index.json").read_text() == "merged\n"


LLM_MANIFEST = REPO / "kubeflow" / "llminferenceservice.yaml"


def llm_docs() -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all(LLM_MANIFEST.read_text())}


def test_the_llm_inference_service_validates_against_kserves_crds():
    proc = validate(LLM_MANIFEST)
    assert proc.returncode == 0 and proc.stdout.count("ok ") == 2, proc.stdout + proc.stderr


def test_the_llm_inference_service_validation_is_strict(tmp_path):
    """One fault in each place: the service, the preset's pod, its inline picker config."""
    faults = []
    for fault in (
        lambda d: d["LLMInferenceService"]["spec"].update(replica=2),
        lambda d: d["LLMInferenceService"]["spec"]["model"].pop("uri"),
        lambda d: d["LLMInferenceServiceConfig"]["spec"]["template"]["containers"][0].update(port=8000),
        lambda d: d["LLMInferenceServiceConfig"]["spec"]["router"]["scheduler"]["config"]["inline"][
            "plugins"
        ].append({"type": "queue-scorr"}),
    ):
        docs = llm_docs()
        fault(docs)
        faults += [docs["LLMInferenceServiceConfig"], docs["LLMInferenceService"]]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump_all(faults))
    proc = validate(tmp_path / "bad.yaml")
    assert proc.returncode != 0 and proc.stdout.count("FAIL") == 4, proc.stdout


def test_the_lmops_preset_is_what_kserve_and_the_service_expect(monkeypatch):
    """KServe's contract (container `main`, port 8000, the model under /mnt/models), the
    service's own settings (parsed as the service does), probes on the probe port, and the
    picker reading lmops' metrics as the gateway's does."""
    docs = llm_docs()
    preset, service = docs["LLMInferenceServiceConfig"]["spec"], docs["LLMInferenceService"]["spec"]
    assert service["baseRefs"] == [{"name": docs["LLMInferenceServiceConfig"]["metadata"]["name"]}]
    (main,) = preset["template"]["containers"]
    assert main["name"] == "main"
    # KServe's own template (merged first) runs vLLM: the image's command must replace it.
    dockerfile = (REPO / "Dockerfile").read_text()
    assert f"CMD {json.dumps(main['command'])}" in dockerfile
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    env = {e["name"]: e.get("value") for e in main["env"]}
    for name, value in env.items():
        if value is not None:
            monkeypatch.setenv(name, value)
    config = ServiceConfig.from_env()
    assert config.port == ports["http"] == 8000 and config.probe_port == ports["probes"]
    assert str(config.model_dir) == "/mnt/models"  # KServe's storage initializer mounts the model here
    assert config.engine.scheduling_policy == "priority" and config.engine == EngineConfig(
        scheduling_policy="priority", device="auto"
    )
    assert {main[p]["httpGet"]["port"] for p in ("startupProbe", "readinessProbe", "livenessProbe")} == {
        "probes"
    }
    assert main["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert service["model"]["uri"].startswith("pvc://") and service["model"]["name"] == "lmops"
    inline = preset["router"]["scheduler"]["config"]["inline"]
    assert inline == yaml.safe_load((REPO / "deploy/gateway/epp-config.yaml").read_text())
    extractor = next(p for p in inline["plugins"] if p["type"] == "core-metrics-extractor")
    assert preset["labels"]["llm-d.ai/engine-type"] == extractor["parameters"]["defaultEngine"]
    metrics = next(p for p in inline["plugins"] if p["type"] == "metrics-data-source")
    assert metrics["parameters"]["port"] == ports["probes"]
