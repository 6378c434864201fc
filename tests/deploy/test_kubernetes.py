"""k8s-deployment.yml, the kustomize overlays and the Kubeflow manifests: each one
rendered by kubectl kustomize and validated strictly offline (deploy/validate.py:
kubernetes-validate for built-in kinds, structural schemas for the CRDs), then
checked for what the docs promise."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from tests.deploy.conftest import BIN, CLUSTER_SCOPED, REPO

OVERLAYS = ["aks", "aks/gpu", "eks", "eks/gpu"]
KUBEFLOW = [
    "kubeflow/inferenceservice.yaml",
    "kubeflow/inferenceservice-gpu.yaml",
    "kubeflow/trainjob.yaml",
    "kubeflow/llminferenceservice.yaml",
]
REGISTRY = {"aks": ".azurecr.io/lmops@", "eks": ".dkr.ecr.us-east-1.amazonaws.com/lmops@"}
# What an overlay applied by hand pulls: nothing (deploy.sh pins the pushed image's digest).
PLACEHOLDER_DIGEST = "sha256:" + "0" * 64


def validate(path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "python"), "deploy/validate.py", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def rendered(kubectl, tmp_path_factory) -> dict[str, list[dict]]:
    """Each overlay rendered by `kubectl kustomize`, and saved for validation."""
    out = {}
    folder = tmp_path_factory.mktemp("rendered")
    for overlay in OVERLAYS:
        proc = subprocess.run(
            [kubectl, "kustomize", f"deploy/{overlay}"], cwd=REPO, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stderr
        path = folder / (overlay.replace("/", "-") + ".yaml")
        path.write_text(proc.stdout)
        out[overlay] = path
    return out


def by_kind(docs: list[dict]) -> dict[str, dict]:
    return {d["kind"]: d for d in docs}


@pytest.mark.parametrize("manifest", ["k8s-deployment.yml", *KUBEFLOW])
def test_manifest_is_valid(manifest):
    proc = validate(REPO / manifest)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok" in proc.stdout


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_overlay_is_valid(rendered, overlay):
    proc = validate(rendered[overlay])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kinds = {line.rsplit(": ", 1)[1].split("/")[0] for line in proc.stdout.splitlines()}
    compile_cache = set() if overlay.endswith("gpu") else {"StorageClass", "PersistentVolumeClaim"}
    assert kinds == {
        "Namespace",
        "Service",
        "Deployment",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "NetworkPolicy",
        *compile_cache,
    }


def test_validation_is_strict(tmp_path):
    docs = list(yaml.safe_load_all((REPO / "k8s-deployment.yml").read_text()))
    docs[0]["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    isvc = yaml.safe_load((REPO / KUBEFLOW[0]).read_text())
    isvc["spec"]["predictor"]["containers"][0]["imagePullPolicyy"] = "Always"
    (tmp_path / "bad.yaml").write_text(
        yaml.safe_dump_all([docs[0], isvc, {"apiVersion": "x/v1", "kind": "X"}])
    )
    proc = validate(tmp_path / "bad.yaml")
    assert proc.returncode != 0 and proc.stdout.count("FAIL") == 3, proc.stdout


def test_root_manifest_is_the_base_of_every_overlay():
    assert (REPO / "k8s-deployment.yml").resolve() == (REPO / "deploy/base/k8s-deployment.yml").resolve()


def test_deployment_service_hpa_pdb_as_promised():
    kinds = by_kind(list(yaml.safe_load_all((REPO / "k8s-deployment.yml").read_text())))
    deployment, service, hpa, pdb = (
        kinds[k] for k in ("Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget")
    )
    spec = deployment["spec"]
    assert spec["replicas"] == 2
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert any(v["name"] == "tmp" and "emptyDir" in v for v in pod["volumes"])
    env = {e["name"]: e for e in container["env"]}
    assert pod["terminationGracePeriodSeconds"] > int(env["LMOPS_GRACEFUL_TIMEOUT"]["value"]) >= 30
    assert env["LMOPS_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "lmops-api-key", "key": "api-key"}
    assert container["ports"] == [
        {"name": "http", "containerPort": 5001, "protocol": "TCP"},
        {"name": "probes", "containerPort": 5002, "protocol": "TCP"},
    ]
    assert env["LMOPS_PROBE_PORT"]["value"] == "5002"
    for probe, path in (
        ("startupProbe", "/ready"),
        ("readinessProbe", "/ready"),
        ("livenessProbe", "/health"),
    ):
        assert container[probe]["httpGet"] == {"path": path, "port": "probes"}  # not behind busy API threads
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(container["resources"][kind])
    assert service["spec"]["type"] == "LoadBalancer" and service["spec"]["ports"][0]["port"] == 5001
    assert hpa["spec"]["scaleTargetRef"]["name"] == "lmops" and hpa["spec"]["minReplicas"] >= 2
    assert pdb["spec"]["minAvailable"] == 1


def test_network_policy_opens_the_api_port_to_the_load_balancer_and_probes_to_monitoring():
    """/metrics needs no key on the probe port, so only Prometheus' namespace reaches it."""
    kinds = by_kind(list(yaml.safe_load_all((REPO / "k8s-deployment.yml").read_text())))
    policy, deployment = kinds["NetworkPolicy"]["spec"], kinds["Deployment"]
    assert (
        policy["podSelector"]["matchLabels"].items()
        <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    assert policy["policyTypes"] == ["Ingress"]
    rules = {rule["ports"][0]["port"]: rule.get("from") for rule in policy["ingress"]}
    assert all(len(rule["ports"]) == 1 for rule in policy["ingress"])
    assert rules == {
        "http": None,  # any source: the LoadBalancer's traffic
        "probes": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
    }
    ports = {p["name"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert set(rules) == ports


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_sets_registry_load_balancer_and_gpu(rendered, overlay):
    cloud, gpu = overlay.split("/")[0], overlay.endswith("gpu")
    kinds = by_kind(list(yaml.safe_load_all(rendered[overlay].read_text())))
    pod = kinds["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"].endswith(REGISTRY[cloud] + PLACEHOLDER_DIGEST)  # never a tag, never latest
    annotations = kinds["Service"]["metadata"]["annotations"]
    prefix = {
        "aks": "service.beta.kubernetes.io/azure-load-balancer-",
        "eks": "service.beta.kubernetes.io/aws-load-balancer-",
    }[cloud]
    assert any(key.startswith(prefix) for key in annotations) and "/health" in annotations.values()
    assert all(d["metadata"].get("namespace") == "lmops" for k, d in kinds.items() if k not in CLUSTER_SCOPED)
    limits = container["resources"]["limits"]
    if gpu:
        assert limits["nvidia.com/gpu"] == 1 and pod["nodeSelector"]
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
        assert {"name": "LMOPS_DEVICE", "value": "cuda"} in container["env"]
    else:
        assert "nvidia.com/gpu" not in limits and "nodeSelector" not in pod


@pytest.mark.parametrize("cloud", ["aks", "eks"])
def test_cpu_variants_share_one_compile_cache_and_gpu_ones_have_none(cloud, kubectl):
    """Every CPU variant's pods keep inductor's whole cache on one ReadWriteMany claim of the
    cloud's file share, owned by the pods' user; the GPU variants (eager decode) claim none."""
    provisioner, owner = {
        "aks": ("file.csi.azure.com", lambda sc: {"uid=10001", "gid=10001"} <= set(sc["mountOptions"])),
        "eks": (
            "efs.csi.aws.com",
            lambda sc: (sc["parameters"]["uid"], sc["parameters"]["gid"]) == ("10001",) * 2,
        ),
    }[cloud]
    for variant in ["", "canary", "gateway", "gateway-precise", "gpu", "canary/gpu"]:
        overlay = f"deploy/{cloud}/{variant}".rstrip("/")
        proc = subprocess.run(
            [kubectl, "kustomize", overlay], cwd=REPO, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stderr
        docs = list(yaml.safe_load_all(proc.stdout))
        kinds = by_kind(docs)
        (workload,) = (
            d for d in docs if d["kind"] in ("Deployment", "Rollout") and d["metadata"]["name"] == "lmops"
        )
        pod = workload["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        if "gpu" in variant:
            assert {"PersistentVolumeClaim", "StorageClass"}.isdisjoint(
                kinds
            ) and "TORCHINDUCTOR_CACHE_DIR" not in env
            continue
        claim, storage = kinds["PersistentVolumeClaim"], kinds["StorageClass"]
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"], overlay
        assert claim["spec"]["storageClassName"] == storage["metadata"]["name"], overlay
        assert storage["provisioner"] == provisioner and owner(storage), overlay
        (volume,) = (
            v["name"]
            for v in pod["volumes"]
            if v.get("persistentVolumeClaim", {}).get("claimName") == claim["metadata"]["name"]
        )
        (mount,) = (m["mountPath"] for m in container["volumeMounts"] if m["name"] == volume)
        assert env["TORCHINDUCTOR_CACHE_DIR"].startswith(mount + "/"), overlay
        assert pod["securityContext"]["runAsUser"] == 10001


def test_inference_services_serve_our_image_on_5001():
    cpu, gpu = (yaml.safe_load((REPO / path).read_text()) for path in KUBEFLOW[:2])
    for isvc, on_gpu in ((cpu, False), (gpu, True)):
        predictor = isvc["spec"]["predictor"]
        (container,) = predictor["containers"]
        assert container["image"].startswith("lmops:") and container["ports"][0]["containerPort"] == 5001
        assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert container["livenessProbe"]["httpGet"]["path"] == "/health"
        assert predictor["terminationGracePeriodSeconds"] > 30
        assert ("nvidia.com/gpu" in container["resources"]["limits"]) == on_gpu


def test_trainjob_runs_the_train_stage_with_torchrun_on_a_trainer_v2_runtime():
    pvc, runtime, job, role, binding = yaml.safe_load_all((REPO / "kubeflow/trainjob.yaml").read_text())
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert (runtime["kind"], job["kind"]) == ("ClusterTrainingRuntime", "TrainJob")
    assert job["spec"]["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org",
        "kind": "ClusterTrainingRuntime",
        "name": runtime["metadata"]["name"],
    }
    assert (
        "torch" in runtime["spec"]["mlPolicy"]
        and runtime["metadata"]["labels"]["trainer.kubeflow.org/framework"] == "torch"
    )
    trainer = job["spec"]["trainer"]
    assert trainer["command"] == [
        "torchrun",
        "-m",
        "lmops.pipeline.cli",
        "train",
    ]  # PET_* from the torch policy
    assert trainer["numNodes"] >= 2 and trainer["numProcPerNode"] == 1
    [node] = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    assert node["template"]["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"
    pod = node["template"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == "node" and container["workingDir"] == "/workspace"
    assert container["image"].startswith("lmops:")  # deploy/kubeflow.sh sets the pipeline image
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert any(
        v.get("persistentVolumeClaim", {}).get("claimName") == pvc["metadata"]["name"] for v in pod["volumes"]
    )
    assert job["spec"]["activeDeadlineSeconds"] > 0  # how long the pipeline's launcher waits too
    # the KFP step (the profile's default-editor) may create, read and delete TrainJobs
    [rule] = role["rules"]
    assert (rule["apiGroups"], rule["resources"]) == (["trainer.kubeflow.org"], ["trainjobs"])
    assert {"create", "get", "delete"} <= set(rule["verbs"])
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "lmops-trainjob-launcher",
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "default-editor"}]
