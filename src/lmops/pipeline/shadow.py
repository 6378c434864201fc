"""The promotion gate's live evidence: the challenger against the champion on the prompts
the service mirrored to both (shadow mode), as Prometheus recorded them.

A replica serving `models:/<name>@challenger` beside its champion, with
LMOPS_SHADOW_SHARE, scores each mirrored prompt on both models in bits/byte (each with its
own tokenizer) into `lmops:shadow_prompt_bits_per_byte{role, challenger_model,
challenger_version}`. The candidate's evidence is what was scored while it was the
challenger, over every replica Prometheus scrapes, in the last promote.shadow_window:
each role's mean over the same prompts (the sums' increase over the counts'), so a
replica with more traffic weighs more and a predecessor's prompts never count."""

from __future__ import annotations

from lmops import prometheus
from lmops.errors import LmopsError
from lmops.pipeline.params import PromoteConfig

SERIES = "lmops:shadow_prompt_bits_per_byte"


def compare(cfg: PromoteConfig, version: int | str) -> dict:
    """The evidence: `judged` (and then `passed`), the numbers, and the reason in words."""
    scored_by = f'challenger_model="{cfg.model_name}", challenger_version="{version}"'
    totals = {}
    for part in ("sum", "count"):
        promql = f"sum by (role) (increase({SERIES}_{part}{{{scored_by}}}[{cfg.shadow_window}]))"
        try:
            samples = prometheus.query(cfg.shadow_prometheus_url, promql)
        except OSError as exc:
            raise LmopsError(
                f"promote.shadow_prometheus_url: cannot read the live comparison: {exc} "
                "(set it to null to judge on the test split alone)"
            ) from None
        totals[part] = {labels.get("role", ""): value for labels, value in samples}
    counts = totals["count"]
    prompts = round(min(counts.get("champion", 0.0), counts.get("challenger", 0.0)))
    if prompts < cfg.min_shadow_prompts:
        return {
            "judged": False,
            "prompts": prompts,
            "reason": f"v{version} as the challenger scored {prompts} mirrored prompts in the last "
            f"{cfg.shadow_window}, fewer than promote.min_shadow_prompts={cfg.min_shadow_prompts}",
        }
    champion, challenger = (totals["sum"][role] / counts[role] for role in ("champion", "challenger"))
    delta = challenger - champion
    return {
        "judged": True,
        "passed": delta <= cfg.max_shadow_regression,
        "prompts": prompts,
        "champion_bits_per_byte": champion,
        "challenger_bits_per_byte": challenger,
        "delta_bits_per_byte": delta,
        "reason": f"{challenger:.4f} bits/byte against the champion's {champion:.4f} on {prompts} "
        f"mirrored prompts in the last {cfg.shadow_window} ({delta:+.4f}; at most "
        f"+{cfg.max_shadow_regression} promotes)",
    }
