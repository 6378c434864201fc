"""Slices of the test split: get_data records each document's slice (promote.slice_by),
split turns the test split's into runs, evaluate cuts its units at them, and the gate
compares each slice on its own and names the worst."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from lmops.errors import LmopsError
from lmops.pipeline import data, gate
from lmops.pipeline.data import get_data, split
from lmops.pipeline.evaluate import split_units, unit_selection
from lmops.pipeline.params import DataConfig, EvaluateConfig, PromoteConfig, SplitConfig
from lmops.pipeline.promote import TAG_LIMIT, evidence_tag

CFG = PromoteConfig(min_slice_units=5)


def slices_of(raw: Path) -> list[str]:
    """Each document's slice, as get_data wrote them."""
    names = json.loads((raw / "slices.json").read_text())["slices"]
    return [names[c] for c in np.fromfile(raw / "doc_slices.bin", dtype="<u2")]


@pytest.fixture
def tree(tmp_path):
    """Two directories of two files each, a document per paragraph."""
    for rel in ("docs/a.md", "docs/b.txt", "src/c.py", "src/d.py"):
        (tmp_path / "tree" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "tree" / rel).write_text(f"{rel} one\n\n{rel} two\n")
    return tmp_path / "tree"


@pytest.mark.parametrize(
    "slice_by, expected",
    [
        ("directory", ["docs"] * 4 + ["src"] * 4),
        ("extension", [".md", ".md", ".txt", ".txt", ".py", ".py", ".py", ".py"]),
        ("path", [f"{p}" for p in ("docs/a.md", "docs/b.txt", "src/c.py", "src/d.py") for _ in "12"]),
        (None, [""] * 8),
    ],
)
def test_get_data_records_each_documents_slice(tree, tmp_path, slice_by, expected):
    cfg = DataConfig(source=str(tree), document_unit="paragraph")
    manifest = get_data(cfg, tmp_path / "raw", slice_by=slice_by)
    found = slices_of(tmp_path / "raw")
    root = str(tree) + "/"
    assert [s.removeprefix(root) if slice_by != "directory" else Path(s).name for s in found] == expected
    assert manifest["documents"] == 8
    assert json.loads((tmp_path / "raw/slices.json").read_text())["slice_by"] == slice_by


def test_a_rows_field_is_its_slice_in_every_table_format(tmp_path):
    rows = pd.DataFrame({"text": ["one", "two", "three"], "lang": ["en", "fr", None], "n": [1, 2, 3]})
    records = [
        {"text": t, "lang": g, "n": n} for t, g, n in zip(rows.text, ["en", "fr", None], rows.n, strict=True)
    ]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rows.fillna("").to_csv(tmp_path / "t.csv", index=False)
    rows.to_parquet(tmp_path / "t.parquet")
    for name, lang in (("t.jsonl", "null"), ("t.csv", ""), ("t.parquet", "null")):
        get_data(DataConfig(source=str(tmp_path / name)), tmp_path / f"raw-{name}", slice_by="field:lang")
        assert slices_of(tmp_path / f"raw-{name}") == ["en", "fr", lang]
    get_data(DataConfig(source=str(tmp_path / "t.jsonl")), tmp_path / "n", slice_by="field:n")
    assert slices_of(tmp_path / "n") == ["1", "2", "3"]


@pytest.mark.parametrize(
    "source, cfg, slice_by, needle",
    [
        ("t.jsonl", {}, "field:lang", "line 1 has no field 'lang' (promote.slice_by); its fields: text, tag"),
        ("t.jsonl", {}, "field:tag", "line 1: 'tag' is a dict, not a value to slice by"),
        ("t.jsonl", {"document_unit": "file"}, "field:text", "slices rows, but data.document_unit is file"),
        ("a.txt", {}, "field:lang", "promote.slice_by: field:lang needs a table (jsonl, csv, parquet)"),
        ("*.txt", {}, "path", "cuts the corpus into more than 2 slices"),
    ],
)
def test_a_slice_that_cannot_be_read_is_one_line_and_nothing_is_written(
    tmp_path, monkeypatch, source, cfg, slice_by, needle
):
    monkeypatch.setattr(data, "MAX_SLICES", 2)
    (tmp_path / "t.jsonl").write_text(json.dumps({"text": "x", "tag": {"a": 1}}) + "\n")
    for name in ("a.txt", "b.txt", "c.txt"):
        (tmp_path / name).write_text(f"{name}\n")
    with pytest.raises(LmopsError, match="^[^\n]*$") as err:
        get_data(DataConfig(source=str(tmp_path / source), **cfg), tmp_path / "raw", slice_by=slice_by)
    assert needle in str(err.value)
    assert not (tmp_path / "raw").exists()


def split_with_slices(tmp_path: Path, n_docs: int = 60) -> Path:
    """get_data and split of a tree of three directories, sliced by directory."""
    for i in range(n_docs):
        path = tmp_path / "tree" / "abc"[i % 3] / f"{i:03d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(f"{'abc'[i % 3]} document {i} line {j}\n" for j in range(40)))
    get_data(DataConfig(source=str(tmp_path / "tree")), tmp_path / "raw", slice_by="directory")
    split(SplitConfig(test_fraction=0.3), 16, tmp_path / "raw", tmp_path / "out", tmp_path / "report.json")
    return tmp_path / "out"


def test_the_test_splits_runs_tile_it_and_units_never_cross_them(tmp_path):
    out = split_with_slices(tmp_path)
    found = json.loads((out / "test_slices.json").read_text())
    assert found["slice_by"] == "directory" and [Path(s).name for s in found["slices"]] == ["a", "b", "c"]
    test = (out / "test.txt").read_bytes()
    ends = [end for end, _ in found["runs"]]
    assert ends == sorted(ends) and ends[-1] == len(test)
    start = 0
    for end, code in found["runs"]:  # every line of a run is of its slice's documents
        lines = test[start:end].decode().split()
        assert {line[0] for line in lines if line.startswith(tuple("abc"))} == {"abc"[code]}
        start = end

    runs = [(end, found["slices"][code]) for end, code in found["runs"]]
    units = list(split_units(out / "test.txt", 700, runs))
    assert "".join(u.text for u in units).encode() == test
    for u in units:  # one slice a unit, the slice its lines are of
        assert {line[0] for line in u.text.splitlines() if line} == {Path(u.slice).name}
    assert len(units) > len(list(split_units(out / "test.txt", 700)))  # the runs cut more units


def test_the_unit_key_changes_with_the_slicing(tmp_path):
    out = split_with_slices(tmp_path)
    cfg = EvaluateConfig(unit_bytes=700)
    sliced = unit_selection(cfg, out)
    path = out / "test_slices.json"
    path.write_text(
        json.dumps({"slice_by": None, "slices": [""], "runs": [[len((out / "test.txt").read_bytes()), 0]]})
    )
    assert unit_selection(cfg, out).key != sliced.key
    path.write_text(json.dumps({"slice_by": None, "slices": [""], "runs": [[5, 0]]}))
    with pytest.raises(
        LmopsError, match="test_slices.json does not match .*test.txt: run `lmops split` again"
    ):
        unit_selection(cfg, out)
    path.write_text("{")
    with pytest.raises(LmopsError, match="test_slices.json is missing or damaged"):
        unit_selection(cfg, out)


def rows(rates: dict[str, np.ndarray], size: int = 1000) -> list[dict]:
    """Unit results: each slice's units at the given bits/byte."""
    found = []
    for name, values in rates.items():
        for r in values:
            unit = len(found)
            found.append(
                {
                    "unit": unit,
                    "offset": 0,
                    "tokens": 1,
                    "bytes": size,
                    "nll_bits": float(r * size),
                    "slice": name,
                }
            )
    return found


def test_one_slice_made_worse_is_named_and_blocks_while_the_whole_split_improves():
    rng = np.random.default_rng(0)
    champion = {
        "big": rng.uniform(1.5, 2.5, 300),
        "small": rng.uniform(1.5, 2.5, 30),
        "tiny": rng.uniform(1, 2, 3),
    }
    candidate = {
        "big": champion["big"] - 0.2 + rng.normal(0, 0.05, 300),
        "small": champion["small"] + 0.3 + rng.normal(0, 0.05, 30),  # worse beyond the 0.05 margin
        "tiny": champion["tiny"] + 5.0,  # far worse, but 3 units are too few to judge
    }
    overall = gate.paired_bootstrap(rows(candidate), rows(champion), 2000, 0.95, 1)
    assert gate.better(overall, CFG)[0]  # better on the whole split
    slices = gate.compare_slices(rows(candidate), rows(champion), CFG)
    assert [s.slice for s in slices] == ["small", "big", "tiny"]  # the regressed first, the unjudged last
    small, big, tiny = slices
    assert small.regressed and small.comparison.interval[0] > CFG.max_slice_regression
    assert not big.regressed and big.comparison.delta_bits_per_byte == pytest.approx(-0.2, abs=0.02)
    assert not tiny.judged and not tiny.regressed and tiny.units == 3
    ok, reason = gate.slices_hold(slices, CFG)
    assert not ok and reason.startswith("1 slice(s) worse beyond +0.05, the worst 'small' +0.3")
    assert "over 30 units" in reason
    assert small.as_dict()["interval"] == list(small.comparison.interval)


def test_noise_on_every_slice_blocks_nothing_and_without_a_champion_slices_are_reported():
    rng = np.random.default_rng(1)
    champion = {name: rng.uniform(1.5, 2.5, 60) for name in "abcdefgh"}
    noisy = {name: v + rng.normal(0, 0.05, len(v)) for name, v in champion.items()}
    slices = gate.compare_slices(rows(noisy), rows(champion), CFG)
    ok, reason = gate.slices_hold(slices, CFG)
    assert ok and reason.startswith("worst slice '") and reason.endswith("not all above +0.05")
    alone = gate.compare_slices(rows(noisy), None, CFG)
    assert all(s.comparison is None and not s.judged for s in alone) and len(alone) == 8
    assert gate.slices_hold(alone, CFG) == (True, "no slice has 5 units to judge")


def test_the_evidence_tag_is_whole_json_within_mlflows_limit():
    slices = [{"slice": f"dir/{i}", "units": 10, "interval": [0.1, 0.2]} for i in range(1000)]
    checks = [{"name": "mine", "passed": False, "message": "x" * 6000}]
    record = {"promoted": False, "reason": "r", "units": 5, "slices": slices, "checks": checks}
    for found in (record, {**record, "checks": []}, {**record, "reason": "é" * 9000}):
        text = evidence_tag(found)
        assert len(text) <= TAG_LIMIT and json.loads(text)["promoted"] is False
    assert "slices" not in json.loads(evidence_tag({**record, "checks": []}))
    assert json.loads(evidence_tag({**record, "checks": []}))["units"] == 5
    assert json.loads(evidence_tag(record))["checks"] == [{"name": "mine", "passed": False}]
