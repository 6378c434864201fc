"""Promotion: register every trained model; make it @champion only if it wins.

"Wins" means a strictly lower test bits-per-byte than the current champion
*measured on the same test split*: the champion's number is reused only when
it was measured on a split with the same sha256, otherwise the champion is
re-evaluated on the current split first. The winner is exported atomically
to production_service/model; the decision goes to artifacts/promotion.json.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

from lmops import atomic, tracking
from lmops.config import Params
from lmops.errors import LmopsError
from lmops.evaluate import evaluate_dir, read_model_meta, read_test_split
from lmops.paths import METRICS_FILE, MODEL_DIR, PROMOTION_FILE

log = logging.getLogger(__name__)

METRIC = "test_bits_per_byte"


def champion_score(params: Params, champion, test_text: str, test_sha: str) -> tuple[float, str]:
    """The champion's bits/byte on this test split, and how we know it."""
    tags = champion.tags or {}
    if tags.get("test_split_sha256") == test_sha and METRIC in tags:
        return float(tags[METRIC]), "measured on the same test split"
    with tempfile.TemporaryDirectory(prefix="lmops-champion-") as tmp:
        model_dir = tracking.download_model_dir(f"models:/{champion.name}/{champion.version}", Path(tmp))
        bpb = evaluate_dir(model_dir, test_text, params.evaluate, params.train.device)["bits_per_byte"]
    client = tracking.client()
    client.set_model_version_tag(champion.name, champion.version, METRIC, str(bpb))
    client.set_model_version_tag(champion.name, champion.version, "test_split_sha256", test_sha)
    return bpb, "re-evaluated on the current test split (the data changed)"


def promote(params: Params, force: bool = False, model_dir: Path = MODEL_DIR) -> dict:
    cfg = params.promote
    meta = read_model_meta(model_dir)
    if not METRICS_FILE.is_file():
        raise LmopsError(f"{METRICS_FILE} not found: run `lmops evaluate` first")
    metrics = json.loads(METRICS_FILE.read_text())
    run_id = meta.get("run_id")
    if not run_id:
        raise LmopsError(f"{model_dir}/lmops.json has no run_id: the model was not trained with tracking")
    test_text, test_sha = read_test_split()
    if metrics.get("test_split_sha256") != test_sha:
        raise LmopsError(f"{METRICS_FILE} was measured on another test split: run `lmops evaluate` again")
    score = float(metrics[METRIC])

    tracking.configure(params.mlflow)
    champion = tracking.champion_version(cfg.model_name, cfg.alias)
    version = tracking.register(
        cfg.model_name,
        run_id,
        {METRIC: str(score), "test_split_sha256": test_sha, "data_sha256": str(meta.get("data_sha256"))},
    )
    decision = {
        "model_name": cfg.model_name,
        "version": int(version.version),
        "run_id": run_id,
        "candidate_bits_per_byte": score,
        "champion_version": None,
        "champion_bits_per_byte": None,
    }
    if champion is not None:
        champ_bpb, how = champion_score(params, champion, test_text, test_sha)
        decision.update(champion_version=int(champion.version), champion_bits_per_byte=champ_bpb)
    if force:
        promoted, reason = True, "forced with --force"
    elif champion is None:
        promoted, reason = True, "no champion yet"
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

    client = tracking.client()
    client.set_model_version_tag(cfg.model_name, version.version, "promotion", reason)
    if promoted:
        client.set_registered_model_alias(cfg.model_name, cfg.alias, version.version)
        tracking.export(
            model_dir,
            Path(cfg.export_dir),
            {
                "model_name": cfg.model_name,
                "model_version": int(version.version),
                "run_id": run_id,
                "metrics": {
                    **meta.get("metrics", {}),
                    **{k: v for k, v in metrics.items() if k.startswith("test_")},
                },
            },
        )
    atomic.write_json(PROMOTION_FILE, decision)
    log.info("promotion: %s v%s: %s", "PROMOTED" if promoted else "kept champion", version.version, reason)
    return decision
