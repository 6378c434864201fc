"""The Dockerfile and its build context: hadolint, the promised properties, .dockerignore."""

from __future__ import annotations

import re
import subprocess
import tomllib
from importlib import metadata

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.deploy.conftest import REPO, tool

DOCKERFILE = (REPO / "Dockerfile").read_text()
# The pipeline's stack, which the serving image must not carry.
PIPELINE_ONLY = {"dvc", "mlflow", "transformers", "pandas", "scipy", "pyarrow", "matplotlib", "scikit-learn"}
# pip freeze leaves these out of requirements.lock; the serve lock pins them itself.
UNFROZEN = {"pip", "setuptools", "wheel"}


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE)
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def test_hadolint_passes_with_the_committed_config():
    proc = subprocess.run(
        [tool("hadolint"), "--config", ".hadolint.yaml", "Dockerfile"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_ignored_hadolint_rule_is_explained_in_the_config():
    config_text = (REPO / ".hadolint.yaml").read_text()
    ignored = set(yaml.safe_load(config_text).get("ignored") or [])
    ignored |= {
        rule for rules in re.findall(r"hadolint ignore=([\w,]+)", DOCKERFILE) for rule in rules.split(",")
    }
    for rule in ignored:
        assert re.search(rf"^#\s+{rule}\b.*\S", config_text, re.M), f"{rule} is ignored without a reason"


def test_image_is_multi_stage_pinned_non_root_and_serves_5001():
    steps = instructions()
    froms = [args for op, args in steps if op == "FROM"]
    stage_names = {f.split(" AS ")[-1] for f in froms}
    images = [f.split()[0] for f in froms if not f.startswith("base-") and f.split()[0] not in stage_names]
    assert len(froms) >= 3 and any(" AS build" in f for f in froms) and froms[-1].endswith("AS runtime")
    for image in images:  # a tag with a version in it, never latest
        assert re.search(r":[^:]*\d", image) and not image.endswith(":latest"), image
    assert "VARIANT=cpu" in [args for op, args in steps if op == "ARG"]
    assert any(f.startswith("nvidia/cuda:") for f in froms), "no CUDA base for VARIANT=cuda"
    runtime = steps[max(i for i, (op, _) in enumerate(steps) if op == "FROM") :]
    user = [args for op, args in runtime if op == "USER"]
    assert user and user[-1].split(":")[0] not in ("0", "root")
    assert ("EXPOSE", "5001 5002") in runtime  # the API, and the probes on their own threads
    healthcheck = [args for op, args in runtime if op == "HEALTHCHECK"]
    assert healthcheck and "/health" in healthcheck[0]
    cmd = [args for op, args in runtime if op == "CMD"][-1]
    assert cmd == '["gunicorn", "--config", "production_service/gunicorn.conf.py"]'
    assert any(op == "COPY" and "requirements-serve.lock" in args for op, args in steps)
    assert any(op == "RUN" and "-r requirements-serve.lock" in args for op, args in steps)
    assert any(op == "COPY" and args.startswith("production_service/") for op, args in runtime)


def stages() -> dict[str, list[tuple[str, str]]]:
    """Each build stage's name and its instructions."""
    found: dict[str, list[tuple[str, str]]] = {}
    current: list = []
    for op, args in instructions():
        if op == "FROM":
            current = found.setdefault(args.split(" AS ")[-1].strip(), [])
        current.append((op, args))
    return found


def test_the_serving_target_carries_the_runtime_half_only_and_the_pipeline_target_all():
    """The two halves (docs/architecture.md): the image the LoadBalancer serves has no pipeline code (nor its
    `lmops` command); Kubeflow's steps run in the pipeline target."""
    by_stage = stages()
    serving = [args for stage in ("build", "runtime") for op, args in by_stage[stage] if op == "COPY"]
    copied = [src for args in serving if "--from" not in args for src in args.split()[:-1]]
    assert "src/lmops/runtime/" in copied
    assert not [src for src in copied if src in ("src/", "src/lmops/", "params.yaml") or "pipeline" in src]
    assert any(op == "RUN" and "rm /opt/venv/bin/lmops" in args for op, args in by_stage["build"])
    pipeline = by_stage["pipeline"]
    assert by_stage["pipeline-build"][0] == ("FROM", "build AS pipeline-build")
    assert any(op == "RUN" and "-r requirements.lock" in args for op, args in by_stage["pipeline-build"])
    assert ("COPY", "src/ src/") in by_stage["pipeline-build"]
    assert [args for op, args in pipeline if op == "USER"][-1].startswith("10001")
    assert ("COPY", "params.yaml dvc.yaml ./") in pipeline


def glob_regex(glob: str) -> re.Pattern:
    """Docker's .dockerignore glob: `*` and `?` stay inside one folder, `**` crosses them."""
    out, i = "", 0
    while i < len(glob):
        if glob.startswith("**/", i):
            out, i = out + "(.*/)?", i + 3
        elif glob.startswith("**", i):
            out, i = out + ".*", i + 2
        else:
            out, i = out + {"*": "[^/]*", "?": "[^/]"}.get(glob[i], re.escape(glob[i])), i + 1
    return re.compile(out + "$")


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern that matches the path or a parent of it decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        regex = glob_regex(pattern.lstrip("!").rstrip("/"))
        if any(regex.match(p) for p in prefixes):
            excluded = not pattern.startswith("!")
    return excluded


def context_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_dockerignore_keeps_data_venv_mlflow_db_and_caches_out():
    patterns = context_patterns()
    for path in [
        "data/raw/corpus.txt",
        "artifacts/model/model.safetensors",
        ".venv/bin/python",
        "mlflow.db",
        "mlruns/0/meta.yaml",
        ".git/HEAD",
        ".pytest_cache/v/x",
        ".ruff_cache/x",
        ".dvc/cache/x",
        "src/lmops/__pycache__/cli.cpython-311.pyc",
        "production_service/model.tmp/config.json",
        "production_service/.model.4242.abcd1234.tmp/model.safetensors",  # a killed older export
        "production_service/.model.old/config.json",
        "production_service/model/.staging.4242.abcd1234.tmp/model.safetensors",  # a killed export
        "production_service/model/.config.json.abcd1234.tmp",
        "tests/unit/test_model.py",
    ]:
        assert dockerignored(path, patterns), f"{path} would be sent to the docker build"
    for path in [
        "requirements-serve.lock",
        "pyproject.toml",
        "README.md",
        "params.yaml",
        "kubeflow/trainjob.yaml",  # the pipeline image's TrainJob (lmops trainjob)
        "src/lmops/pipeline/cli.py",
        "production_service/app.py",
        "production_service/gunicorn.conf.py",
        "production_service/model/config.json",
        "production_service/model/.current",  # the export's versioned layout (model_dir.export)
        "production_service/model/.v-0123456789ab/model.safetensors",
    ]:
        assert not dockerignored(path, patterns), f"{path} is needed by the Dockerfile but ignored"


def test_everything_the_dockerfile_copies_is_in_the_build_context():
    patterns = context_patterns()
    for op, args in instructions():
        if op == "COPY" and "--from" not in args:
            for source in args.split()[:-1]:
                assert (REPO / source).exists(), f"COPY {source}: missing"
                assert not dockerignored(source.rstrip("/"), patterns), (
                    f"COPY {source}: excluded by .dockerignore"
                )


def pins(lock: str) -> dict[str, str]:
    """name -> version of every `name==version` line."""
    lines = (REPO / lock).read_text().splitlines()
    found = [re.match(r"([\w.-]+)==(\S+)$", line) for line in lines if line and not line.startswith("#")]
    assert all(found), f"{lock}: a line that is not an exact pin"
    return {canonicalize_name(m[1]): m[2] for m in found}


def test_serve_lock_pins_lmops_serve_and_all_it_needs_and_no_pipeline_package():
    serve, runtime = pins("requirements-serve.lock"), pins("requirements.lock")
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["serve"]
    assert not PIPELINE_ONLY & serve.keys()
    for line in extra:
        req = Requirement(line)
        assert req.specifier.contains(serve.get(canonicalize_name(req.name), "0"), prereleases=True), line
    for name, version in serve.items():
        if name in UNFROZEN:
            continue
        assert version == runtime.get(name), (
            f"{name}: {version} here, {runtime.get(name)} in requirements.lock"
        )
        dist = metadata.distribution(name)  # .venv holds requirements.lock's versions
        assert Version(dist.version).public == version, f"{name} {dist.version} is installed, not {version}"
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                pinned = serve.get(canonicalize_name(req.name))
                assert pinned and req.specifier.contains(pinned, prereleases=True), (
                    f"{name} needs {req}: requirements-serve.lock pins {pinned}"
                )
