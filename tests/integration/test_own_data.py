"""A user's own corpus through the real pipeline: `dvc repro` on a line-per-record text
file and on a JSONL file, and every data error as one line from the `lmops` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmops.pipeline.sources import stdlib_files
from tests.conftest import BIN, make_project, run
from tests.integration.test_cli import assert_clean_error, lmops
from tests.integration.test_pipeline import ran_stages, registry


def stdlib_lines(max_bytes: int) -> list[str]:
    """Non-blank source lines of the standard library: a corpus with one record per line."""
    lines, size = [], 0
    for _, load in stdlib_files():
        for line in load().read().decode().splitlines():
            if line.strip():
                lines.append(line + "\n")
                size += len(line) + 1
                if size >= max_bytes:
                    return lines
    return lines


def repro_own_data(project) -> dict:
    out = run([str(BIN / "dvc"), "repro"], project).stdout
    assert ran_stages(out) == ["get_data", "split", "tokenize", "train", "evaluate", "promote"]
    report = json.loads((project / "artifacts/data_report.json").read_text())
    promotion = json.loads((project / "artifacts/promotion.json").read_text())
    data_run = registry(project).get_run(promotion["run_id"])
    assert data_run.data.metrics["data_documents"] == report["documents"]
    logged = registry(project).download_artifacts(promotion["run_id"], "data_report.json", str(project))
    assert json.loads(Path(logged).read_text()) == report  # the training run carries its data report
    shown = run([str(BIN / "dvc"), "metrics", "show", "--json"], project).stdout
    assert "duplicates_merged" in shown and "test_bits_per_byte" in shown
    return report


@pytest.mark.slow
def test_repro_on_a_line_per_record_text_file(tmp_path):
    corpus = tmp_path / "sentences.txt"
    corpus.write_text("".join(stdlib_lines(200_000)))  # no blank line anywhere
    project = make_project(
        tmp_path / "repo",
        {"data": {"source": str(corpus), "max_bytes": 120_000}, "split": {"method": "tail"}},
    )
    report = repro_own_data(project)
    assert report["document_unit"] == "chunk" and report["capped_at_max_bytes"]
    assert 120_000 - 4096 < report["bytes"] <= 120_000
    train = (project / "data/processed/train.txt").read_text()
    assert corpus.read_text().startswith(train)  # tail: train is the start of the file


@pytest.mark.slow
def test_repro_on_a_jsonl_file(tmp_path):
    corpus = tmp_path / "records.jsonl"
    lines = stdlib_lines(120_000)
    rows = [{"id": i, "text": "".join(lines[i::40])} for i in range(40)]
    rows.insert(5, {"id": -1, "text": rows[30]["text"]})  # an exact duplicate
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    project = make_project(tmp_path / "repo", {"data": {"source": str(corpus), "max_bytes": None}})
    report = repro_own_data(project)
    assert report["document_unit"] == "row" and report["documents"] == 41
    assert report["duplicates_merged"] == 1 and report["duplicates_dropped"] == 0
    assert sum(report["split"][s]["documents"] for s in ("train", "val", "test")) == 41


def write(path, text):
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("stage", "data", "split", "needle"),
    [
        ("get_data", lambda d: {"source": str(d / "nothing" / "*.txt")}, {}, "matched no files"),
        (
            "get_data",
            lambda d: {"source": write(d / "c.jsonl", '{"body": "x", "id": 1}\n')},
            {},
            "line 1 has no field 'text' (data.text_field); its fields: body, id",
        ),
        (
            "get_data",
            lambda d: {"source": write(d / "c.jsonl", '{"text": "x"}\n{"text": \n')},
            {},
            "c.jsonl: line 2 is not valid JSON",
        ),
        (
            "split",
            lambda d: {"source": write(d / "c.txt", "".join(f"record {i}\n" for i in range(20)))},
            {},
            "too small to train on: 190 bytes; the minimum is 3 splits x (model.max_seq_len + 2) = 198",
        ),
        (
            "split",
            lambda d: {
                "source": write(d / "c.txt", "".join(f"r{i} " * 30 + "\n" for i in range(30)) + "r0 " * 30)
            },
            {"method": "tail", "val_fraction": 0.1, "test_fraction": 0.02},
            "split 'test' would be empty",
        ),
    ],
)
def test_data_errors_are_one_line_and_leave_no_output(tmp_path, stage, data, split, needle):
    source = data(tmp_path)
    project = make_project(
        tmp_path / "repo",
        {"data": {"max_bytes": None, "document_unit": "line", **source}, "split": split},
        git=False,
    )
    if stage == "split":
        lmops(project, "get_data", check=True)
    assert_clean_error(lmops(project, stage), needle)
    produced = "data/raw/corpus.txt" if stage == "get_data" else "data/processed/train.txt"
    assert not (project / produced).exists() and not (project / "artifacts/data_report.json").exists()
