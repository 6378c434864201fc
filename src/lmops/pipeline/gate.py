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


@dataclass(frozen=True)
class SliceComparison:
    slice: str
    comparison: Comparison | None  # None: the slice has no champion to compare with
    candidate_bits_per_byte: float
    units: int
    judged: bool  # enough units for the slice rule
    regressed: bool  # judged, and worse beyond promote.max_slice_regression

    def as_dict(self) -> dict:
        found = {k: v for k, v in asdict(self).items() if k != "comparison"}
        if self.comparison is not None:
            c = self.comparison
            found.update(
                champion_bits_per_byte=c.champion_bits_per_byte,
                delta_bits_per_byte=c.delta_bits_per_byte,
                interval=list(c.interval),
            )
        return found


def compare_slices(
    candidate: list[dict], champion: list[dict] | None, cfg: PromoteConfig
) -> list[SliceComparison]:
    """Each slice of the test units on its own (the units carry their slice), worst first:
    the paired interval of the slice's difference, and whether it is confidently worse than
    the champion's by more than promote.max_slice_regression. A slice of fewer than
    promote.min_slice_units units is reported, not judged: its interval says too little."""
    by_slice: dict[str, list[dict]] = {}
    for row in candidate:
        by_slice.setdefault(row["slice"], []).append(row)
    champion_by_unit = {r["unit"]: r for r in champion or []}
    found = []
    for name, rows in by_slice.items():
        bits = sum(r["nll_bits"] for r in rows) / max(sum(r["bytes"] for r in rows), 1)
        comparison = None
        if champion is not None:
            theirs = [champion_by_unit[r["unit"]] for r in rows if r["unit"] in champion_by_unit]
            comparison = paired_bootstrap(rows, theirs, cfg.bootstrap_samples, cfg.confidence, cfg.seed)
        judged = comparison is not None and len(rows) >= cfg.min_slice_units
        regressed = judged and comparison.interval[0] > cfg.max_slice_regression
        found.append(SliceComparison(name, comparison, float(bits), len(rows), judged, regressed))
    return sorted(found, key=_worst_first)


def _worst_first(s: SliceComparison) -> tuple:
    """Regressed slices, then judged ones, each by their interval's low end, highest first."""
    low = s.comparison.interval[0] if s.comparison else float("-inf")
    return (not s.regressed, not s.judged, -low, s.slice)


def slices_hold(slices: list[SliceComparison], cfg: PromoteConfig) -> tuple[bool, str]:
    """(whether no slice regressed, a one-line reason naming the worst slice)."""
    judged = [s for s in slices if s.judged]
    if not judged:
        return True, f"no slice has {cfg.min_slice_units} units to judge"
    worst = judged[0]
    low, high = worst.comparison.interval
    numbers = (
        f"{worst.slice!r} {worst.comparison.delta_bits_per_byte:+.4f} bits/byte, "
        f"[{low:+.4f}, {high:+.4f}] over {worst.units} units"
    )
    if worst.regressed:
        count = sum(s.regressed for s in slices)
        return False, (f"{count} slice(s) worse beyond +{cfg.max_slice_regression:g}, the worst {numbers}")
    return True, f"worst slice {numbers}, not all above +{cfg.max_slice_regression:g}"
