#!/usr/bin/env python3
"""Check the monitoring files, each problem as `file:line: message`, and generate the
PrometheusRule of the kustomize component from rules.yml (the one source of the rules).

    python deploy/monitoring/check.py [METRICS_URL]          rules (promtool) + dashboard queries
                                                             (with a service's /metrics URL: and the
                                                             metric names the queries read)
    python deploy/monitoring/check.py --write-prometheusrule  regenerate kubernetes/prometheusrule.yaml

Needs `promtool` (Debian's prometheus package: `make monitoring-tools`).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
RULES = HERE / "rules.yml"
DASHBOARD = HERE / "grafana" / "lmops.json"
PROMETHEUSRULE = HERE / "kubernetes" / "prometheusrule.yaml"
# What Grafana substitutes in the dashboard's queries, for checking them outside Grafana.
DASHBOARD_VARIABLES = {"$__rate_interval": "1m", "$job": ".*"}

_STRIP = (
    r'"(?:[^"\\]|\\.)*"',  # strings (label values, regexes)
    r"'(?:[^'\\]|\\.)*'",
    r"\{[^}]*\}",  # label matchers
    r"\[[^\]]*\]",  # ranges and subqueries
    r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)",  # label lists
    r"\boffset\s+-?\w+",
)
_KEYWORDS = {"and", "or", "unless", "bool", "by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS |= {"inf", "nan", "offset"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (not functions, labels or keywords)."""
    for pattern in _STRIP:
        expr = re.sub(pattern, " ", expr)
    names = set()
    for m in re.finditer(r"(?<![\w.:])[A-Za-z_:][\w:]*", expr):
        if not re.match(r"\s*\(", expr[m.end() :]) and m.group().lower() not in _KEYWORDS:
            names.add(m.group())
    return names


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        raise FileNotFoundError("promtool is not installed: run `make monitoring-tools`")
    return path


def rule_lines(path: Path) -> dict[tuple[str, int], int]:
    """(group name, 1-based rule index) -> the line the rule starts on."""
    root = yaml.compose(path.read_text())
    lines = {}
    groups = next((v for k, v in getattr(root, "value", []) if k.value == "groups"), None)
    for group in getattr(groups, "value", []):
        fields = {k.value: v for k, v in group.value}
        name = getattr(fields.get("name"), "value", "")
        for i, rule in enumerate(getattr(fields.get("rules"), "value", []), 1):
            lines[(name, i)] = rule.start_mark.line + 1
    return lines


def check_rules(path: Path) -> list[str]:
    """promtool's verdict on a rules file, each problem located by line."""
    try:
        yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        return [f"{path}:{mark.line + 1 if mark else 1}: not YAML: {getattr(exc, 'problem', exc)}"]
    proc = subprocess.run(
        [promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    if proc.returncode == 0:
        return []
    lines, problems = rule_lines(path), []
    for raw in (proc.stdout + proc.stderr).splitlines():
        msg = raw.strip()
        if not msg or msg.startswith(("Checking", "FAILED", "SUCCESS")):
            continue
        msg = msg.removeprefix(f"{path}:").strip()
        line = 1
        if m := re.match(r"(\d+):\d+: ", msg):
            line = int(m[1])
        elif m := re.search(r'group "([^"]*)", rule (\d+)', msg):
            line = lines.get((m[1], int(m[2])), 1)
        elif m := re.search(r"\bline (\d+)", msg):
            line = int(m[1])
        problems.append(f"{path}:{line}: {msg}")
    return problems or [f"{path}:1: promtool check rules failed: {proc.stdout}{proc.stderr}"]


def dashboard_queries(path: Path) -> list[tuple[int, str, str]]:
    """(line, panel title, expr) of every panel target, nested rows included."""
    text = path.read_text()
    dash = json.loads(text)
    panels = list(dash.get("panels", []))
    for row in list(panels):
        panels.extend(row.get("panels", []))
    out = []
    for panel in panels:
        for target in panel.get("targets", []):
            expr = target.get("expr", "")
            at = text.find(f'"expr": {json.dumps(expr)}')
            out.append((text.count("\n", 0, max(at, 0)) + 1, panel.get("title", "?"), expr))
    return out


def expand(expr: str) -> str:
    for name, value in DASHBOARD_VARIABLES.items():
        expr = expr.replace(name, value)
    return expr


def check_dashboard(path: Path, known_metrics: set[str] | None) -> list[str]:
    """Every panel query parses (promtool) and reads only `known_metrics` (unless None)."""
    try:
        queries = dashboard_queries(path)
    except json.JSONDecodeError as exc:
        return [f"{path}:{exc.lineno}: not JSON: {exc.msg}"]
    problems = []
    for line, title, expr in queries:
        if not expr.strip():
            problems.append(f"{path}:{line}: panel {title!r} has a target without a query")
        elif known_metrics is not None and (unknown := metric_names(expand(expr)) - known_metrics):
            problems.append(
                f"{path}:{line}: panel {title!r} reads metrics nothing exports: {sorted(unknown)}"
            )
    # Parse them all with promtool, as recording rules of a scratch file.
    parsable = [(line, title, expand(e)) for line, title, e in queries if e.strip()]
    rules = [{"record": f"panel:q{i}", "expr": e} for i, (_, _, e) in enumerate(parsable)]
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp) / "dashboard-queries.yml"
        scratch.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
        for problem in check_rules(scratch):
            found = re.search(r'"panel:q(\d+)"', problem)
            line, title, _ = parsable[int(found[1])] if found else (1, "?", "")
            problems.append(f"{path}:{line}: panel {title!r}: {problem.split(': ', 1)[1]}")
    return problems


def exported_names(metrics_text: str) -> set[str]:
    """Sample names in a Prometheus text exposition (what a scrape stores)."""
    return {line.split("{")[0].split()[0] for line in metrics_text.splitlines() if line and line[0] != "#"}


def recorded_names(path: Path = RULES) -> set[str]:
    return {
        r["record"] for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"] if "record" in r
    }


def prometheus_rule(path: Path = RULES) -> dict:
    """rules.yml as a prometheus-operator PrometheusRule (the kustomize component's)."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "lmops", "namespace": "lmops", "labels": {"app.kubernetes.io/name": "lmops"}},
        "spec": yaml.safe_load(path.read_text()),
    }


def render_prometheus_rule() -> str:
    header = "# Generated from deploy/monitoring/rules.yml by `python deploy/monitoring/check.py --write-prometheusrule`.\n"
    return header + yaml.safe_dump(prometheus_rule(), sort_keys=False, width=1000)


def main(argv: list[str]) -> int:
    if argv == ["--write-prometheusrule"]:
        PROMETHEUSRULE.write_text(render_prometheus_rule())
        print(f"wrote {PROMETHEUSRULE}")
        return 0
    if len(argv) > 1 or argv and argv[0].startswith("-"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    known = None
    if argv:
        with urllib.request.urlopen(argv[0], timeout=10) as response:
            known = exported_names(response.read().decode()) | recorded_names()
    problems = check_rules(RULES) + check_dashboard(DASHBOARD, known)
    if PROMETHEUSRULE.read_text() != render_prometheus_rule():
        problems.append(
            f"{PROMETHEUSRULE}:1: out of date: run `python {Path(__file__).name} --write-prometheusrule`"
        )
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
