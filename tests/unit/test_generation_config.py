"""generation_config.json's one owner (lmops.runtime.generation_config) and the one route
from it into SamplingParams (`SamplingParams.from_model_dir`) that every door takes."""

from __future__ import annotations

import json

import pytest

from lmops.errors import LmopsError
from lmops.runtime.engine import SamplingParams
from lmops.runtime.generation_config import GENERATION_DEFAULTS, GENERATION_FILE, default_sampling_fields


@pytest.fixture
def directory(tmp_path):
    """A model directory as far as sampling reads it: the written defaults."""
    (tmp_path / GENERATION_FILE).write_text(json.dumps({"eos_token_id": 2, **GENERATION_DEFAULTS}))
    return tmp_path


def test_the_file_translates_to_sampling_fields(directory):
    assert default_sampling_fields(directory) == {
        "temperature": GENERATION_DEFAULTS["temperature"],
        "top_k": GENERATION_DEFAULTS["top_k"],
        "top_p": GENERATION_DEFAULTS["top_p"],
        "max_tokens": GENERATION_DEFAULTS["max_new_tokens"],
    }


def test_merge_order_file_then_deployment_then_caller(directory):
    s = SamplingParams.from_model_dir(directory, {"temperature": 0.3, "max_new_tokens": 9}, max_tokens=4)
    assert (s.temperature, s.max_tokens, s.top_k, s.top_p) == (0.3, 4, 50, 0.95)
    assert SamplingParams.from_model_dir(directory, top_k=0).top_k == 0  # a falsy choice still wins
    assert s.seed is None  # a fresh draw unless the caller seeds it


def test_without_do_sample_the_model_is_greedy(directory):
    assert SamplingParams.from_model_dir(directory, {"do_sample": False}).greedy
    (directory / GENERATION_FILE).write_text('{"temperature": 0.7}')  # as transformers: greedy
    assert SamplingParams.from_model_dir(directory).greedy
    assert not SamplingParams.from_model_dir(directory, {"do_sample": True}).greedy
    assert SamplingParams.from_model_dir(directory, temperature=1.0).temperature == 1.0


def test_no_file_means_the_engine_defaults(tmp_path):
    """As vLLM's: no generation config, SamplingParams' own defaults (temperature 1)."""
    assert default_sampling_fields(tmp_path) == {}
    assert SamplingParams.from_model_dir(tmp_path) == SamplingParams()
    assert SamplingParams.from_model_dir(tmp_path, {"do_sample": False}).greedy


def test_an_invalid_value_is_one_error_naming_where_it_came_from(directory):
    with pytest.raises(LmopsError, match=r"^LMOPS_GENERATION_CONFIG: temperature must be"):
        SamplingParams.from_model_dir(directory, {"temperature": 5})
    with pytest.raises(LmopsError, match=r"^the sampling fields given: top_p must be"):
        SamplingParams.from_model_dir(directory, {"temperature": 0.5}, top_p=7.0)
    (directory / GENERATION_FILE).write_text('{"do_sample": true, "temperature": 5}')
    with pytest.raises(LmopsError, match=rf"^{directory / GENERATION_FILE}: temperature must be"):
        SamplingParams.from_model_dir(directory, {"temperature": 0.5})  # the file's, however overridden
    (directory / GENERATION_FILE).write_text("[1]")
    with pytest.raises(LmopsError, match=r"generation_config\.json: unreadable generation config"):
        default_sampling_fields(directory)
