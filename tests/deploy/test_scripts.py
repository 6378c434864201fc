"""The deploy/ scripts: shellcheck-clean, and each one run in dry-run mode the way
the Jenkinsfile runs it. In a dry run the cloud tools (az, aws, docker, podman, curl, and
kubectl or dvc beyond rendering) are stand-ins that fail if called, so the scripts
must only print those commands, while rendering and validation run for real."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.deploy.conftest import BIN, REPO, SECRETS, fake_cluster, run_script, tiny_model, tool

ACR, ECR = "testacr.azurecr.io/lmops", "111122223333.dkr.ecr.eu-west-1.amazonaws.com/lmops"
AKS_LOGIN = "az aks get-credentials --resource-group test-rg --name test-aks"
EKS_LOGIN = "aws eks update-kubeconfig --region eu-west-1 --name test-eks"
DRY_DIGEST = "sha256:" + "d" * 64  # what a dry run pins instead of the registry's digest

# (script, arguments, environment, what the dry run must print). The Jenkinsfile test
# checks that each of its `sh` steps is one of these.
DRY_RUNS = [
    (
        "build_image.sh",
        (),
        {},
        ["docker build --pull --target runtime --build-arg VARIANT=cpu", "--tag lmops:0123abcd ."],
    ),
    ("build_image.sh", (), {"GPU": "true"}, ["--build-arg VARIANT=cuda", "--tag lmops:0123abcd-cuda ."]),
    (
        "build_image.sh",
        (),
        {"IMAGE_TARGET": "pipeline"},
        ["docker build --pull --target pipeline --build-arg VARIANT=cpu", "--tag lmops:0123abcd-pipeline ."],
    ),
    (
        "build_image.sh",
        ("--", "--build-arg", "PYTHON=system"),
        {"CONTAINER_ENGINE": "podman", "CONTEXT": "/tmp/context"},
        [
            "podman build --pull --target runtime --build-arg VARIANT=cpu",
            "--format docker --build-arg PYTHON=system --tag lmops:0123abcd /tmp/context",
        ],
    ),
    (
        "push_image.sh",
        (),
        {"CLOUD": "aks"},
        [
            "az login --service-principal --username test-client --password @/",  # a file
            "/azure-secret --tenant test-tenant",
            "az acr login --name testacr",
            f"docker tag lmops:0123abcd {ACR}:0123abcd",
            f"docker push {ACR}:0123abcd",
        ],
    ),
    (
        "push_image.sh",
        (),
        {"CLOUD": "eks"},
        ["aws ecr get-login-password --region eu-west-1", f"docker push {ECR}:0123abcd"],
    ),
    (
        "push_image.sh",
        (),
        {"CLOUD": "kubeflow", "KUBEFLOW_REGISTRY": "ecr", "GPU": "1"},
        [f"docker push {ECR}:0123abcd-cuda"],
    ),
    (
        "push_image.sh",
        (),
        {"CLOUD": "kubeflow", "KUBEFLOW_REGISTRY": "ecr", "IMAGE_TARGET": "pipeline"},
        [f"docker push {ECR}:0123abcd-pipeline"],
    ),
    (
        "deploy.sh",
        (),
        {"CLOUD": "aks"},
        [
            "az acr repository show --name testacr --image lmops:0123abcd",
            f"rendered deploy/aks with image {ACR}@{DRY_DIGEST}",
            AKS_LOGIN,
            "kubectl apply --filename",
            "kubectl --namespace lmops rollout status deployment/lmops --timeout=10m",
        ],
    ),
    (
        "deploy.sh",
        (),
        {"CLOUD": "aks", "GPU": "1"},
        [
            "az acr repository show --name testacr --image lmops:0123abcd-cuda",
            f"rendered deploy/aks/gpu with image {ACR}@{DRY_DIGEST}",
        ],
    ),
    (
        "deploy.sh",
        (),
        {"CLOUD": "eks"},
        [
            "aws ecr describe-images --region eu-west-1 --repository-name lmops --image-ids imageTag=0123abcd",
            f"rendered deploy/eks with image {ECR}@{DRY_DIGEST}, its compile cache on EFS fs-0123456789abcdef0",
            EKS_LOGIN,
        ],
    ),
    (
        "deploy.sh",
        (),
        {"CLOUD": "eks", "GPU": "1", "LMOPS_API_KEY": ""},
        [
            "aws ecr describe-images --region eu-west-1 --repository-name lmops --image-ids imageTag=0123abcd-cuda",
            f"rendered deploy/eks/gpu with image {ECR}@{DRY_DIGEST}",
            "kubectl --namespace lmops get secret lmops-api-key",
        ],
    ),
    (
        "deploy.sh",
        (),
        {"CLOUD": "aks", "CANARY": "true"},
        [
            "az acr repository show --name testacr --image lmops:0123abcd",
            f"rendered deploy/aks/canary with image {ACR}@{DRY_DIGEST}",
            "kubectl apply --filename",
            "kubectl --namespace lmops get rollout lmops --output",
            "kubectl --namespace lmops delete deployment lmops --ignore-not-found",
        ],
    ),
    (
        "deploy.sh",
        (),
        {"CLOUD": "aks", "GATEWAY": "1"},
        [
            f"rendered deploy/aks/gateway with image {ACR}@{DRY_DIGEST}",
            "kubectl --namespace lmops get gateway inference-gateway --output name",
            "kubectl apply --filename",
            "kubectl --namespace lmops rollout status deployment/lmops-epp --timeout=10m",
            "kubectl --namespace lmops rollout status deployment/lmops --timeout=10m",
        ],
    ),
    (
        "deploy.sh",
        (),
        {"CLOUD": "eks", "GATEWAY": "precise"},
        [
            f"rendered deploy/eks/gateway-precise with image {ECR}@{DRY_DIGEST}",
            "kubectl --namespace lmops get gateway inference-gateway --output name",
            "kubectl --namespace lmops rollout status deployment/lmops-epp --timeout=10m",
        ],
    ),
    (
        "deploy.sh",
        (),
        {"CLOUD": "eks", "CANARY": "1", "GPU": "1"},
        [
            "aws ecr describe-images --region eu-west-1 --repository-name lmops --image-ids imageTag=0123abcd-cuda",
            f"rendered deploy/eks/canary/gpu with image {ECR}@{DRY_DIGEST}",
            "get rollout lmops",
        ],
    ),
    (
        "kubeflow.sh",
        ("deploy",),
        {},
        ["kubectl apply --filename", "wait inferenceservice/lmops --for=condition=Ready"],
    ),
    ("kubeflow.sh", ("deploy",), {"GPU": "1"}, ["kubectl apply --filename"]),
    (
        "kubeflow.sh",
        ("deploy",),
        {"LLM": "1", "COMPILE_CACHE_CLAIM": "lmops-compile-cache"},
        [
            "rendered kubeflow/llminferenceservice.yaml with image",
            ", its compile cache on the claim lmops-compile-cache",
        ],
    ),
    (
        "kubeflow.sh",
        ("deploy",),
        {"LLM": "1"},
        [
            "LLMInferenceServiceConfig/lmops-runtime",
            "LLMInferenceService/lmops",
            "kubectl apply --filename",
            "wait llminferenceservice/lmops --for=condition=Ready",
        ],
    ),
    (
        "kubeflow.sh",
        ("deploy",),
        {"CANARY": "true", "PROMETHEUS_URL": "http://prometheus.invalid:9090", "CANARY_PERCENT": "25"},
        [
            "rendered kubeflow/inferenceservice.yaml with image",
            ", 25 % of the traffic to the new revision\n",
            "kubectl apply --filename",
            "wait inferenceservice/lmops --for=condition=Ready",
            "get inferenceservice lmops --output jsonpath=",
            "python deploy/canary_analysis.py --prometheus http://prometheus.invalid:9090",
            "--arg canary-hash=CANARY_REVISION --arg stable-hash=STABLE_REVISION",
            '--patch \\{\\"spec\\":\\{\\"predictor\\":\\{\\"canaryTrafficPercent\\":100',
        ],
    ),
    (
        "kubeflow.sh",
        ("deploy",),
        {
            "COMPILE_CACHE_CLAIM": "lmops-compile-cache",
            "CANARY": "1",
            "PROMETHEUS_URL": "http://p.invalid:9090",
        },
        [
            ", 10 % of the traffic to the new revision, its compile cache on the claim lmops-compile-cache",
            "wait inferenceservice/lmops --for=condition=Ready",
            "python deploy/canary_analysis.py --prometheus http://p.invalid:9090",
        ],
    ),
    (
        "kubeflow.sh",
        ("train",),
        {},
        ["delete trainjob lmops-train --ignore-not-found", "kubectl apply"],
    ),
    (
        "kubeflow.sh",
        ("pipeline",),
        {},
        [  # what the train step's TrainJob needs, applied first; not the TrainJob itself
            "PersistentVolumeClaim/lmops-workspace",
            "ClusterTrainingRuntime/lmops-torch",
            "Role/lmops-trainjob-launcher",
            "RoleBinding/lmops-trainjob-launcher",
            "kubectl apply --filename",
            f"(image {ACR}:0123abcd-pipeline, training on a TrainJob)",
            "python kubeflow/pipeline.py submit --host https://kfp.invalid --package",
        ],
    ),
    (
        "kubeflow.sh",
        ("schedule",),
        {"KFP_CRON": "0 30 1 * * *"},
        [
            "python kubeflow/pipeline.py schedule --host https://kfp.invalid",
            "--cron 0\\ 30\\ 1\\ \\*\\ \\*\\ \\*",
        ],
    ),
    (
        "kubeflow.sh",
        ("sweep",),
        {"KFP_SWEEP": '[{"train.muon_lr": 0.01}]'},
        [
            "ClusterTrainingRuntime/lmops-torch",
            "python kubeflow/pipeline.py submit --host https://kfp.invalid --package",
            '--sweep \\[\\{\\"train.muon_lr\\":\\ 0.01\\}\\]',
        ],
    ),
    (
        "smoke_test.sh",
        (),
        {"CLOUD": "aks"},
        [
            AKS_LOGIN,
            "kubectl --namespace lmops get service/lmops",
            "http://LOADBALANCER:5001/health",
            "--header @/",  # the bearer token from a file, not argv
            "/auth-header",
            "http://LOADBALANCER:5001/v1/completions",
        ],
    ),
    ("smoke_test.sh", (), {"CLOUD": "eks"}, [EKS_LOGIN, "http://LOADBALANCER:5001/ready"]),
    (
        "smoke_test.sh",
        (),
        {"CLOUD": "eks", "GATEWAY": "1"},
        [
            "get gateway/inference-gateway --output jsonpath=\\{.status.addresses",
            "http://LOADBALANCER/v1/completions",
        ],
    ),
    (
        "smoke_test.sh",
        (),
        {"CLOUD": "kubeflow"},
        [
            "get inferenceservice lmops",
            "get service/istio-ingressgateway",
            "Host:\\ lmops.",
            "LOADBALANCER/health",
        ],
    ),
    ("dvc.sh", ("pull", "repro", "push"), {}, ["dvc pull --allow-missing", "dvc repro", "dvc push"]),
    (
        "dvc.sh",
        ("pull", "refresh", "repro", "push"),
        {},
        ["dvc pull --allow-missing", "dvc repro --force --single-item get_data", "dvc repro\n", "dvc push"],
    ),
    ("fetch_model.sh", (), {}, ["python -c", "models:/lmops@champion"]),
]


# What those dry runs must not print.
DRY_RUNS_NEVER = {
    ("kubeflow.sh", "pipeline"): ["TrainJob/lmops-train"],
    ("kubeflow.sh", "sweep"): ["TrainJob/lmops-train"],
}


def stand_ins(folder: Path, kubectl: str) -> str:
    """A folder of cloud tools that fail when called; kubectl and dvc only render/parse."""
    folder.mkdir(exist_ok=True)
    dvc = tool("dvc")
    scripts = {name: "exit 97" for name in ("az", "aws", "docker", "podman", "curl")}
    scripts["kubectl"] = f'[ "$1" = kustomize ] && exec {kubectl} "$@"; exit 97'
    scripts["dvc"] = f'[ "$1 $2" = "stage list" ] && exec {dvc} "$@"; exit 97'
    for name, body in scripts.items():
        (folder / name).write_text(f"#!/bin/sh\n{body}\n")
        (folder / name).chmod(0o755)
    return str(folder)


@pytest.mark.parametrize(
    ("script", "args", "env", "expected"),
    DRY_RUNS,
    ids=[f"{c[0]}-{'-'.join(c[1])}-{'-'.join(f'{k}={v}' for k, v in c[2].items())}" for c in DRY_RUNS],
)
def test_dry_run(script, args, env, expected, tmp_path, kubectl):
    proc = run_script(script, "--dry-run", *args, path_prefix=stand_ins(tmp_path / "bin", kubectl), **env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    for text in expected:
        assert text in proc.stderr, f"missing `{text}` in:\n{proc.stderr}"
    for text in DRY_RUNS_NEVER.get((script, *args), []):
        assert text not in proc.stderr, f"`{text}` in:\n{proc.stderr}"
    assert "dry run" in proc.stderr
    for name, value in SECRETS.items():
        assert value not in output, f"{name} leaked into the output"


def test_dry_run_also_from_the_environment(tmp_path, kubectl):
    proc = run_script(
        "deploy.sh", path_prefix=stand_ins(tmp_path / "bin", kubectl), CLOUD="eks", DRY_RUN="true"
    )
    assert proc.returncode == 0, proc.stderr
    assert EKS_LOGIN in proc.stderr


@pytest.mark.parametrize(
    ("script", "env", "message"),
    [
        ("deploy.sh", {"CLOUD": "kubeflow"}, "CLOUD must be aks or eks"),
        ("deploy.sh", {"CLOUD": "aks", "ACR_NAME": ""}, "set ACR_NAME"),
        ("deploy.sh", {"CLOUD": "aks", "IMAGE": "x.io/lmops:1"}, "IMAGE must name a digest"),
        ("push_image.sh", {"CLOUD": "gcp"}, "CLOUD must be aks, eks or kubeflow"),
        ("deploy.sh", {"CLOUD": "aks", "LMOPS_API_KEY": "k"}, "LMOPS_API_KEY is 1 character(s) long"),
        ("deploy.sh", {"CLOUD": "aks", "GATEWAY": "1", "CANARY": "1"}, "GATEWAY=1 cannot be combined"),
        ("deploy.sh", {"CLOUD": "eks", "GATEWAY": "1", "GPU": "1"}, "GATEWAY=1 cannot be combined"),
        (
            "deploy.sh",
            {"CLOUD": "eks", "EFS_FILE_SYSTEM_ID": ""},
            "set EFS_FILE_SYSTEM_ID to the EFS file system",
        ),
        ("deploy.sh", {"CLOUD": "eks", "EFS_FILE_SYSTEM_ID": "fs-x; rm -rf /"}, "got 'fs-x; rm -rf /'"),
        (
            "kubeflow.sh deploy",
            {"COMPILE_CACHE_CLAIM": "cache", "GPU": "1"},
            "COMPILE_CACHE_CLAIM is for the CPU",
        ),
        ("kubeflow.sh deploy", {"COMPILE_CACHE_CLAIM": "Cache/x"}, "must name a PersistentVolumeClaim"),
    ],
)
def test_missing_or_wrong_settings_stop_with_a_clear_message(script, env, message, tmp_path, kubectl):
    name, *action = script.split()
    proc = run_script(name, "--dry-run", *action, path_prefix=stand_ins(tmp_path / "bin", kubectl), **env)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert "printed, not run" not in proc.stderr  # the dry run stopped: it printed not all of it


@pytest.mark.parametrize("other", ["GPU", "CANARY"])
def test_kubeflow_llm_deploy_is_its_own_variant(other, tmp_path, kubectl):
    bin_dir = stand_ins(tmp_path / "bin", kubectl)
    proc = run_script("kubeflow.sh", "--dry-run", "deploy", path_prefix=bin_dir, LLM="1", **{other: "1"})
    assert proc.returncode != 0 and "LLM=1 cannot be combined with GPU or CANARY" in proc.stderr, proc.stderr


def test_kubeflow_needs_a_kubeconfig_only_to_run_for_real(tmp_path, kubectl):
    bin_dir = stand_ins(tmp_path / "bin", kubectl)
    dry = run_script("kubeflow.sh", "--dry-run", "train", path_prefix=bin_dir, KUBECONFIG="")
    assert dry.returncode == 0 and "kubectl apply" in dry.stderr, dry.stderr
    real = run_script("kubeflow.sh", "train", path_prefix=bin_dir, KUBECONFIG="")
    assert real.returncode != 0 and "set KUBECONFIG" in real.stderr, real.stderr
    assert "kubectl apply" not in real.stderr  # stopped before any cluster command


def test_failed_rollout_is_rolled_back(tmp_path, kubectl):
    """deploy.sh for real, against stand-ins for az and the cluster: the first rollout
    never completes, so it must undo it, wait for the old one, and fail."""
    bin_dir, log = fake_cluster(
        tmp_path, kubectl, f'  *"rollout status"*) grep -q "rollout undo" {tmp_path / "calls.log"} ;;\n'
    )
    proc = run_script("deploy.sh", path_prefix=str(bin_dir), CLOUD="aks")
    assert proc.returncode == 1, proc.stderr
    calls = [line.split(" --kubeconfig")[0] for line in log.read_text().splitlines()]
    assert [c.split()[:2] for c in calls] == [
        ["az", "login"],
        ["az", "aks"],
        ["az", "acr"],  # the pushed tag's digest, which the manifests pin
        ["kubectl", "apply"],
        ["kubectl", "--namespace"],
        ["kubectl", "--namespace"],
        ["kubectl", "--namespace"],
    ]
    assert "rollout undo deployment/lmops" in calls[5] and "rolling back" in proc.stderr
    assert f"rendered deploy/aks with image {ACR}@sha256:{'e' * 64}" in proc.stderr  # the registry's digest
    assert SECRETS["AZURE_CLIENT_SECRET"] not in log.read_text()  # argv is visible in `ps`


def test_gateway_deploy_stops_before_applying_when_the_cluster_has_no_gateway(tmp_path, kubectl):
    bin_dir, log = fake_cluster(tmp_path, kubectl, '  *"get gateway inference-gateway"*) exit 1 ;;\n')
    proc = run_script("deploy.sh", path_prefix=str(bin_dir), CLOUD="aks", GATEWAY="1")
    assert proc.returncode == 1 and "no Gateway inference-gateway in namespace lmops" in proc.stderr, (
        proc.stderr
    )
    assert "rendered deploy/aks/gateway" in proc.stderr
    assert "kubectl apply" not in log.read_text()


def test_scripts_pass_shellcheck():
    scripts = sorted(str(p) for p in (REPO / "deploy").glob("*.sh"))
    proc = subprocess.run(
        [tool("shellcheck"), *scripts], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_script_has_a_dry_run_case():
    runnable = {p.name for p in (REPO / "deploy").glob("*.sh") if p.stat().st_mode & 0o111}
    # image_test.sh is a test itself (make image-test): it builds and runs the image for real.
    assert runnable == {case[0] for case in DRY_RUNS} | {"smoke_test.sh", "image_test.sh"}


REGISTER = """
import sys
from pathlib import Path
from lmops.pipeline import tracking
from lmops.pipeline.params import MlflowConfig

experiment = tracking.configure(MlflowConfig(experiment="t", tracking_uri=sys.argv[1], artifact_location="mlruns"))
run_id = tracking.client().create_run(experiment).info.run_id
tracking.log_model(run_id, Path(sys.argv[2]))
version = tracking.register("lmops", run_id, {})
tracking.client().set_registered_model_alias("lmops", "champion", version.version)
"""


@pytest.mark.slow
def test_fetch_model_exports_the_registry_champion(tmp_path):
    model = tiny_model(tmp_path / "trained")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    subprocess.run(
        [str(BIN / "python"), "-c", REGISTER, uri, str(model)],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        timeout=120,
    )
    proc = run_script("fetch_model.sh", MLFLOW_TRACKING_URI=uri, EXPORT_DIR=str(tmp_path / "served"))
    assert proc.returncode == 0, proc.stderr
    served = tmp_path / "served"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (served / name).read_bytes() == (model / name).read_bytes(), name
    assert json.loads((served / "lmops.json").read_text())["model_uri"] == "models:/lmops@champion"
