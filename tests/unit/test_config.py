from pathlib import Path

import pytest

from lmops.errors import LmopsError
from lmops.pipeline.params import Params, load_params, parse_params, update_params

REPO = Path(__file__).resolve().parents[2]


def test_repo_params_are_valid_and_complete():
    params = load_params(REPO / "params.yaml")
    assert params.data.source == "python-stdlib"
    # Every section and key of the schema is spelled out in params.yaml (DVC tracks them by name).
    import yaml

    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    for section, model in Params.model_fields.items():
        assert set(raw[section]) == set(model.annotation.model_fields), section


def test_schema_defaults_are_the_repo_params():
    # A default in params.py that differed from params.yaml would mislead whoever reads it.
    assert parse_params({}) == load_params(REPO / "params.yaml")


def test_unknown_key_is_named_with_a_suggestion():
    with pytest.raises(LmopsError, match=r"unknown key 'train.max_step' \(did you mean 'max_steps'\?\)"):
        parse_params({"train": {"max_step": 10}})


def test_unknown_section_is_named():
    with pytest.raises(LmopsError, match="unknown key 'trian'.*did you mean 'train'"):
        parse_params({"trian": {}})


def test_wrong_type_names_key_and_expected_type():
    with pytest.raises(LmopsError, match=r"'train.max_steps'.*expected int, got 'many'"):
        parse_params({"train": {"max_steps": "many"}})


def test_scientific_notation_without_dot_is_caught():
    # YAML 1.1 reads 3e-3 as a string: we say so instead of training with a string.
    with pytest.raises(LmopsError, match="'train.learning_rate'.*expected float, got '3e-3'"):
        parse_params({"train": {"learning_rate": "3e-3"}})


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"model": {"n_embd": 100, "n_head": 6}}, "divisible by n_head"),
        ({"model": {"n_head": 6, "n_kv_heads": 4}}, "divisible by n_kv_heads"),
        ({"split": {"val_fraction": 0.6, "test_fraction": 0.5}}, "nothing left to train on"),
        ({"tokenizer": {"vocab_size": 100}}, "tokenizer.vocab_size"),
        ({"train": {"min_lr": 1.0, "learning_rate": 0.1}}, "must not exceed learning_rate"),
        ({"train": {"device": "tpu"}}, "one of 'auto', 'cpu', 'cuda'"),
        ({"train": {"optimizer": "sgd"}}, r"'train.optimizer'.*one of 'adamw', 'muon', got 'sgd'\)$"),
        ({"train": {"optimizer": "Muon"}}, r"'train.optimizer'.*got 'Muon'; did you mean 'muon'\?\)"),
        ({"train": {"lr_schedule": "wds"}}, r"'train.lr_schedule'.*got 'wds'; did you mean 'wsd'\?\)"),
        (
            {"train": {"lr_schedule": "wsd", "max_steps": 100, "warmup_steps": 40, "cooldown_fraction": 0.7}},
            r"^params.yaml: 'train.cooldown_fraction': .*the wsd cooldown \(0.7 x max_steps = 70 steps\) "
            r"and warmup_steps \(40\) are longer than max_steps \(100\)",
        ),
        ({"data": {"sha256": "xyz"}}, "data.sha256"),
        ({"split": {"test_fraction": 0.0}}, r"'split.test_fraction': Input should be greater than 0"),
        ({"split": {"method": "last"}}, "one of 'random', 'tail'"),
        (
            {"data": {"document_unit": "sentence"}},
            "one of 'auto', 'file', 'row', 'paragraph', 'line', 'chunk'",
        ),
        ({"data": {"format": "xml"}}, "'data.format'"),
    ],
)
def test_invalid_values(raw, needle):
    with pytest.raises(LmopsError, match=needle):
        parse_params(raw)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(LmopsError, match="params file not found"):
        load_params(tmp_path / "nope.yaml")
    bad = tmp_path / "params.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(LmopsError, match="not valid YAML"):
        load_params(bad)
    bad.write_text("- just a list\n")
    with pytest.raises(LmopsError, match="expected a mapping"):
        load_params(bad)


def test_deprecated_block_size_reads_as_max_seq_len(caplog):
    params = parse_params({"model": {"block_size": 128}})
    assert params.model.max_seq_len == 128
    assert "model.block_size is deprecated" in caplog.text


def test_block_size_and_max_seq_len_together_is_an_error():
    with pytest.raises(LmopsError, match="max_seq_len only"):
        parse_params({"model": {"block_size": 128, "max_seq_len": 128}})


def test_update_params_sets_dotted_keys_and_writes_nothing_when_the_result_is_invalid(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("train:\n  max_steps: 10\n")
    params = update_params(path, {"train.muon_lr": 0.01, "model.n_layer": 2})
    assert (params.train.muon_lr, params.train.max_steps, params.model.n_layer) == (0.01, 10, 2)
    assert load_params(path) == params
    before = path.read_text()
    for updates, message in (
        ({"train.max_steps": 0}, r"params.yaml with train.max_steps=0: 'train.max_steps'"),
        ({"train.muon_lrr": 1}, r"unknown key 'train.muon_lrr' \(did you mean 'muon_lr'\?\)"),
        ({"muon_lr": 1}, r"'muon_lr' is not SECTION.KEY"),
        ([["train.muon_lr", 1]], r"expected a JSON object of SECTION.KEY values"),
    ):
        with pytest.raises(LmopsError, match=message):
            update_params(path, updates)
        assert path.read_text() == before
    assert update_params(path, {}) == params and path.read_text() == before  # a step without overrides
