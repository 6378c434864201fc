"""The Dockerfile and its build context: hadolint, the promised properties, .dockerignore."""

from __future__ import annotations

import re
import subprocess

import yaml

from tests.deploy.conftest import REPO, tool

DOCKERFILE = (REPO / "Dockerfile").read_text()


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
    images = [f.split()[0] for f in froms if not f.startswith("base-")]
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
    assert any(op == "COPY" and "requirements.lock" in args for op, args in steps)
    assert any(op == "RUN" and "-r requirements.lock" in args for op, args in steps)
    assert any(op == "COPY" and args.startswith("production_service/") for op, args in runtime)


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
        "tests/unit/test_model.py",
    ]:
        assert dockerignored(path, patterns), f"{path} would be sent to the docker build"
    for path in [
        "requirements.lock",
        "pyproject.toml",
        "README.md",
        "params.yaml",
        "src/lmops/cli.py",
        "production_service/app.py",
        "production_service/gunicorn.conf.py",
        "production_service/model/config.json",
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
