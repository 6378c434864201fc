#!/usr/bin/env python3
"""Run the canary analysis of deploy/canary/analysistemplate.yaml against Prometheus
the way Argo Rollouts runs it: for the KServe canary on Kubeflow (no Argo Rollouts
there; deploy/kubeflow.sh) and for the tests that run the queries on a real Prometheus.

    python deploy/canary_analysis.py --prometheus URL --arg canary-hash=REV --arg stable-hash=REV
        --arg namespace=NS [--arg NAME=VALUE ...] [--count N] [--interval SECONDS]

Each metric's query gets the template's args (defaults, then --arg), and each result is
judged like Argo Rollouts does: Successful when successCondition holds, Failed when
failureCondition holds, Inconclusive when neither does (NaN: nothing to compare), Error
when Prometheus cannot answer; then failureLimit, inconclusiveLimit and
consecutiveErrorLimit decide the metric, and the worst metric decides the analysis.
Prints one line per measurement and the verdict. Exit status: 0 Successful (promote),
1 Failed (roll back), 3 Inconclusive or Error (do not promote).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from lmops import prometheus as prometheus_api

TEMPLATE = Path(__file__).resolve().parent / "canary" / "analysistemplate.yaml"
# Argo Rollouts' order: a worse phase wins.
PHASES = ["Successful", "Inconclusive", "Error", "Failed"]
EXIT = {"Successful": 0, "Failed": 1, "Inconclusive": 3, "Error": 3}


@dataclass
class Metric:
    name: str
    query: str
    success: str
    failure: str
    count: int
    interval: float  # seconds
    failure_limit: int
    inconclusive_limit: int
    consecutive_error_limit: int


def substitute(text: str, args: dict[str, str]) -> str:
    """{{args.NAME}} -> its value; an arg without one is an error."""

    def value(match: re.Match) -> str:
        name = match.group(1)
        if args.get(name) is None:
            raise SystemExit(f"error: the analysis needs --arg {name}=...")
        return args[name]

    return re.sub(r"\{\{\s*args\.([\w-]+)\s*\}\}", value, text)


def seconds(duration: str) -> float:
    """An Argo duration ("30s", "1m", "1h") in seconds."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(s|m|h)", duration)
    if match is None:
        raise SystemExit(f"error: not a duration: {duration!r}")
    return float(match.group(1)) * {"s": 1, "m": 60, "h": 3600}[match.group(2)]


def load(template_file: Path, given: dict[str, str]) -> list[Metric]:
    spec = yaml.safe_load(template_file.read_text())["spec"]
    args = {a["name"]: a.get("value") for a in spec.get("args", [])}
    unknown = set(given) - set(args)
    if unknown:
        raise SystemExit(f"error: the template has no arg {', '.join(sorted(unknown))}")
    args.update(given)
    return [
        Metric(
            name=m["name"],
            query=substitute(m["provider"]["prometheus"]["query"], args),
            success=substitute(m["successCondition"], args),
            failure=substitute(m["failureCondition"], args),
            count=int(m.get("count", 1)),
            interval=seconds(m.get("interval", "1m")),
            failure_limit=int(m.get("failureLimit", 0)),
            inconclusive_limit=int(m.get("inconclusiveLimit", 0)),
            consecutive_error_limit=int(m.get("consecutiveErrorLimit", 4)),
        )
        for m in spec["metrics"]
    ]


def query(prometheus: str, promql: str, timeout: float = 20) -> list[float]:
    """An instant query's vector (or scalar) as floats; OSError when Prometheus cannot answer."""
    return [value for _, value in prometheus_api.query(prometheus, promql, timeout)]


def judge(metric: Metric, result: list[float]) -> str:
    """One measurement's phase. The conditions are Argo's expr language in the subset
    that reads the same in Python (result[0] <= 0.01, isNaN(...))."""
    scope = {"__builtins__": {}, "result": result, "isNaN": math.isnan}
    try:
        success, failure = eval(metric.success, scope), eval(metric.failure, scope)  # noqa: S307 (our template)
    except Exception:  # an empty result: result[0] fails, as in Argo Rollouts
        return "Error"
    return "Failed" if failure else "Successful" if success else "Inconclusive"


@dataclass
class Tally:
    failed: int = 0
    inconclusive: int = 0
    errors: int = 0  # consecutive
    taken: int = 0

    def add(self, metric: Metric, phase: str) -> str | None:
        """Count one measurement; the metric's phase once it is decided, else None."""
        self.taken += 1
        self.errors = self.errors + 1 if phase == "Error" else 0
        self.failed += phase == "Failed"
        self.inconclusive += phase == "Inconclusive"
        if self.failed > metric.failure_limit:
            return "Failed"
        if self.errors > metric.consecutive_error_limit:
            return "Error"
        if self.inconclusive > metric.inconclusive_limit:
            return "Inconclusive"
        if self.taken == metric.count:
            return "Error" if self.errors else "Successful"
        return None


def analyse(metrics: list[Metric], prometheus: str) -> dict[str, str]:
    """Measure every metric once per interval (the shortest of them), in step, until
    each is decided."""
    interval = min(m.interval for m in metrics)
    tallies = {m.name: Tally() for m in metrics}
    decided: dict[str, str] = {}
    while len(decided) < len(metrics):
        if any(t.taken for t in tallies.values()):
            time.sleep(interval)
        for metric in metrics:
            if metric.name in decided:
                continue
            try:
                result = query(prometheus, metric.query)
                phase, shown = judge(metric, result), f"value {result}"
            except OSError as exc:
                phase, shown = "Error", f"Prometheus at {prometheus} did not answer: {exc}"
            tally = tallies[metric.name]
            print(f"  {metric.name} #{tally.taken + 1}: {phase}, {shown}", flush=True)
            outcome = tally.add(metric, phase)
            if outcome is not None:
                decided[metric.name] = outcome
                print(f"{metric.name}: {outcome}", flush=True)
    return decided


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prometheus", required=True, help="Prometheus base URL, e.g. http://127.0.0.1:9090")
    parser.add_argument("--template", type=Path, default=TEMPLATE)
    parser.add_argument("--arg", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--count", type=int, help="measurements per metric (default: the template's)")
    parser.add_argument(
        "--interval", type=float, help="seconds between measurements (default: the template's)"
    )
    options = parser.parse_args(argv)
    given = dict(a.split("=", 1) for a in options.arg if "=" in a)
    if len(given) != len(options.arg):
        parser.error("--arg takes NAME=VALUE")
    metrics = load(options.template, given)
    for metric in metrics:
        metric.count = options.count or metric.count
        metric.interval = metric.interval if options.interval is None else options.interval
    phases = analyse(metrics, options.prometheus)
    verdict = max(phases.values(), key=PHASES.index)
    print(f"analysis: {verdict}")
    if verdict in ("Inconclusive", "Error"):
        print("the analysis was inconclusive (no data to compare, or Prometheus unreachable): not promoting")
    return EXIT[verdict]


if __name__ == "__main__":
    sys.exit(main())
