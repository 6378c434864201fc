"""The model directory's one owner (lmops.runtime.model_dir): lmops.json's schema,
verification at load, export."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lmops.errors import LmopsError
from lmops.runtime.engine import LLMEngine, SamplingParams
from lmops.runtime.generation_config import GENERATION_DEFAULTS
from lmops.runtime.model import Llama
from lmops.runtime.model_dir import (
    CURRENT,
    META_FILE,
    MODEL_FILES,
    current,
    export,
    read_meta,
    require_meta,
    tidy,
    verify,
    weights_digest,
)
from tests.conftest import make_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    meta = {"run_id": "run-1", "metrics": {"val_loss": 2.5}}
    return make_tiny_model_dir(tmp_path_factory.mktemp("model-dir"), meta=meta)


@pytest.fixture
def copy(model_dir, tmp_path):
    return shutil.copytree(model_dir, tmp_path / "copy")


def test_written_meta_is_typed_and_records_the_weights(model_dir):
    meta = require_meta(model_dir)
    assert (meta.schema_version, meta.run_id, meta.metrics) == (1, "run-1", {"val_loss": 2.5})
    assert meta.weights_sha256 == weights_digest(model_dir)
    assert verify(model_dir) == meta


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "unreadable lmops.json"),
        ("[1, 2]", "not a JSON object"),
        ('{"run_id": 5}', "invalid run_id"),
        ('{"reference_bits_per_byte": 2.0}', "unknown key 'reference_bits_per_byte'"),
        ('{"schema_version": 9}', "schema_version 9 was written by a newer lmops"),
    ],
)
def test_a_corrupt_lmops_json_is_one_error_naming_the_file(copy, content, message):
    (copy / META_FILE).write_text(content)
    with pytest.raises(LmopsError) as exc:
        read_meta(copy)
    assert str(exc.value).startswith(f"{copy / META_FILE}:") and message in str(exc.value)
    with pytest.raises(LmopsError, match=message.split(" ")[0]):
        LLMEngine.from_pretrained(copy, device="cpu", compile=False)


def test_a_corrupt_generation_config_is_one_error_naming_the_file(copy):
    (copy / "generation_config.json").write_text('{"temperature": ')
    with pytest.raises(LmopsError, match=r"generation_config\.json: unreadable generation config"):
        verify(copy)
    (copy / "generation_config.json").write_text('{"do_sample": true, "temperature": -1}')
    with pytest.raises(LmopsError, match=r"generation_config\.json: temperature must be"):
        SamplingParams.from_model_dir(copy)


def test_weights_that_are_not_the_recorded_ones_are_refused(copy):
    weights = copy / "model.safetensors"
    state = load_file(str(weights))
    name = next(iter(state))
    state[name] = state[name] + 1e-3  # loads fine, but not the exported model
    save_file(state, str(weights))
    with pytest.raises(LmopsError, match="corrupt weights file .*weights_sha256"):
        Llama.from_pretrained(copy)


def test_weights_full_of_nan_are_refused_even_without_a_digest(copy):
    """4 KiB of 0xFF in the tensor data reads as NaN: it used to serve, empty completions."""
    (copy / META_FILE).unlink()
    weights = copy / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-4096:] = b"\xff" * 4096
    weights.write_bytes(bytes(raw))
    with pytest.raises(LmopsError, match="corrupt weights file .*NaN or infinite"):
        Llama.from_pretrained(copy)


def test_a_trained_model_samples_with_the_generation_defaults(model_dir):
    """What training writes into generation_config.json is what every door starts from."""
    s = SamplingParams.from_model_dir(model_dir)
    want = GENERATION_DEFAULTS
    assert (s.temperature, s.top_k, s.top_p, s.max_tokens) == (
        want["temperature"],
        want["top_k"],
        want["top_p"],
        want["max_new_tokens"],
    )
    assert s.seed is None  # a fresh draw unless the caller seeds it


def test_export_merges_facts_and_keeps_a_plain_directory_servable(model_dir, tmp_path):
    served = tmp_path / "served"
    merged = export(
        model_dir, served, model_name="lmops", model_version=3, metrics={"test_bits_per_byte": 2.0}
    )
    assert merged == read_meta(served)
    assert (merged.model_name, merged.model_version, merged.run_id) == ("lmops", 3, "run-1")
    assert merged.metrics == {"val_loss": 2.5, "test_bits_per_byte": 2.0}
    assert merged.reference_bits_per_byte == 2.0
    with pytest.raises(LmopsError, match="invalid model_version"):
        export(model_dir, tmp_path / "bad", model_version="three")
    assert not (tmp_path / "bad").exists()


EXPORT_STEPS = ("export.staged", "export.version_in_place", "export.flipped")


def export_killed_at(point: str, source, target, version: int) -> None:
    """`export` in a child process SIGKILLed at `point` (lmops.crash_points)."""
    code = (
        "import sys; from pathlib import Path; from lmops.runtime.model_dir import export; "
        "export(Path(sys.argv[1]), Path(sys.argv[2]), model_version=int(sys.argv[3]))"
    )
    env = {**os.environ, "LMOPS_TEST_SIGKILL_AT": point}
    proc = subprocess.run([sys.executable, "-c", code, str(source), str(target), str(version)], env=env)
    assert proc.returncode == -9, f"not killed at {point}"


def exported(target) -> tuple[int, list[str]]:
    """The version a reader gets (checked whole, as the service checks it at load), and
    the names in the export."""
    meta = verify(current(target))
    assert verify(target) == meta  # the top-level names show the same version
    return meta.model_version, sorted(p.name for p in target.iterdir())


@pytest.mark.parametrize("point", EXPORT_STEPS)
def test_an_export_killed_at_any_step_leaves_a_whole_model_and_the_next_one_tidies(
    model_dir, tmp_path, point
):
    """A bind mount (docker-compose's) holds the directory's inode: the export must never
    replace it (atomic.directory's rename swap left the mount on the deleted copy), and a
    promote killed midway must leave a servable model and no orphan copy."""
    served = tmp_path / "production_service" / "model"
    export(model_dir, served, model_version=1)
    (served.parent / ".model.4242.abcd1234.tmp").mkdir()  # what a killed pre-versioned export left
    inode, fd = served.stat().st_ino, os.open(served, os.O_RDONLY)  # what a bind mount pins
    try:
        export_killed_at(point, model_dir, served, 2)
        version, names = exported(served)
        assert version == (1 if point != "export.flipped" else 2)
        if point == "export.flipped":
            assert json.loads(Path(f"/proc/self/fd/{fd}/{META_FILE}").read_text())["model_version"] == 2
        export(model_dir, served, model_version=2)  # what `lmops promote`'s reconciliation does next
        version, names = exported(served)
        assert version == 2 and served.stat().st_ino == inode
        assert json.loads(Path(f"/proc/self/fd/{fd}/{META_FILE}").read_text())["model_version"] == 2
    finally:
        os.close(fd)
    [live] = [n for n in names if n.startswith(".v-")]
    assert names == sorted([CURRENT, live, META_FILE, *MODEL_FILES])  # one version, no leftovers
    assert all(os.readlink(served / n) == f"{CURRENT}/{n}" for n in (META_FILE, *MODEL_FILES))
    assert sorted(p.name for p in served.parent.iterdir()) == ["model"]


def test_tidy_finishes_a_flip_and_drops_what_the_new_version_lacks(model_dir, tmp_path):
    """A plain directory becomes an export in place, and a promote that died after the flip
    (the links not yet made) is finished by the next `lmops promote` (tidy), not redone."""
    served = shutil.copytree(model_dir, tmp_path / "model")
    (served / "notes.txt").write_text("an old export's extra file")
    export_killed_at("export.flipped", model_dir, served, 5)
    tidy(served)
    version, names = exported(served)
    assert version == 5 and "notes.txt" not in names and len([n for n in names if n.startswith(".v-")]) == 1
    assert all((served / n).is_symlink() for n in MODEL_FILES)


def test_a_plain_transformers_directory_serves(model_dir, tmp_path):
    """What transformers itself writes (no lmops.json, "bos_token_id": null, eos as a list)."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    hf.config.bos_token_id = None
    hf.config.eos_token_id = [2, 0]
    plain = tmp_path / "plain"
    hf.save_pretrained(plain)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(model_dir / name, plain / name)
    assert json.loads((plain / "config.json").read_text())["bos_token_id"] is None
    assert read_meta(plain) is None
    engine = LLMEngine.from_pretrained(plain, device="cpu", compile=False)
    assert engine.eos_token_ids == {0, 2}
    ours = LLMEngine.from_pretrained(model_dir, device="cpu", compile=False)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in engine.generate(["def f"], greedy)]
    assert got == [o.outputs[0].token_ids for o in ours.generate(["def f"], greedy)]
    assert torch.equal(engine.model.model.embed_tokens.weight, ours.model.model.embed_tokens.weight)
