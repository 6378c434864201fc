"""Behavioural checks before promotion: each built-in passes on a trained model and fails on
an engine that misbehaves in its way; user checks are called and their failures recorded."""

from __future__ import annotations

import dataclasses
import math

import pytest

from lmops.errors import LmopsError
from lmops.pipeline import checks
from lmops.pipeline.checks import CheckContext, CheckResult, compiles, resolve, run_checks
from lmops.pipeline.params import BUILTIN_CHECKS
from lmops.runtime.engine import LLMEngine
from tests.conftest import make_tiny_model_dir

CTX = CheckContext(prompts=["def ", "class ", "import "], max_new_tokens=32, seed=1337, code=True)
not_a_function = 42


def always_false(candidate, champion, ctx):
    return False, "the candidate is never good enough"


def broken(candidate, champion, ctx):
    raise ZeroDivisionError("division by zero\nsecond line")


@pytest.fixture(scope="module")
def engine(trained_model) -> LLMEngine:
    return LLMEngine.from_pretrained(trained_model.path, device="cpu", compile=False)


@pytest.fixture(scope="module")
def random_engine(tmp_path_factory) -> LLMEngine:
    return LLMEngine.from_pretrained(make_tiny_model_dir(tmp_path_factory.mktemp("random")), device="cpu")


class Wrapped:
    """An engine whose generate goes through `edit(params)` first and `post(outputs)` after."""

    def __init__(self, engine, edit=lambda p: p, post=lambda outs: outs):
        self._engine, self._edit, self._post = engine, edit, post

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate(self, prompts, params):
        params = [self._edit(p) for p in params] if isinstance(params, list) else self._edit(params)
        return self._post(self._engine.generate(prompts, params))


def test_builtins_pass_on_a_trained_model(engine):
    results = run_checks(list(BUILTIN_CHECKS), engine, None, CTX)
    assert [r.name for r in results] == list(BUILTIN_CHECKS)
    assert all(r.passed for r in results), [r.message for r in results if not r.passed]
    assert all("\n" not in r.message for r in results)
    eos = results[3].as_dict()
    assert eos["numbers"]["max_eos_logprob"] >= checks.EOS_LOGPROB_FLOOR


def test_builtins_pass_on_a_random_model(random_engine):
    results = run_checks(list(BUILTIN_CHECKS), random_engine, random_engine, CTX)
    assert all(r.passed for r in results), [r.message for r in results if not r.passed]


def test_greedy_nondeterminism_fails(engine):
    calls = []

    def flip_second_call(outs):
        calls.append(1)
        if len(calls) == 2:
            for o in outs:
                o.outputs[0].token_ids = o.outputs[0].token_ids[:-1]
        return outs

    (r,) = run_checks(["greedy_deterministic"], Wrapped(engine, post=flip_second_call), None, CTX)
    assert not r.passed and r.numbers["repeat_mismatches"] == 3


def test_empty_or_nonfinite_output_fails(engine):
    def empty(outs):
        for o in outs:
            c = o.outputs[0]
            c.text, c.token_ids = "", [min(engine.eos_token_ids)]
            c.logprobs = [{"token_id": c.token_ids[0], "logprob": -math.inf, "top": {}}]
        return outs

    (r,) = run_checks(["nonempty_finite"], Wrapped(engine, post=empty), None, CTX)
    assert not r.passed
    assert r.numbers["empty_samples"] == r.numbers["samples"] == 24
    assert r.numbers["nonfinite_logprobs"] == 24 and r.numbers["prompts_without_text"] == 3


@pytest.mark.parametrize("long_text", [True, False])
def test_ignored_stops_fail(engine, long_text):
    """Both ways of testing stops (a stop string, or a token id for short completions)."""
    ctx = CTX if long_text else dataclasses.replace(CTX, max_new_tokens=2)
    ignoring = Wrapped(engine, edit=lambda p: dataclasses.replace(p, stop=[], stop_token_ids=[]))
    (honoured,) = run_checks(["stop_sequences"], engine, None, ctx)
    (ignored,) = run_checks(["stop_sequences"], ignoring, None, ctx)
    assert honoured.passed, honoured.message
    assert ("stop" in honoured.numbers) is long_text and (
        "stop_token_id" in honoured.numbers
    ) is not long_text
    assert not ignored.passed and ignored.numbers["finish_reason"] == "length"


def test_unreachable_eos_fails(engine):
    class NoEos:
        """The model with its EOS logits at -inf."""

        def __init__(self, model):
            self.model = model

        def __call__(self, ids):
            logits, _ = self.model(ids)
            logits[..., sorted(engine.eos_token_ids)] = -math.inf
            return logits, None

    never = Wrapped(
        engine, edit=lambda p: dataclasses.replace(p, logit_bias={min(engine.eos_token_ids): -100})
    )
    never.model = NoEos(engine.model)
    (r,) = run_checks(["eos_reachable"], never, None, CTX)
    assert not r.passed and r.numbers["ended_on_eos"] == 0 and r.numbers["max_eos_logprob"] == -math.inf
    no_id = Wrapped(engine)
    no_id.eos_token_ids = frozenset()
    assert not run_checks(["eos_reachable"], no_id, None, CTX)[0].passed


def test_repetition_compares_with_the_champion(engine, random_engine):
    """The random model's greedy text loops on one token; the trained one's varies more."""
    (better,) = run_checks(["repetition"], engine, random_engine, CTX)
    (worse,) = run_checks(["repetition"], random_engine, engine, CTX)
    assert better.passed and not worse.passed, (better.message, worse.message)
    assert worse.numbers["distinct_2"] < worse.numbers["required"]


def test_code_compiles_compares_with_the_champion(engine):
    def perfect(outs):
        for o in outs:
            o.prompt, o.outputs[0].text, o.outputs[0].finish_reason = "x = 1\n", "", "stop"
        return outs

    (r,) = run_checks(["code_compiles"], engine, Wrapped(engine, post=perfect), CTX)
    assert not r.passed and r.numbers["champion_share"] == 1.0 and r.numbers["share"] < 0.9
    (na,) = run_checks(["code_compiles"], engine, None, dataclasses.replace(CTX, code=False))
    assert na.passed and na.message.startswith("not applicable") and na.numbers == {"applicable": False}


def test_compiles_as_far_as_complete():
    assert compiles("def f(x):\n    return (x,\n", complete=False)  # an open bracket
    assert compiles("def f(x):\n    return x\ny = 'unfinish", complete=False)  # the cut line dropped
    assert not compiles("def f(x):\n    return x\ny = 'unfinish", complete=True)
    assert not compiles("def f(x) x\n    return x\n", complete=False)


def test_user_checks_are_called_and_failures_recorded(engine):
    names = ["tests.unit.test_checks:always_false", "tests.unit.test_checks:broken"]
    false, raised = run_checks(names, engine, None, CTX)
    assert false == CheckResult(names[0], False, "the candidate is never good enough", {})
    assert not raised.passed and raised.message == "raised ZeroDivisionError: division by zero"


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ("no_such_module_xyz:f", "'no_such_module_xyz:f' does not import: ModuleNotFoundError"),
        (
            "tests.unit.test_checks:missing",
            "'tests.unit.test_checks:missing' does not import: AttributeError",
        ),
        ("tests.unit.test_checks:not_a_function", "'tests.unit.test_checks:not_a_function' is not callable"),
        ("no_such_check", "unknown check 'no_such_check'"),
    ],
)
def test_resolve_names_the_bad_entry(entry, says):
    with pytest.raises(LmopsError, match="^promote.checks: ") as err:
        resolve(["greedy_deterministic", entry])
    assert says in str(err.value) and "\n" not in str(err.value)
