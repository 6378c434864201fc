"""Instant PromQL queries against a Prometheus HTTP API (`/api/v1/query`): what the
promotion gate and the canary analysis read the live service's metrics with."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request


def query(prometheus: str, promql: str, timeout: float = 20) -> list[tuple[dict[str, str], float]]:
    """An instant query's vector as (labels, value) pairs, a scalar as one pair without
    labels; OSError, in one line, when Prometheus cannot answer or refuses the query."""
    url = f"{prometheus.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            body = json.load(response)
    except urllib.error.HTTPError as exc:
        raise OSError(
            f"Prometheus answered {exc.code}: {exc.read().decode(errors='replace')[:300]}"
        ) from None
    except (urllib.error.URLError, TimeoutError, json.JSONDecodeError) as exc:
        raise OSError(f"no answer from Prometheus at {prometheus}: {getattr(exc, 'reason', exc)}") from None
    data = body["data"]
    if data["resultType"] == "scalar":
        return [({}, float(data["result"][1]))]
    if data["resultType"] != "vector":
        raise OSError(f"Prometheus metric type not supported: {data['resultType']}")
    return [(sample["metric"], float(sample["value"][1])) for sample in data["result"]]
