"""The promotion gate's comparison: is the candidate better than the champion, beyond noise?

Both models are scored on the same test units (evaluate.py). The difference in bits/byte
(candidate minus champion, over all units: a ratio of sums, as the split's number is) gets
a seeded paired-bootstrap interval: units are drawn with replacement, the same draw for
both models, so what the two share (a hard unit is hard for both) cancels out and the
interval measures how much the difference depends on which text was tested. The gate
promotes only when the whole interval lies below -promote.min_improvement: better, by
more than the margin that retrains of the same recipe differ by.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from lmops.errors import LmopsError
from lmops.pipeline.params import PromoteConfig

DRAW_CELLS = 1 << 22  # units x resamples drawn at once: bounded memory for any number of units


@dataclass(frozen=True)
class Comparison:
    candidate_bits_per_byte: float
    champion_bits_per_byte: float
    delta_bits_per_byte: float  # candidate - champion: negative is better
    interval: tuple[float, float]
    units: int
    confidence: float

    def as_dict(self) -> dict:
        return {**asdict(self), "interval": list(self.interval)}


def _columns(rows: list[dict], units: list[int]) -> tuple[np.ndarray, np.ndarray]:
    by_unit = {r["unit"]: r for r in rows}
    return (
        np.array([by_unit[u]["nll_bits"] for u in units], dtype=np.float64),
        np.array([by_unit[u]["bytes"] for u in units], dtype=np.float64),
    )


def paired_bootstrap(
    candidate: list[dict], champion: list[dict], samples: int, confidence: float, seed: int
) -> Comparison:
    """The difference in bits/byte on the units both were scored on, and its interval."""
    units = sorted({r["unit"] for r in candidate})
    if units != sorted({r["unit"] for r in champion}):
        raise LmopsError("the candidate and the champion were scored on different test units")
    cand_bits, cand_bytes = _columns(candidate, units)
    champ_bits, champ_bytes = _columns(champion, units)
    if not units or cand_bytes.sum() == 0 or champ_bytes.sum() == 0:
        raise LmopsError("no test bytes to compare the candidate and the champion on")
    rng = np.random.default_rng(seed)
    per_draw = max(1, DRAW_CELLS // len(units))
    deltas = []
    for start in range(0, samples, per_draw):
        idx = rng.integers(0, len(units), (min(per_draw, samples - start), len(units)))
        deltas.append(
            cand_bits[idx].sum(1) / cand_bytes[idx].sum(1) - champ_bits[idx].sum(1) / champ_bytes[idx].sum(1)
        )
    low, high = np.quantile(np.concatenate(deltas), [(1 - confidence) / 2, (1 + confidence) / 2])
    cand, champ = cand_bits.sum() / cand_bytes.sum(), champ_bits.sum() / champ_bytes.sum()
    return Comparison(
        float(cand), float(champ), float(cand - champ), (float(low), float(high)), len(units), confidence
    )


def rule(cfg: PromoteConfig) -> str:
    return (
        f"promote when the {cfg.confidence:.0%} paired-bootstrap interval of candidate - champion "
        f"bits/byte lies below -{cfg.min_improvement:g}"
    )


def better(comparison: Comparison, cfg: PromoteConfig) -> tuple[bool, str]:
    """(whether the candidate clears the margin, a one-line reason with the numbers)."""
    low, high = comparison.interval
    numbers = (
        f"{comparison.candidate_bits_per_byte:.4f} vs {comparison.champion_bits_per_byte:.4f} bits/byte: "
        f"{comparison.delta_bits_per_byte:+.4f}, {comparison.confidence:.0%} interval [{low:+.4f}, {high:+.4f}] "
        f"over {comparison.units} units"
    )
    if high < -cfg.min_improvement:
        return True, f"{numbers}, below -{cfg.min_improvement:g}"
    return False, f"{numbers}, not all below -{cfg.min_improvement:g}"
