"""Promotion: register every trained model; make it @champion only on evidence.

The gate (gate.py) compares the candidate with the champion on the same test units
(evaluate.py): the difference in bits/byte must be below -promote.min_improvement across
its whole paired-bootstrap interval; every behavioural check (checks.py) must pass; with
promote.max_latency_ratio set, the candidate must not be slower than that, both measured
side by side on one workload (latency.py); with promote.shadow_prometheus_url set, a
candidate all of that passes must also hold up against the champion on live prompts
(shadow.py): until enough of them were mirrored to it, it is made @challenger (which the
replicas' challenger follows) and waits for a later promote. The champion's unit results are reused when
its run logged them for the same units; otherwise it is scored on them first (the data or
the evaluation changed). The evidence goes to artifacts/promotion.json, its numbers to
artifacts/promotion_metrics.json (DVC metrics), the model version's tags and the run's
metrics. The winner is exported atomically to production_service/model.

Recoverable: moving the alias and exporting are two steps, and a process can
die between them, or inside the export. The export's lmops.json names the registry
version it holds, so every promote first tidies what a killed export left and
reconciles it with @champion (re-exporting when they differ), and exports a new
champion through the same reconciliation.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import tempfile
from pathlib import Path

from lmops import atomic, crash_points
from lmops.errors import LmopsError
from lmops.pipeline import checks, gate, latency, shadow, tracking
from lmops.pipeline.evaluate import (
    UnitSelection,
    fetch_units,
    file_sha256,
    log_units,
    read_units,
    score_model_dir,
    summarize,
    unit_selection,
    units_csv,
)
from lmops.pipeline.model_card import MODEL_CARD_FILE, mlflow_description, model_card, read_evidence
from lmops.pipeline.params import Params, PromoteConfig
from lmops.pipeline.paths import (
    MANIFEST_FILE,
    METRICS_FILE,
    MODEL_DIR,
    PROMOTION_FILE,
    PROMOTION_METRICS_FILE,
    PROMOTION_SLICES_FILE,
    UNITS_FILE,
)
from lmops.runtime.engine import LLMEngine
from lmops.runtime.model_dir import download, export, read_meta, require_meta, tidy

log = logging.getLogger(__name__)

METRIC = "test_bits_per_byte"


class ChampionUnavailable(LmopsError):
    """The champion cannot be downloaded, loaded or scored: the gate cannot judge, and only
    --force promotes (and records why there is no evidence)."""


def champion_units(
    params: Params, champion, champion_dir: Path, selection: UnitSelection
) -> tuple[list, str]:
    """The champion's results on the candidate's test units, and how we know them."""
    rows = fetch_units(champion.run_id, selection.key)
    if rows is not None:
        return rows, "measured on the same test units"
    try:
        rows = score_model_dir(champion_dir, selection, params.evaluate, params.train.device)
    except LmopsError as exc:
        raise ChampionUnavailable(f"the champion v{champion.version} cannot be scored: {exc}") from None
    with tempfile.TemporaryDirectory(prefix="lmops-champion-units-") as tmp:
        path = Path(tmp) / "units.csv"
        path.write_text(units_csv(rows), encoding="utf-8")
        log_units(champion.run_id, path, selection.key)
    client = tracking.client()  # the number the export carries as its drift reference
    client.set_model_version_tag(
        champion.name, champion.version, METRIC, str(summarize(rows)["bits_per_byte"])
    )
    client.set_model_version_tag(champion.name, champion.version, "test_split_sha256", selection.split_sha256)
    return rows, "scored on the current test units (the data or the evaluation changed)"


def corpus_is_code(params: Params) -> bool:
    """Whether code_compiles applies: the standard library, or mostly .py files."""
    if params.data.source == "python-stdlib":
        return True
    files = json.loads(MANIFEST_FILE.read_text()).get("files", []) if MANIFEST_FILE.is_file() else []
    return bool(files) and sum(str(f).endswith(".py") for f in files) * 2 >= len(files)


def judge(
    params: Params,
    model_dir: Path,
    champion,
    champion_dir: Path | None,
    selection: UnitSelection,
    candidate_rows: list,
    version: int | str,
) -> dict:
    """The gate's evidence: the paired comparison (with a champion), every check's result,
    the latency comparison, the live shadow comparison (with promote.shadow_prometheus_url);
    `passed` when all of them say promote."""
    cfg = params.promote
    checks.resolve(cfg.checks)  # a check that does not import stops before any work
    # Read first: a Prometheus that does not answer stops promote before the slow work.
    live = shadow.compare(cfg, version) if champion_dir and cfg.shadow_prometheus_url else None
    engine_args = {"device": params.train.device, "compile": False}
    candidate = LLMEngine.from_pretrained(model_dir, **engine_args)
    try:
        incumbent = LLMEngine.from_pretrained(champion_dir, **engine_args) if champion_dir else None
    except LmopsError as exc:
        raise ChampionUnavailable(f"the champion v{champion.version} cannot be loaded: {exc}") from None
    evidence: dict = {"rule": gate.rule(cfg), "min_improvement": cfg.min_improvement}
    reasons, passed = [], True
    champion_rows = None
    if champion_dir is not None:
        champion_rows, how = champion_units(params, champion, champion_dir, selection)
        comparison = gate.paired_bootstrap(
            candidate_rows, champion_rows, cfg.bootstrap_samples, cfg.confidence, cfg.seed
        )
        ok, why = gate.better(comparison, cfg)
        evidence.update(comparison.as_dict(), champion_version=int(champion.version))
        reasons.append(f"{why} (champion v{champion.version} {how})")
        passed &= ok
    if selection.slice_by is not None:
        slices = gate.compare_slices(candidate_rows, champion_rows, cfg)
        evidence.update(slice_by=selection.slice_by, slices=[s.as_dict() for s in slices])
        if champion_rows is not None:
            ok, why = gate.slices_hold(slices, cfg)
            evidence["worst_slice"] = next((s.slice for s in slices if s.judged), None)
            reasons.append(f"slices: {why}")
            passed &= ok
    context = checks.CheckContext(
        prompts=list(params.evaluate.prompts),
        max_new_tokens=params.evaluate.max_new_tokens,
        seed=params.evaluate.seed,
        code=corpus_is_code(params),
    )
    results = checks.run_checks(cfg.checks, candidate, incumbent, context)
    evidence["checks"] = [r.as_dict() for r in results]
    failed = [r for r in results if not r.passed]
    if failed:
        passed = False
        reasons.append("failed checks: " + "; ".join(f"{r.name} ({r.message})" for r in failed))
    if incumbent is not None:
        timing = latency.compare(candidate, incumbent)
        ok, why = latency.check_ratio(timing, cfg.max_latency_ratio)
        evidence["latency"] = timing
        if not ok:
            passed = False
            reasons.append(why)
    if live is not None:
        evidence["shadow"] = live
        if live["judged"]:
            passed &= live["passed"]
            reasons.append(f"live shadow: {live['reason']}")
        elif passed:  # every offline rule says promote: the live traffic has the last word
            passed, live["awaiting"] = False, True
            reasons.append(
                f"awaiting live evidence, v{version} is @{cfg.challenger_alias} meanwhile: {live['reason']}"
            )
        else:
            reasons.append(f"live shadow: {live['reason']}")
    evidence.update(passed=passed, reason="; ".join(reasons) or "no champion yet")
    return evidence


def fetch(champion, dst: Path) -> Path | None:
    """The champion's model directory, downloaded into `dst` (None when there is no champion)."""
    if champion is None:
        return None
    try:
        return download(f"models:/{champion.name}/{champion.version}", dst)
    except LmopsError as exc:
        raise ChampionUnavailable(f"the champion v{champion.version} cannot be downloaded: {exc}") from None


def exported_version(export_dir: Path) -> tuple[str, str] | None:
    """(model name, registry version) the export's lmops.json says it holds; None if unknown
    (no export, a plain or unregistered directory, or an lmops.json that does not parse:
    reconcile then replaces it with the champion)."""
    try:
        meta = read_meta(export_dir)
    except LmopsError as exc:
        log.warning("%s; replacing the export with @champion", exc)
        return None
    if meta is None or meta.model_name is None or meta.model_version is None:
        return None
    return meta.model_name, str(meta.model_version)


def reconcile(cfg: PromoteConfig, model_dir: Path, just_promoted: bool = False) -> None:
    """Make the export hold @champion: export it when the export holds anything else.

    The champion's files come from `model_dir` when that is the champion's run
    (the usual promotion), otherwise from the registry.
    """
    export_dir = Path(cfg.export_dir)
    if export_dir.is_dir():
        tidy(export_dir)  # whatever step an export was killed at
    champion = tracking.champion_version(cfg.model_name, cfg.alias)
    if champion is None:
        return
    held = exported_version(export_dir)
    if held == (cfg.model_name, str(champion.version)):
        return
    if held is not None or (export_dir.is_dir() and any(export_dir.iterdir())):  # template.py makes it empty
        what = f"{held[0]} v{held[1]}" if held else "an unknown model"
        # Right after the alias moved, the old champion is expected there; otherwise the export
        # was stale (a promotion killed between its steps, a deleted or hand-edited export).
        level = logging.INFO if just_promoted else logging.WARNING
        log.log(
            level, "%s holds %s, not @%s v%s: re-exporting", export_dir, what, cfg.alias, champion.version
        )
    tags = champion.tags or {}
    local = read_meta(model_dir)
    with tempfile.TemporaryDirectory(prefix="lmops-export-") as tmp:
        if local is None or local.run_id != champion.run_id:
            model_dir = download(f"models:/{cfg.model_name}/{champion.version}", Path(tmp))
        client = tracking.client()
        run = client.get_run(champion.run_id)
        metrics = {
            **(require_meta(model_dir).metrics),
            **{k: v for k, v in run.data.metrics.items() if k.startswith("test_")},
        }
        if METRIC in tags:  # the number promotion compared: the service's drift reference
            metrics.update({METRIC: float(tags[METRIC]), "test_split_sha256": tags.get("test_split_sha256")})
        facts = {
            "model_name": cfg.model_name,
            "model_version": int(champion.version),
            "run_id": champion.run_id,
            "metrics": metrics,
        }
        # The card, from what the registry and the run hold (training logs the data report
        # with the run), goes into the version before the flip and onto the registry version
        # first: a promote killed in between exports again, and writes both again.
        report = None
        if any(f.path == "data_report.json" for f in client.list_artifacts(champion.run_id)):
            path = client.download_artifacts(champion.run_id, "data_report.json", tmp)
            report = json.loads(Path(path).read_text())
        meta = require_meta(model_dir).model_copy(update=facts)
        card = model_card(meta, run.data.params, read_evidence(tags), report)
        client.update_model_version(cfg.model_name, champion.version, description=mlflow_description(card))
        export(model_dir, export_dir, extra_files={MODEL_CARD_FILE: card}, **facts)
    log.info("%s now holds %s v%s (@%s)", export_dir, cfg.model_name, champion.version, cfg.alias)


def promote(params: Params, force: bool = False, model_dir: Path = MODEL_DIR) -> dict:
    uri = tracking.tracking_uri(params.mlflow)
    with tracking.store_errors(uri):
        tracking.configure(params.mlflow)
        reconcile(params.promote, model_dir)
        return _promote(params, force, model_dir)


def _promote(params: Params, force: bool, model_dir: Path) -> dict:
    cfg = params.promote
    meta = require_meta(model_dir)
    if not METRICS_FILE.is_file():
        raise LmopsError(f"{METRICS_FILE} not found: run `lmops evaluate` first")
    metrics = json.loads(METRICS_FILE.read_text())
    run_id = meta.run_id
    if not run_id:
        raise LmopsError(f"{model_dir}/lmops.json has no run_id: the model was not trained with tracking")
    selection = unit_selection(params.evaluate)
    if metrics.get("test_split_sha256") != selection.split_sha256:
        raise LmopsError(f"{METRICS_FILE} was measured on another test split: run `lmops evaluate` again")
    if metrics.get("test_units_key") != selection.key:
        raise LmopsError(
            f"{METRICS_FILE} was measured on other test units (evaluate's params): run `lmops evaluate` again"
        )
    if not UNITS_FILE.is_file() or metrics.get("test_units_sha256") != file_sha256(UNITS_FILE):
        raise LmopsError(
            f"{UNITS_FILE} is not the one {METRICS_FILE} was measured with: run `lmops evaluate` again"
        )
    candidate_rows = read_units(UNITS_FILE)
    score = float(metrics[METRIC])

    champion = tracking.champion_version(cfg.model_name, cfg.alias)
    version = tracking.register(
        cfg.model_name,
        run_id,
        {
            METRIC: str(score),
            "test_split_sha256": selection.split_sha256,
            "data_sha256": str(meta.data_sha256),
        },
    )
    decision = {
        "model_name": cfg.model_name,
        "version": int(version.version),
        "run_id": run_id,
        "candidate_bits_per_byte": score,
        "champion_version": None,
        "champion_bits_per_byte": None,
    }
    is_champion = champion is not None and champion.version == version.version
    with tempfile.TemporaryDirectory(prefix="lmops-champion-") as tmp:
        try:
            evidence = (
                {}
                if is_champion
                else judge(
                    params,
                    model_dir,
                    champion,
                    fetch(champion, Path(tmp)),
                    selection,
                    candidate_rows,
                    version.version,
                )
            )
        except ChampionUnavailable as exc:
            if not force:
                raise
            log.warning("%s; --force promotes without the gate's evidence", exc)
            evidence = {"passed": False, "reason": str(exc)}
    decision.update(
        {k: evidence[k] for k in ("champion_version", "champion_bits_per_byte") if k in evidence},
        evidence={k: v for k, v in evidence.items() if k not in ("passed", "reason")},
    )
    if force:
        promoted, reason = (
            True,
            "forced with --force" + (f" (the gate said: {evidence['reason']})" if evidence else ""),
        )
    elif is_champion:  # e.g. a promotion killed after the alias moved, run again
        promoted, reason = False, f"v{version.version} is already @{cfg.alias}"
    else:
        promoted, reason = evidence["passed"], evidence["reason"]
    decision.update(promoted=promoted, reason=reason, alias=cfg.alias)
    other_data = (
        champion is not None
        and not is_champion
        and (champion.tags or {}).get("data_sha256") not in (None, str(meta.data_sha256))
    )
    if promoted and other_data:
        # Champions are scoped by promote.model_name: a new corpus under the same name
        # competes with (and here replaces) the model of the old one.
        log.warning(
            "v%s replaces @%s v%s, which was trained on other data (corpus sha256 %s..., now %s...); "
            "give each corpus its own promote.model_name to keep their champions apart",
            version.version,
            cfg.alias,
            champion.version,
            str(champion.tags.get("data_sha256"))[:12],
            str(meta.data_sha256)[:12],
        )
    decision["champion_trained_on_other_data"] = other_data
    numbers = gate_metrics(decision)

    client = tracking.client()
    if promoted or not is_champion:  # a rerun on the champion keeps the evidence that made it one
        client.set_model_version_tag(cfg.model_name, version.version, "promotion", reason)
        record = {**decision["evidence"], "promoted": promoted, "reason": reason}
        client.set_model_version_tag(
            cfg.model_name, version.version, "promotion_evidence", evidence_tag(record)
        )
        tracking.log_metrics(run_id, {f"gate_{k}": v for k, v in numbers.items()})
    if not promoted and decision["evidence"].get("shadow", {}).get("awaiting"):  # --force promotes it
        # The served challenger (LMOPS_CHALLENGER_URI=models:/<name>@<challenger_alias>)
        # follows the alias: the replicas start mirroring prompts to this version.
        client.set_registered_model_alias(cfg.model_name, cfg.challenger_alias, version.version)
    if promoted:
        client.set_registered_model_alias(cfg.model_name, cfg.alias, version.version)
        crash_points.reached("promote.alias_moved")
        reconcile(cfg, model_dir, just_promoted=True)
    atomic.write_json(PROMOTION_METRICS_FILE, numbers)
    atomic.write_text(PROMOTION_SLICES_FILE, slices_csv(decision))
    atomic.write_json(PROMOTION_FILE, decision)
    log.info("promotion: %s v%s: %s", "PROMOTED" if promoted else "kept champion", version.version, reason)
    return decision


def gate_metrics(decision: dict) -> dict[str, float | int]:
    """The decision's numbers, for `dvc metrics show` and the run's metrics."""
    evidence = decision["evidence"]
    numbers = {"promoted": int(decision["promoted"])}
    if "interval" in evidence:
        numbers.update(
            delta_bits_per_byte=evidence["delta_bits_per_byte"],
            interval_low=evidence["interval"][0],
            interval_high=evidence["interval"][1],
            units=evidence["units"],
        )
    if "checks" in evidence:
        numbers["checks_failed"] = sum(not c["passed"] for c in evidence["checks"])
    if "latency" in evidence:
        numbers["latency_ratio"] = evidence["latency"]["ratio"]
    if evidence.get("shadow", {}).get("judged"):
        numbers.update(
            shadow_delta_bits_per_byte=evidence["shadow"]["delta_bits_per_byte"],
            shadow_prompts=evidence["shadow"]["prompts"],
        )
    judged = [s for s in evidence.get("slices", []) if s["judged"]]
    if judged:
        numbers["worst_slice_delta"] = judged[0]["delta_bits_per_byte"]
        numbers["slices_regressed"] = sum(s["regressed"] for s in judged)
    return numbers


def slices_csv(decision: dict) -> str:
    """Candidate and champion bits/byte per slice (the DVC plot): one row per slice, by
    name; the champion's empty when there is none; the whole split when nothing is sliced."""
    evidence = decision["evidence"]
    slices = evidence.get("slices") or [
        {
            "slice": "(all)",
            "units": evidence.get("units", ""),
            "candidate_bits_per_byte": decision["candidate_bits_per_byte"],
            "champion_bits_per_byte": decision.get("champion_bits_per_byte"),
        }
    ]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["slice", "units", "candidate", "champion"])
    for s in sorted(slices, key=lambda s: s["slice"]):
        champion = s.get("champion_bits_per_byte")
        writer.writerow(
            [s["slice"], s["units"], s["candidate_bits_per_byte"], "" if champion is None else champion]
        )
    return out.getvalue()


TAG_LIMIT = 5000  # characters of a model version tag's value (MLflow's limit)


def evidence_tag(record: dict) -> str:
    """The evidence as one JSON tag within MLflow's limit. When it is too long, the per-slice
    rows go first, then the checks' messages, then all but the decision and its numbers; the
    reason is cut last. Always whole JSON: the model card parses it."""
    lean = {k: v for k, v in record.items() if k != "slices"}
    checks = [{k: c[k] for k in ("name", "passed")} for c in record.get("checks", [])]
    core = ("promoted", "reason", "delta_bits_per_byte", "interval", "units", "worst_slice")
    for candidate in (record, lean, {**lean, "checks": checks}, {k: record[k] for k in core if k in record}):
        text = json.dumps(candidate, separators=(",", ":"), sort_keys=True, ensure_ascii=False)
        if len(text) <= TAG_LIMIT:
            return text
    reason = record["reason"]
    while True:
        reason = reason[: len(reason) * 9 // 10]
        text = json.dumps({"promoted": record["promoted"], "reason": reason + " ..."}, ensure_ascii=False)
        if len(text) <= TAG_LIMIT:
            return text
