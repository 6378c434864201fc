"""The `lmops` command and template.py as a user meets them: clear one-line errors, no tracebacks."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.conftest import BIN, REPO, make_project, run


def lmops(project, *args, check=False):
    return run([str(BIN / "lmops"), *args], project, check=check)


def assert_clean_error(proc, *needles):
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    for needle in needles:
        assert needle in last, last


def test_mistyped_param_key(tmp_path):
    project = make_project(tmp_path, git=False)
    text = (project / "params.yaml").read_text().replace("max_steps:", "max_step:")
    (project / "params.yaml").write_text(text)
    assert_clean_error(lmops(project, "train"), "unknown key 'train.max_step'", "did you mean 'max_steps'")


def test_wrong_type_param(tmp_path):
    project = make_project(tmp_path, git=False)
    text = (project / "params.yaml").read_text().replace("vocab_size: 400", "vocab_size: lots")
    (project / "params.yaml").write_text(text)
    assert_clean_error(lmops(project, "tokenize"), "'tokenizer.vocab_size'", "expected int")


def test_stages_out_of_order_say_what_to_run(tmp_path):
    project = make_project(tmp_path, git=False)
    assert_clean_error(lmops(project, "split"), "run `lmops get_data` first")
    assert_clean_error(lmops(project, "tokenize"), "run `lmops split` first")
    assert_clean_error(lmops(project, "train"), "run `lmops tokenize` first")
    assert_clean_error(lmops(project, "evaluate"), "missing lmops.json")


def test_missing_source_and_non_utf8_corpus(tmp_path):
    project = make_project(
        tmp_path / "a", {"data": {"source": str(tmp_path / "nope.txt"), "max_bytes": None}}, git=False
    )
    assert_clean_error(lmops(project, "get_data"), "no such file")
    (tmp_path / "latin1.txt").write_bytes("café\n\nnaïve\n".encode("latin-1"))
    project = make_project(
        tmp_path / "b", {"data": {"source": str(tmp_path / "latin1.txt"), "max_bytes": None}}, git=False
    )
    assert_clean_error(lmops(project, "get_data"), "not UTF-8: byte 0xe9 at offset 3")
    assert not (project / "data/raw/corpus.txt").exists()


def test_generate_from_a_model_directory(tiny_model_dir, tmp_path):
    out = lmops(
        tmp_path,
        "generate",
        "--model",
        str(tiny_model_dir),
        "--prompt",
        "def f",
        "--max-tokens",
        "8",
        "--temperature",
        "0",
        check=True,
    )
    assert out.stdout.startswith("def f")
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.safetensors").unlink()
    assert_clean_error(
        lmops(tmp_path, "generate", "--model", str(broken), "--prompt", "x"), "missing model.safetensors"
    )


def test_template_creates_skeleton_idempotently_and_never_overwrites(tmp_path):
    first = subprocess.run(
        [sys.executable, str(REPO / "template.py"), str(tmp_path)], capture_output=True, text=True, check=True
    )
    assert "created data/raw/" in first.stdout and (tmp_path / "production_service/model").is_dir()
    (tmp_path / "data/raw/keep.txt").write_text("mine")
    second = subprocess.run(
        [sys.executable, str(REPO / "template.py"), str(tmp_path)], capture_output=True, text=True, check=True
    )
    assert "created" not in second.stdout.replace("0 created", "")
    assert (tmp_path / "data/raw/keep.txt").read_text() == "mine"


@pytest.mark.parametrize("stage", ["get_data", "split", "tokenize", "train", "evaluate", "promote"])
def test_every_stage_has_help(stage):
    assert run([str(BIN / "lmops"), stage, "--help"], REPO).returncode == 0
