"""Promotion: register every trained model; make it @champion only if it wins.

"Wins" means a strictly lower test bits-per-byte than the current champion
*measured on the same test split*: the champion's number is reused only when
it was measured on a split with the same sha256, otherwise the champion is
re-evaluated on the current split first. The winner is exported atomically
to production_service/model; the decision goes to artifacts/promotion.json.

Recoverable: moving the alias and exporting are two steps, and a process can
die between them, or inside the export. The export's lmops.json names the registry
version it holds, so every promote first tidies what a killed export left and
reconciles it with @champion (re-exporting when they differ), and exports a new
champion through the same reconciliation.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

from lmops import atomic, crash_points
from lmops.errors import LmopsError
from lmops.pipeline import tracking
from lmops.pipeline.evaluate import evaluate_dir, read_test_split
from lmops.pipeline.params import Params, PromoteConfig
from lmops.pipeline.paths import METRICS_FILE, MODEL_DIR, PROMOTION_FILE
from lmops.runtime.model_dir import download, export, read_meta, require_meta, tidy

log = logging.getLogger(__name__)

METRIC = "test_bits_per_byte"


def champion_score(params: Params, champion, test_path: Path, test_sha: str) -> tuple[float, str]:
    """The champion's bits/byte on this test split, and how we know it."""
    tags = champion.tags or {}
    if tags.get("test_split_sha256") == test_sha and METRIC in tags:
        return float(tags[METRIC]), "measured on the same test split"
    with tempfile.TemporaryDirectory(prefix="lmops-champion-") as tmp:
        model_dir = download(f"models:/{champion.name}/{champion.version}", Path(tmp))
        bpb = evaluate_dir(model_dir, test_path, params.evaluate, params.train.device)["bits_per_byte"]
    client = tracking.client()
    client.set_model_version_tag(champion.name, champion.version, METRIC, str(bpb))
    client.set_model_version_tag(champion.name, champion.version, "test_split_sha256", test_sha)
    return bpb, "re-evaluated on the current test split (the data changed)"


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
        run_metrics = tracking.client().get_run(champion.run_id).data.metrics
        metrics = {
            **(require_meta(model_dir).metrics),
            **{k: v for k, v in run_metrics.items() if k.startswith("test_")},
        }
        if METRIC in tags:  # the number promotion compared: the service's drift reference
            metrics.update({METRIC: float(tags[METRIC]), "test_split_sha256": tags.get("test_split_sha256")})
        export(
            model_dir,
            export_dir,
            model_name=cfg.model_name,
            model_version=int(champion.version),
            run_id=champion.run_id,
            metrics=metrics,
        )
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
    test_path, test_sha = read_test_split()
    if metrics.get("test_split_sha256") != test_sha:
        raise LmopsError(f"{METRICS_FILE} was measured on another test split: run `lmops evaluate` again")
    score = float(metrics[METRIC])

    champion = tracking.champion_version(cfg.model_name, cfg.alias)
    version = tracking.register(
        cfg.model_name,
        run_id,
        {METRIC: str(score), "test_split_sha256": test_sha, "data_sha256": str(meta.data_sha256)},
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
    if is_champion:  # e.g. a promotion killed after the alias moved, run again
        champ_bpb = score
    elif champion is not None:
        champ_bpb, how = champion_score(params, champion, test_path, test_sha)
    if champion is not None:
        decision.update(champion_version=int(champion.version), champion_bits_per_byte=champ_bpb)
    if force:
        promoted, reason = True, "forced with --force"
    elif champion is None:
        promoted, reason = True, "no champion yet"
    elif is_champion:
        promoted, reason = False, f"v{version.version} is already @{cfg.alias}"
    elif score < champ_bpb:
        promoted, reason = (
            True,
            f"{score:.4f} < champion v{champion.version} {champ_bpb:.4f} bits/byte ({how})",
        )
    else:
        promoted, reason = (
            False,
            f"{score:.4f} >= champion v{champion.version} {champ_bpb:.4f} bits/byte ({how})",
        )
    decision.update(promoted=promoted, reason=reason, alias=cfg.alias)
    other_data = (
        champion is not None
        and not is_champion
        and (champion.tags or {}).get("data_sha256")
        not in (
            None,
            str(meta.data_sha256),
        )
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

    client = tracking.client()
    client.set_model_version_tag(cfg.model_name, version.version, "promotion", reason)
    if promoted:
        client.set_registered_model_alias(cfg.model_name, cfg.alias, version.version)
        crash_points.reached("promote.alias_moved")
        reconcile(cfg, model_dir, just_promoted=True)
    atomic.write_json(PROMOTION_FILE, decision)
    log.info("promotion: %s v%s: %s", "PROMOTED" if promoted else "kept champion", version.version, reason)
    return decision
