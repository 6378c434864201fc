"""docs/architecture.md stays true: every file, directory and module it names exists, every
pipeline output it names is one dvc.yaml declares; and no file of the repository refers to
a document the repository does not hold."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

ARCHITECTURE = REPO / "docs" / "architecture.md"
SOURCE_DIRS = (REPO / "src", REPO / "production_service")


def tracked_files() -> list[str]:
    return subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()


def expand(token: str) -> list[str]:
    """`data/raw/{a,b}.txt` -> the paths it stands for."""
    match = re.search(r"\{([^}]*)\}", token)
    if not match:
        return [token]
    return [
        p for alt in match[1].split(",") for p in expand(token[: match.start()] + alt + token[match.end() :])
    ]


KINDS = ("deps", "outs", "metrics")


def dvc_paths(dvc_yaml: Path = REPO / "dvc.yaml") -> set[str]:
    stages = yaml.safe_load(dvc_yaml.read_text())["stages"].values()
    entries = [e for s in stages for key in KINDS for e in s.get(key, [])]
    return {next(iter(e)) if isinstance(e, dict) else e for e in entries}


# In code blocks (the diagrams) a word names a path when it starts with one of these or is a .py file.
TREES = ("src/", "production_service/", "deploy/", "kubeflow/", "tests/", "benchmarks/", "docs/")


def named_paths(text: str) -> list[str]:
    """The code spans that name a path (a slash or a file suffix), and the diagrams' words
    that do; placeholders left out."""
    fenced = re.findall(r"^```\w*\n(.*?)^```", text, re.M | re.S)
    prose = re.sub(r"^```\w*\n.*?^```", "", text, flags=re.M | re.S)
    spans = [s for s in re.findall(r"`([^`\s]+)`", prose) if re.search(r"/|\.\w+$", s)]
    words = [w.strip("(),;:") for block in fenced for w in block.split()]
    spans += [w for w in words if w.startswith(TREES) or re.fullmatch(r"[\w.]+\.py", w)]
    return [p for s in spans if "<" not in s for p in expand(s.rstrip("/"))]


def is_output(path: str) -> bool:
    return path.startswith(("data/", "artifacts/")) or path.split("/")[:2] == ["production_service", "model"]


def missing(text: str, produced: set[str]) -> list[str]:
    """Names in `text` that are neither in the repository nor outputs the pipeline declares."""
    sources = {p.name for d in SOURCE_DIRS for p in d.rglob("*.py")}
    bad = []
    for path in named_paths(text):
        if is_output(path):
            if not any(path == p or path.startswith(p + "/") or p.startswith(path + "/") for p in produced):
                bad.append(path)
        elif "/" in path:
            if not (REPO / path).exists():
                bad.append(path)
        elif path.endswith(".py") and path not in sources:  # a module named by its file
            bad.append(path)
    return bad


def test_the_check_can_fail():
    text = (
        "`src/lmops/runtime/gone.py`, `artifacts/nowhere.json`, `vanished.py`, `data/raw/{corpus,lost}.txt`"
    )
    text += (
        ", `production_service/model_source.py`\n```\nproduction_service/absent.py (lost.py; /v1/*)\n```\n"
    )
    assert missing(text, dvc_paths()) == [
        "src/lmops/runtime/gone.py",
        "artifacts/nowhere.json",
        "vanished.py",
        "data/raw/lost.txt",
        "production_service/absent.py",
        "lost.py",
    ]


def stage_table(text: str) -> dict[str, tuple[set[str], set[str]]]:
    """stage -> (the files its row says it reads, the files it says it writes)."""
    rows = re.findall(r"^\| (\w+) \| [^|]* \|([^|]*)\|([^|]*)\|$", text, re.M)
    return {
        stage: tuple({p for p in named_paths(cell) if is_output(p)} for cell in cells)
        for stage, *cells in rows
        if stage != "stage"
    }


def dvc_stage_files(dvc_yaml: Path = REPO / "dvc.yaml") -> dict[str, tuple[set[str], set[str]]]:
    """stage -> (its deps, its outs and metrics), as dvc.yaml declares them."""
    files = {}
    for stage, spec in yaml.safe_load(dvc_yaml.read_text())["stages"].items():
        named = [{next(iter(e)) if isinstance(e, dict) else e for e in spec.get(k, [])} for k in KINDS]
        files[stage] = (named[0], named[1] | named[2])
    return files


def test_the_stage_table_is_dvc_yaml():
    text = ARCHITECTURE.read_text()
    assert stage_table(text) == dvc_stage_files()
    dropped = text.replace(", `artifacts/promotion_slices.csv` |", " |")
    assert stage_table(dropped)["promote"][1] == {
        "artifacts/promotion.json",
        "artifacts/promotion_metrics.json",
    }  # a row that drops an output differs


def test_everything_the_architecture_names_exists():
    text = ARCHITECTURE.read_text()
    assert len(named_paths(text)) > 40  # it names the parts, and the check read them
    assert missing(text, dvc_paths() | {"production_service/model"}) == []


def test_the_readme_links_the_architecture():
    assert "(docs/architecture.md)" in (REPO / "README.md").read_text()


@pytest.mark.parametrize(
    "doc", ["README.md", "docs/architecture.md", "docs/deploy.md", "benchmarks/README.md"]
)
def test_relative_links_resolve(doc):
    path = REPO / doc
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text())
    broken = [t for t in targets if "://" not in t and not (path.parent / t).exists()]
    assert not broken, f"{doc} links to {broken}"


def dangling_documents(files: dict[str, str], produced: set[str]) -> list[tuple[str, str]]:
    """(file, name) for every Markdown document a file names that the repository does not
    hold: not a tracked document (by path, or by name), not a pipeline output, not a file
    the naming file makes itself (a test's fixture, written as a string literal)."""
    held = {f for f in files if f.endswith(".md")} | {p for p in produced if p.endswith(".md")}
    names = {Path(f).name for f in held}
    bad = []
    for file, text in files.items():
        for doc in set(re.findall(r"[\w./-]*\w\.md(?![\w.])", text)):
            here = str(Path(file).parent / doc)
            if doc in held or here in held or ("/" not in doc and doc in names) or f'"{doc}"' in text:
                continue
            bad.append((file, doc))
    return sorted(bad)


def test_no_file_refers_to_a_document_the_repository_does_not_hold():
    files = {}
    for f in tracked_files():
        if f.startswith("deploy/schemas/") or f.endswith((".html", ".lock")):  # upstream or generated text
            continue
        try:
            files[f] = (REPO / f).read_text()
        except (UnicodeDecodeError, FileNotFoundError):
            continue
    assert "docs/architecture.md" in files or ARCHITECTURE.exists()
    produced = dvc_paths()
    assert dangling_documents({"x.py": "see DESIGN.md and docs/gone.md", "README.md": ""}, produced) == [
        ("x.py", "DESIGN.md"),
        ("x.py", "docs/gone.md"),
    ]
    assert dangling_documents(files, produced) == []
