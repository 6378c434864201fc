"""The Inference Gateway's endpoint picker reads lmops' load from /metrics by the names
deploy/gateway/epp-config.yaml declares: each must be in a real scrape of the live
server, or the picker routes blind (it logs and scores the pod as idle)."""

from __future__ import annotations

import re

import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.service.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

EPP_CONFIG = REPO / "deploy/gateway/epp-config.yaml"
SPEC_FIELDS = ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec", "cacheInfoSpec")
# llm-d-router's metric selector, name{label=value,...} (extractor/metrics/spec.go).
SPEC = re.compile(r"^\s*(\S+?)\s*(?:\{([^}]*)\})?\s*$")


def lmops_engine(config: dict) -> dict:
    (extractor,) = [p for p in config["plugins"] if p["type"] == "core-metrics-extractor"]
    params = extractor["parameters"]
    (engine,) = [e for e in params["engineConfigs"] if e["name"] == params["defaultEngine"] == "lmops"]
    return engine


def samples(scrape: str) -> list[tuple[str, dict[str, str]]]:
    return [(s.name, s.labels) for family in text_string_to_metric_families(scrape) for s in family.samples]


def missing(engine: dict, scraped: list[tuple[str, dict[str, str]]]) -> list[str]:
    """The engine's metric selectors that match no scraped sample."""
    out = []
    for field in SPEC_FIELDS:
        if not engine.get(field):
            continue
        name, labels = SPEC.match(engine[field]).groups()
        wanted = dict(pair.split("=", 1) for pair in labels.split(",")) if labels else {}
        wanted = {k.strip(): v.strip().strip('"') for k, v in wanted.items()}
        if not any(n == name and wanted.items() <= got.items() for n, got in scraped):
            out.append(engine[field])
    return out


@pytest.fixture(scope="module")
def scraped(server) -> list[tuple[str, dict[str, str]]]:
    return samples(requests.get(f"{server.probe_url}/metrics", timeout=5).text)


def test_every_metric_the_picker_reads_is_exported(scraped):
    engine = lmops_engine(yaml.safe_load(EPP_CONFIG.read_text()))
    assert {"queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheInfoSpec"} <= set(engine)
    assert missing(engine, scraped) == []
    # The check can fail: a misspelt name, or a label the series lacks.
    typo = {**engine, "kvUsageSpec": "lmops:kv_cache_usage_percent"}
    wrong_label = {**engine, "queuedRequestsSpec": "lmops:num_requests_waiting{model_name=x}"}
    assert missing(typo, scraped) == ["lmops:kv_cache_usage_percent"]
    assert missing(wrong_label, scraped) == ["lmops:num_requests_waiting{model_name=x}"]


def test_cache_info_carries_the_block_size_and_count_as_integers(scraped):
    """What the prefix-cache producer's autoTune reads (block_size, num_gpu_blocks labels)."""
    [labels] = [got for name, got in scraped if name == "lmops:cache_config_info"]
    assert int(labels["block_size"]) == 16 and int(labels["num_gpu_blocks"]) > 0
    assert labels["enable_prefix_caching"] == "True"
