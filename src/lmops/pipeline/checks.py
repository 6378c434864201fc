"""Behavioural checks a candidate must pass before `lmops promote` makes it @champion.

`promote.checks` names them: the built-ins below, or a user's own as "module:function"
(imported from installed packages or the project directory), called as
`fn(candidate, champion, ctx)` and returning a `CheckResult`, a bool, or (bool, message).
Every check is deterministic (greedy, or sampling seeded with `evaluate.seed`), and where
it compares, candidate and champion answer the very same requests.

The samples the built-ins share (`samples`): SAMPLES_PER_PROMPT completions of each of
`evaluate.prompts`, `evaluate.max_new_tokens` long, at temperature 1 with no top-k/top-p:
the model's own distribution, so neither model's generation config tilts a comparison.
"""

from __future__ import annotations

import codeop
import importlib
import logging
import math
import os
import sys
import warnings
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

from lmops.errors import LmopsError
from lmops.pipeline.params import BUILTIN_CHECKS
from lmops.runtime.engine import LLMEngine, RequestOutput, SamplingParams

log = logging.getLogger(__name__)

SAMPLES_PER_PROMPT = 8
# eos_reachable: EOS must be at least this likely (1e-8) at some sampled position, unless a
# sample already ended on it. The pipeline's corpora carry no EOS, so a trained model learns
# to push it down (a tiny one trained 150 steps: about 1e-4 at best, 600 steps: 1e-5); the
# floor is far below that and catches a model that cannot end at all (EOS masked, collapsed
# to -inf, or no EOS id), not one that merely rarely ends.
EOS_LOGPROB_FLOOR = math.log(1e-8)
# repetition: distinct-2 (distinct token bigrams / all bigrams) of the greedy completions,
# where a model degenerates into loops. It rises as a model learns (measured on tiny models:
# random 0.005, 150 steps 0.25, 600 steps 0.50), whereas on temperature-1 samples it falls
# towards the data's own (random 1.0, 0.85, 0.78; the stdlib text 0.69): so greedy, compared
# with the champion's less this tolerance. With no champion there is nothing to regress from.
DISTINCT2_TOLERANCE = 0.05
# code_compiles: the share of samples that compile may fall short of the champion's by at
# most this: about one standard deviation of a share measured on 24 samples.
COMPILE_TOLERANCE = 0.1
# stop_sequences: the stop string's length, cut from the middle of a greedy completion.
STOP_CHARS = 3

Number = float | int | str | bool | None


@dataclass(frozen=True)
class CheckResult:
    name: str
    passed: bool
    message: str  # one line, with the numbers
    numbers: dict[str, Number]

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class CheckContext:
    prompts: list[str]
    max_new_tokens: int
    seed: int
    code: bool  # the corpus is code: code_compiles applies


Check = Callable[[LLMEngine, LLMEngine | None, CheckContext], object]


# -- shared generation ---------------------------------------------------------------

_SAMPLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def samples(engine: LLMEngine, ctx: CheckContext) -> list[RequestOutput]:
    """The seeded samples (one completion each, prompt by prompt), generated once per engine
    and context and shared by the checks; user checks may use them too."""
    key = (tuple(ctx.prompts), ctx.max_new_tokens, ctx.seed)
    memo = _SAMPLES.setdefault(engine, {})
    if key not in memo:
        prompts = [p for p in ctx.prompts for _ in range(SAMPLES_PER_PROMPT)]
        params = [
            SamplingParams(temperature=1.0, max_tokens=ctx.max_new_tokens, seed=ctx.seed + i, logprobs=0)
            for i in range(len(prompts))
        ]
        memo[key] = engine.generate(prompts, params)
    return memo[key]


def _greedy(engine: LLMEngine, prompts: list[str], max_tokens: int, **stops) -> list[RequestOutput]:
    return engine.generate(list(prompts), SamplingParams(temperature=0.0, max_tokens=max_tokens, **stops))


def _words(engine: LLMEngine, out: RequestOutput) -> list[int]:
    """The completion's tokens without the EOS that ended it."""
    ids = out.outputs[0].token_ids
    return ids[:-1] if ids and ids[-1] in engine.eos_token_ids else ids


# -- built-ins -----------------------------------------------------------------------


def greedy_deterministic(candidate: LLMEngine, champion: LLMEngine | None, ctx: CheckContext) -> CheckResult:
    """The same greedy requests, batched twice and each alone, give the same tokens: what a
    user sees must not depend on chance or on what else the server is doing."""
    first = [o.token_ids for o in _greedy(candidate, ctx.prompts, ctx.max_new_tokens)]
    again = [o.token_ids for o in _greedy(candidate, ctx.prompts, ctx.max_new_tokens)]
    alone = [_greedy(candidate, [p], ctx.max_new_tokens)[0].token_ids for p in ctx.prompts]
    repeat_diff = sum(a != b for a, b in zip(first, again, strict=True))
    alone_diff = sum(a != b for a, b in zip(first, alone, strict=True))
    numbers = {"prompts": len(first), "repeat_mismatches": repeat_diff, "alone_mismatches": alone_diff}
    n = len(first)
    if repeat_diff or alone_diff:
        msg = f"greedy tokens differ: {repeat_diff} of {n} prompts on repeat, {alone_diff} of {n} batched vs alone"
        return CheckResult("greedy_deterministic", False, msg, numbers)
    msg = f"greedy tokens identical on repeat and batched vs alone ({n} prompts)"
    return CheckResult("greedy_deterministic", True, msg, numbers)


def nonempty_finite(candidate: LLMEngine, champion: LLMEngine | None, ctx: CheckContext) -> CheckResult:
    """Every sample has a token besides EOS, every sampled token a finite log-prob, and
    every prompt some non-empty text."""
    outs = samples(candidate, ctx)
    empty = sum(not _words(candidate, o) for o in outs)
    nonfinite = sum(
        not math.isfinite(lp["logprob"])
        for o in outs
        for lp in (o.outputs[0].logprobs or [])
        if lp is not None
    )
    silent = sum(not any(o.text for o in outs if o.prompt == p) for p in ctx.prompts)
    numbers = {
        "samples": len(outs),
        "empty_samples": empty,
        "nonfinite_logprobs": nonfinite,
        "prompts_without_text": silent,
    }
    passed = not (empty or nonfinite or silent)
    msg = (
        f"{empty} of {len(outs)} samples empty, {nonfinite} non-finite log-probs, "
        f"{silent} of {len(ctx.prompts)} prompts without text"
    )
    return CheckResult("nonempty_finite", passed, msg, numbers)


def stop_sequences(candidate: LLMEngine, champion: LLMEngine | None, ctx: CheckContext) -> CheckResult:
    """A stop string cut from the middle of a greedy completion ends the same request there
    (finish_reason "stop", the text up to its first occurrence). A completion shorter than
    2 * STOP_CHARS characters is tested with a stop token id from its middle instead."""
    prompt = ctx.prompts[0]
    first = _greedy(candidate, [prompt], ctx.max_new_tokens)[0]
    text, ids = first.text, first.token_ids
    if len(text) >= 2 * STOP_CHARS:
        mid = len(text) // 2
        stop = text[mid : mid + STOP_CHARS]
        out = _greedy(candidate, [prompt], ctx.max_new_tokens, stop=[stop])[0]
        expected = text[: text.find(stop)]
        ok = out.finish_reason == "stop" and out.text == expected
        numbers = {"stop": stop, "expected_chars": len(expected), "got_chars": len(out.text)}
        what = f"stop string {stop!r}"
    elif len(ids) >= 2:
        token = ids[len(ids) // 2]
        out = _greedy(candidate, [prompt], ctx.max_new_tokens, stop_token_ids=[token])[0]
        expected_ids = ids[: ids.index(token) + 1]
        ok = out.finish_reason == "stop" and out.token_ids == expected_ids
        numbers = {
            "stop_token_id": token,
            "expected_tokens": len(expected_ids),
            "got_tokens": len(out.token_ids),
        }
        what = f"stop token id {token}"
    else:
        msg = f"the greedy completion of {prompt!r} has {len(ids)} tokens: too short to test stops"
        return CheckResult("stop_sequences", False, msg, {"tokens": len(ids)})
    numbers["finish_reason"] = out.finish_reason
    verdict = "honoured" if ok else "not honoured"
    counts = ", ".join(f"{k} {v}" for k, v in numbers.items() if k.startswith(("expected", "got")))
    msg = f"{what} {verdict}: finish_reason {out.finish_reason}, {counts}"
    return CheckResult("stop_sequences", ok, msg, numbers)


@torch.no_grad()
def _max_eos_logprob(engine: LLMEngine, outs: list[RequestOutput]) -> float:
    """The highest log-prob of an EOS id at any position that predicts a generated token
    (or follows the last one), by running the model over prompt + completion."""
    eos = torch.tensor(sorted(engine.eos_token_ids), device=engine.device)
    best = -math.inf
    for o in outs:
        ids = torch.tensor([o.prompt_token_ids + o.token_ids], device=engine.device)
        logits, _ = engine.model(ids)
        lp = torch.log_softmax(logits[0, len(o.prompt_token_ids) - 1 :].float(), -1)[:, eos]
        best = max(best, lp.max().item())
    return best


def eos_reachable(candidate: LLMEngine, champion: LLMEngine | None, ctx: CheckContext) -> CheckResult:
    """The model can end a completion: some sample ended on EOS, or EOS reaches
    EOS_LOGPROB_FLOOR somewhere in the samples."""
    if not candidate.eos_token_ids:
        return CheckResult("eos_reachable", False, "the model has no EOS token id", {"eos_ids": 0})
    outs = samples(candidate, ctx)
    ended = sum(o.outputs[0].stop_reason in candidate.eos_token_ids for o in outs)
    best = _max_eos_logprob(candidate, outs)
    numbers = {
        "samples": len(outs),
        "ended_on_eos": ended,
        "max_eos_logprob": best,
        "floor": EOS_LOGPROB_FLOOR,
    }
    passed = ended > 0 or best >= EOS_LOGPROB_FLOOR
    msg = (
        f"{ended} of {len(outs)} samples ended on EOS; max EOS log-prob {best:.2f} "
        f"({'>=' if best >= EOS_LOGPROB_FLOOR else '<'} floor {EOS_LOGPROB_FLOOR:.2f})"
    )
    return CheckResult("eos_reachable", passed, msg, numbers)


def distinct_2(engine: LLMEngine, outs: list[RequestOutput]) -> float | None:
    """Distinct token bigrams over all bigrams of the completions (None when there are none)."""
    seqs = [_words(engine, o) for o in outs]
    bigrams = [pair for ids in seqs for pair in zip(ids, ids[1:], strict=False)]
    return len(set(bigrams)) / len(bigrams) if bigrams else None


def repetition(candidate: LLMEngine, champion: LLMEngine | None, ctx: CheckContext) -> CheckResult:
    """Distinct-2 of the greedy completions of the prompts: at least the champion's less
    DISTINCT2_TOLERANCE (recorded only, without a champion)."""
    mine = distinct_2(candidate, _greedy(candidate, ctx.prompts, ctx.max_new_tokens))
    theirs = (
        None if champion is None else distinct_2(champion, _greedy(champion, ctx.prompts, ctx.max_new_tokens))
    )
    numbers = {"distinct_2": mine, "champion_distinct_2": theirs}
    if mine is None:
        return CheckResult("repetition", False, "no bigrams in the greedy completions", numbers)
    return not_below_champion(
        "repetition", "greedy distinct-2 {:.3f}", mine, theirs, DISTINCT2_TOLERANCE, numbers
    )


def not_below_champion(
    name: str, what: str, mine: float, theirs: float | None, tolerance: float, numbers: dict
) -> CheckResult:
    """Passes when `mine` is at least the champion's less `tolerance`, or there is no
    champion; `what` formats a value for the message."""
    if theirs is None:
        return CheckResult(name, True, f"{what.format(mine)} (no champion)", numbers)
    bar = theirs - tolerance
    numbers["required"] = bar
    msg = f"{what.format(mine)}, required {what.format(bar)} (champion {what.format(theirs)} - {tolerance})"
    return CheckResult(name, mine >= bar, msg, numbers)


def compiles(source: str, complete: bool) -> bool:
    """Whether Python code compiles as far as it is complete: an open block, bracket or
    triple-quoted string at the end is fine (codeop's "incomplete input"), and a text cut
    mid-line (`complete` False) is judged without its unfinished last line."""
    if not complete and "\n" in source:
        source = source[: source.rindex("\n") + 1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SyntaxWarnings (invalid escapes) are not failures
        try:
            codeop.compile_command(source, "<sample>", "exec")
        except (SyntaxError, ValueError, OverflowError):
            return False
    return True


def compile_share(outs: list[RequestOutput]) -> float:
    """The share of samples whose prompt + completion compiles (`compiles`); a completion that
    ran into max_tokens is cut, one that the model ended is complete."""
    ok = sum(compiles(o.prompt + o.text, complete=o.finish_reason == "stop") for o in outs)
    return ok / len(outs)


def code_compiles(candidate: LLMEngine, champion: LLMEngine | None, ctx: CheckContext) -> CheckResult:
    """For a code corpus: the share of samples that compile is at least the champion's less
    COMPILE_TOLERANCE (anything without a champion)."""
    if not ctx.code:
        return CheckResult(
            "code_compiles", True, "not applicable: the corpus is not code", {"applicable": False}
        )
    mine = compile_share(samples(candidate, ctx))
    theirs = None if champion is None else compile_share(samples(champion, ctx))
    numbers = {"applicable": True, "share": mine, "champion_share": theirs}
    return not_below_champion(
        "code_compiles", "{:.0%} of samples compile", mine, theirs, COMPILE_TOLERANCE, numbers
    )


BUILTINS: dict[str, Check] = {
    "greedy_deterministic": greedy_deterministic,
    "nonempty_finite": nonempty_finite,
    "stop_sequences": stop_sequences,
    "eos_reachable": eos_reachable,
    "repetition": repetition,
    "code_compiles": code_compiles,
}
assert tuple(BUILTINS) == BUILTIN_CHECKS


# -- running -------------------------------------------------------------------------


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def resolve(names: list[str]) -> list[tuple[str, Check]]:
    """The checks `promote.checks` names, imported now so that a bad entry stops promotion
    before any work. "module:function" modules import from the project directory too."""
    checks = []
    for name in names:
        if ":" not in name:
            if name not in BUILTINS:
                raise LmopsError(
                    f"promote.checks: unknown check {name!r} (built-ins: {', '.join(BUILTINS)}; "
                    "or your own as module:function)"
                )
            checks.append((name, BUILTINS[name]))
            continue
        module_name, fn_name = name.split(":", 1)
        if os.getcwd() not in sys.path:
            sys.path.append(os.getcwd())  # as `python -m` would, but after the installed packages
        try:
            fn = getattr(importlib.import_module(module_name), fn_name)
        except Exception as exc:  # whatever the module raises while importing
            raise LmopsError(f"promote.checks: {name!r} does not import: {_first_line(exc)}") from None
        if not callable(fn):
            raise LmopsError(f"promote.checks: {name!r} is not callable (a {type(fn).__name__})")
        checks.append((name, fn))
    return checks


def _as_result(name: str, value: object) -> CheckResult:
    """A user check's answer as a CheckResult named after its params entry."""
    if isinstance(value, CheckResult):
        return replace(value, name=name)
    if isinstance(value, bool):
        return CheckResult(name, value, "passed" if value else "failed", {})
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], bool):
        return CheckResult(name, value[0], " ".join(str(value[1]).split()), {})
    msg = f"returned a {type(value).__name__}, not a CheckResult, a bool or (bool, message)"
    return CheckResult(name, False, msg, {})


def run_checks(
    names: list[str], candidate: LLMEngine, champion: LLMEngine | None, ctx: CheckContext
) -> list[CheckResult]:
    """Every named check's result, in order. A check that raises has failed, with the
    exception named: one broken check neither crashes promotion nor hides the others."""
    results = []
    for name, fn in resolve(names):
        try:
            result = _as_result(name, fn(candidate, champion, ctx))
        except Exception as exc:
            result = CheckResult(name, False, f"raised {_first_line(exc)}", {"error": type(exc).__name__})
        log.info("check %s: %s: %s", name, "passed" if result.passed else "FAILED", result.message)
        results.append(result)
    return results
