"""Sampling parameters, validated on construction, and the batched sampler.

The sampler follows vLLM's order: logit bias and min_tokens -> penalties -> the grammar's
token mask (structured outputs) -> temperature -> min_p -> top_k -> top_p -> draw. A draw
is `argmax(p / q)` with q ~ Exp(1) (the "exponential race", an exact sample from p); a
seeded request takes its q from its own generator, so its tokens do not depend on what else
shares the batch. Logprobs are those of the raw model distribution (before penalties,
the mask and temperature), as in vLLM. `speculative_sample` verifies speculative drafts
against the same distributions (rejection sampling for sampled rows, `verify_draft`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from lmops.errors import LmopsError
from lmops.runtime.engine.grammar import StructuredOutputs
from lmops.runtime.generation_config import GENERATION_FILE, default_sampling_fields

MAX_LOGPROBS = 20
TOP_CANDIDATES = 512  # top_k / top_p rank this many of the most likely tokens first
# A compiled graph's draw (`plain_draw`) ranks this many, with no widening (a branch on the
# data): top_k up to it, and top_p only inside such a top_k. Ranking the whole vocabulary
# instead cost 230 us a 4,096-token row on CPU, this 16 (benchmarks/README.md, "Single stream").
GRAPH_CANDIDATES = 128
MAX_TEMPERATURE = 2.0  # OpenAI's cap; higher is noise
# A temperature below this is greedy (vLLM's _SAMPLING_EPS): dividing the logits by it
# would overflow them to infinities, whose probabilities are NaN.
GREEDY_BELOW = 1e-5
SEED_BOUND = 2**63  # seeds are 64-bit signed integers, as in vLLM


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class Range:
    """A numeric field's allowed values, stated once: SamplingParams checks them and the
    API's request schema (production_service/schemas.py) publishes them."""

    lo: float
    hi: float | None = None
    lo_open: bool = False
    integer: bool = False
    text: str | None = None  # how to say it when the bounds alone do not

    def admits(self, v) -> bool:
        if not (_is_int(v) if self.integer else _is_num(v)):
            return False
        return (v > self.lo if self.lo_open else v >= self.lo) and (self.hi is None or v <= self.hi)

    def __str__(self) -> str:
        if self.text:
            return self.text
        kind = "an integer" if self.integer else "a number"
        if self.hi is None:
            return f"{kind} {'>' if self.lo_open else '>='} {self.lo:g}"
        return f"{kind} in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]"


RANGES = {
    "n": Range(1, integer=True),
    "temperature": Range(0, MAX_TEMPERATURE, text=f"a number in [0, {MAX_TEMPERATURE:g}] (0 = greedy)"),
    "top_p": Range(0, 1, lo_open=True),
    "top_k": Range(-1, integer=True, text="an integer >= 1, or 0 / -1 for no limit"),
    "min_p": Range(0, 1),
    "presence_penalty": Range(-2, 2),
    "frequency_penalty": Range(-2, 2),
    "repetition_penalty": Range(0, 2, lo_open=True),
    "max_tokens": Range(0, integer=True, text="an integer >= 0 (0: only the prompt's log-probs)"),
    "seed": Range(-SEED_BOUND, SEED_BOUND - 1, integer=True, text="a 64-bit signed integer"),
    "logprobs": Range(0, MAX_LOGPROBS, integer=True),
    "prompt_logprobs": Range(0, MAX_LOGPROBS, integer=True),
    "min_tokens": Range(0, integer=True),
}
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound
# None means: up to the context (max_tokens), no seed (a fresh draw), no log-probs.
OPTIONAL = {"max_tokens", "seed", "logprobs", "prompt_logprobs"}


@dataclass
class SamplingParams:
    n: int = 1  # completions of the prompt
    # The distribution a token is drawn from, and its filters.
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    min_p: float = 0.0
    # vLLM's penalties: repetition over prompt and output, presence and frequency over the output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: none
    # When generation stops (besides EOS).
    max_tokens: int | None = 16  # None: up to the context
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None  # a seeded request draws the same tokens whatever shares its batch
    # Log-probs of each generated token and of this many top alternatives.
    logprobs: int | None = None
    # Log-probs of the prompt's tokens (each with its rank and this many top alternatives),
    # computed in the prefill; such a prompt is prefilled whole, not from the prefix cache.
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    # vLLM's: no EOS or stop token, and no stop string, before this many tokens.
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # in the output text
    # OpenAI's: token id -> a bias in [-100, 100] added to its logit before sampling.
    logit_bias: dict[int, float] | None = None
    # vLLM's: the output follows a JSON schema, regex, choice or grammar (engine/grammar.py).
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        def need(ok: bool, field: str, allowed: str) -> None:
            if not ok:
                raise ValueError(f"{field} must be {allowed}, got {getattr(self, field)!r}")

        for field, allowed in RANGES.items():
            value = getattr(self, field)
            if field in OPTIONAL:
                need(value is None or allowed.admits(value), field, f"{allowed} or None")
            else:
                need(allowed.admits(value), field, str(allowed))
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        need(
            self.stop is None
            or (isinstance(self.stop, list | tuple) and all(isinstance(s, str) and s for s in self.stop)),
            "stop",
            "a non-empty string or a list of non-empty strings",
        )
        self.stop = list(self.stop or [])
        need(
            self.stop_token_ids is None
            or (
                isinstance(self.stop_token_ids, list | tuple)
                and all(_is_int(t) and t >= 0 for t in self.stop_token_ids)
            ),
            "stop_token_ids",
            "a list of token ids (integers >= 0)",
        )
        self.stop_token_ids = list(self.stop_token_ids or [])
        for flag in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            need(isinstance(getattr(self, flag), bool), flag, "a bool")
        need(
            self.logit_bias is None
            or (
                isinstance(self.logit_bias, dict)
                and all(
                    _is_int(t) and t >= 0 and _is_num(b) and abs(b) <= MAX_LOGIT_BIAS
                    for t, b in self.logit_bias.items()
                )
            ),
            "logit_bias",
            f"a map of token ids to numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
        )
        self.logit_bias = dict(self.logit_bias or {})
        need(
            self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputs),
            "structured_outputs",
            "a StructuredOutputs or None",
        )
        if self.structured_outputs is not None and self.min_tokens:
            raise ValueError(
                "min_tokens cannot be combined with structured_outputs: the grammar says where the output ends"
            )

    @classmethod
    def from_model_dir(
        cls, directory: str | Path, overrides: dict[str, Any] | None = None, **fields
    ) -> SamplingParams:
        """The sampling the model asks for (its generation config, `overrides`:
        generation-config keys such as a deployment's LMOPS_GENERATION_CONFIG, on top), and
        `fields` (a caller's explicit choices) on top of both: every door's one route."""
        layers = [(str(Path(directory) / GENERATION_FILE), default_sampling_fields(directory))]
        if overrides:
            layers.append(("LMOPS_GENERATION_CONFIG", default_sampling_fields(directory, overrides)))
        if fields:
            layers.append(("the sampling fields given", {**layers[-1][1], **fields}))
        for where, given in layers:  # an invalid value is named where it came from
            try:
                sampling = cls(**given)
            except ValueError as exc:
                raise LmopsError(f"{where}: {exc}") from None
        return sampling

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def graph_draw(self) -> bool:
        """A compiled graph can make the draw (compiled.py: a lone sequence's step, or its
        multi-step run): nothing but temperature and the filters shapes it (no penalty, bias,
        min_tokens or log-probs; a grammar's mask is the sequence's, not these params'), and
        the filters need no more than the GRAPH_CANDIDATES most likely tokens: top_k at most
        that, top_p only under such a top_k, any temperature and min_p."""
        plain = (
            self.logprobs is None and not self.logit_bias and not self.min_tokens and not self.has_penalties
        )
        ranked = 0 < self.top_k <= GRAPH_CANDIDATES
        return plain and (self.greedy or ((ranked or self.top_k <= 0) and (ranked or self.top_p == 1)))

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def seeded_generator(seed: int | None, index: int, device: torch.device) -> torch.Generator | None:
    """Completion `index`'s generator of a request seeded with `seed` (None: unseeded)."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed((seed if index == 0 else hash((seed, index))) & 0xFFFF_FFFF_FFFF_FFFF)
    return g


class SampleInput(Protocol):
    """What the sampler reads from each row's sequence."""

    params: SamplingParams
    generator: torch.Generator | None

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...


def _token_counts(rows: list[list[int]], vocab: int, device) -> torch.Tensor:
    """(R, V) occurrence counts; ids padded with an extra column `vocab` that is dropped."""
    width = max(1, max(len(r) for r in rows))
    ids = torch.full((len(rows), width), vocab, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    ids = ids.to(device)
    counts = torch.zeros(len(rows), vocab + 1, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, seqs: list[SampleInput]) -> torch.Tensor:
    """vLLM's semantics: repetition over prompt + output, presence/frequency over output only."""
    idx = [i for i, s in enumerate(seqs) if s.params.has_penalties]
    if not idx:
        return logits
    V, dev = logits.shape[1], logits.device
    sub = logits[idx]
    out_counts = _token_counts([seqs[i].output_token_ids for i in idx], V, dev)
    seen = (_token_counts([seqs[i].prompt_token_ids for i in idx], V, dev) > 0) | (out_counts > 0)
    p = [seqs[i].params for i in idx]
    rep = torch.tensor([x.repetition_penalty for x in p], device=dev)[:, None]
    freq = torch.tensor([x.frequency_penalty for x in p], device=dev)[:, None]
    pres = torch.tensor([x.presence_penalty for x in p], device=dev)[:, None]
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - freq * out_counts - pres * (out_counts > 0).to(sub.dtype)
    logits = logits.clone()
    logits[idx] = sub
    return logits


def apply_filters(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """min_p, top_k, top_p on temperature-scaled logits; each only when some row uses it."""
    V, dev = logits.shape[1], logits.device

    def column(values: list) -> torch.Tensor:
        return torch.tensor(values, device=dev)[:, None]

    ks = [p.top_k if 0 < p.top_k < V else V for p in params]
    # The tokens kept are the most likely few: rank those (top_k's k, or for top_p a candidate
    # set), not all of them: a full sort was most of a sampled step.
    candidates = min(
        V, max(k if k < V else TOP_CANDIDATES if p.top_p < 1 else 1 for k, p in zip(ks, params, strict=True))
    )
    return filter_logits(
        logits,
        column([p.min_p for p in params]) if any(p.min_p > 0 for p in params) else None,
        column(ks) if min(ks) < V else None,
        column([p.top_p for p in params]) if any(p.top_p < 1 for p in params) else None,
        candidates,
    )


def filter_logits(
    logits: torch.Tensor,
    min_p: torch.Tensor | None,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    candidates: int,
    widen: bool = True,
) -> torch.Tensor:
    """The filters as thresholds on the logits, each a (R, 1) column or None (no row uses it;
    a row without a limit has min_p 0, top_k V, top_p 1). Only the `candidates` most likely
    tokens are ranked; with `widen`, all of them where those hold less than a row's top_p
    (a branch on the data, which a compiled graph leaves out: its rows' top_p sits under a
    top_k of at most `candidates`, `SamplingParams.graph_draw`)."""
    V = logits.shape[1]
    if min_p is not None:  # p < min_p * max p, in logits: no softmax (min_p 0: log 0 = -inf)
        logits = logits.masked_fill(logits < logits.amax(-1, keepdim=True) + min_p.log(), -math.inf)
    if top_k is None and top_p is None:
        return logits
    top = logits.topk(candidates, -1).values  # descending
    if top_k is not None:
        kth = torch.where(top_k < V, top.gather(1, top_k.clamp(max=candidates) - 1), -math.inf)
        top = top.masked_fill(top < kth, -math.inf)
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p is not None:
        lse = logits.logsumexp(-1, keepdim=True)
        probs = (top - lse).exp()
        if widen and candidates < V and bool(((probs.sum(-1, keepdim=True) < top_p) & (top_p < 1)).any()):
            top = logits.topk(V, -1).values
            probs = (top - lse).exp()
        # A token stays while the tokens ranked above it hold less than top_p (so the most
        # likely one always does): the cut is at the last such token's logit (its ties stay
        # too, whatever order a sort would have put them in).
        kept = (probs.cumsum(-1) - probs < top_p).sum(-1, keepdim=True).clamp_(min=1)  # NaN rows too
        cut = torch.where(top_p < 1, top.gather(1, kept - 1), -math.inf)
        logits = logits.masked_fill(logits < cut, -math.inf)
    return logits


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict | None]
    # row -> the draft tokens its verification kept, which come before token_ids[row]
    accepted: dict[int, list[int]] = dataclasses.field(default_factory=dict)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (first maximum on ties). torch's CPU argmax is a scalar loop; for
    big batches take the max of 64-wide chunks first (vectorized), then argmax inside the
    winning chunk: same answer, several times faster."""
    N, V = x.shape
    if N < 8 or V % 64 or x.device.type != "cpu":
        return x.argmax(-1)
    chunks = x.view(N, V // 64, 64)
    best = chunks.amax(-1).argmax(-1)
    return best * 64 + chunks[torch.arange(N), best].argmax(-1)


def apply_biases(
    logits: torch.Tensor, seqs: list[SampleInput], eos_token_ids: frozenset[int]
) -> torch.Tensor:
    """logit_bias added; under min_tokens, the stop token ids (and EOS, unless ignored) made impossible."""
    entries = []  # (row, token id, value)
    for i, s in enumerate(seqs):
        p = s.params
        entries += [(i, t, b) for t, b in p.logit_bias.items()]
        if p.min_tokens and len(s.output_token_ids) < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else eos_token_ids)
            entries += [(i, t, -math.inf) for t in stops]
    entries = [e for e in entries if e[1] < logits.shape[1]]
    if not entries:
        return logits
    rows, cols, values = zip(*entries, strict=True)
    dev = logits.device
    index = (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev))
    return logits.index_put(index, torch.tensor(values, dtype=logits.dtype, device=dev), accumulate=True)


@dataclass
class TokenMasks:
    """The allowed next tokens of the constrained rows of a batch."""

    rows: list[int]
    bitmask: torch.Tensor  # (len(rows), ceil(V / 32)) int32


def apply_token_masks(logits: torch.Tensor, masks: TokenMasks | None) -> torch.Tensor:
    """Tokens outside a row's grammar made impossible (the bitmask is llguidance's: bit j of
    word w allows token 32 * w + j)."""
    if masks is None:
        return logits
    dev, V = logits.device, logits.shape[1]
    shifts = torch.arange(32, device=dev, dtype=torch.int32)
    bits = (masks.bitmask.to(dev)[:, :, None] >> shifts) & 1
    allowed = bits.view(len(masks.rows), -1)[:, :V].bool()
    rows = torch.tensor(masks.rows, device=dev)
    logits = logits.clone()
    logits[rows] = logits[rows].masked_fill(~allowed, -math.inf)
    return logits


def sample(
    logits: torch.Tensor,
    seqs: list[SampleInput],
    eos_token_ids: frozenset[int] = frozenset(),
    masks: TokenMasks | None = None,
) -> SampleResult:
    """One token per row of `logits` (N, V); row i belongs to `seqs[i]`, and `masks` limit
    the constrained rows to their grammar's tokens."""
    logits = logits.float()
    params = [s.params for s in seqs]
    raw_logprobs = torch.log_softmax(logits, -1) if any(p.logprobs is not None for p in params) else None
    logits = _adjust(logits, seqs, eos_token_ids, masks)
    greedy = [p.greedy for p in params]
    if all(greedy):
        tokens = argmax(logits)
    else:
        drawn = race(
            _probs(logits, params), [None if g else s.generator for s, g in zip(seqs, greedy, strict=True)]
        )
        if any(greedy):
            mask = torch.tensor(greedy, device=logits.device)
            drawn = torch.where(mask, argmax(logits), drawn)
        tokens = drawn
    token_ids = tokens.tolist()
    return SampleResult(token_ids, _logprobs(raw_logprobs, token_ids, params))


def _adjust(
    logits: torch.Tensor, seqs: list[SampleInput], eos_token_ids: frozenset[int], masks: TokenMasks | None
) -> torch.Tensor:
    """The logits the draw is made from, before temperature: biases, penalties, grammar masks."""
    logits = apply_biases(logits, seqs, eos_token_ids)
    logits = apply_penalties(logits, seqs)
    return apply_token_masks(logits, masks)


def _probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The sampling distributions of adjusted logits: temperature (1 for greedy rows), then
    min_p / top_k / top_p."""
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=logits.device)
    return apply_filters(logits / temps[:, None], params).softmax(-1)


def race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One draw per row of `probs` (unnormalized is fine): the exponential race, with a
    row's noise from its generator where it has one."""
    seeded = [i for i, g in enumerate(generators) if g is not None]
    u = (
        torch.rand(probs.shape, device=probs.device)
        if len(seeded) < len(generators)
        else torch.empty_like(probs)
    )
    for i in seeded:
        u[i].uniform_(generator=generators[i])
    return argmax(exponential_race(probs, u))


def exponential_race(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """p / q for q = -log(u), u uniform: q is Exp(1), as `exponential_` draws, in a sixth of
    its time on CPU (a scalar loop there: 80 us a 4096-token row, most of a sampled step's
    sampler; benchmarks/README.md, "Single stream"). Its argmax is the draw."""
    return probs / u.log().neg_().clamp_min_(1e-10)


def _draw_knobs(params: SamplingParams, vocab: int) -> tuple[list[float], int]:
    """A row's `plain_draw` knobs: [temperature, top_p, min_p] and its top_k (the vocabulary:
    no limit)."""
    top_k = params.top_k if 0 < params.top_k < vocab else vocab
    return [params.temperature, params.top_p, params.min_p], top_k


def plain_draw_inputs(
    params: SamplingParams,
    generator: torch.Generator | None,
    steps: int,
    vocab: int,
    device,
    rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `plain_draw` reads for `steps` draws of a `graph_draw` sampled request: (1, 3) its
    temperature, top_p and min_p; (1, 1) its top_k; (rows, vocab) noise (`rows` default
    `steps`), its first `steps` rows uniform from its generator, the numbers `race` draws
    over as many steps (the rest unset: a shorter run never reads them)."""
    knobs, top_k = _draw_knobs(params, vocab)
    noise = torch.empty(rows or steps, vocab, device=device)
    noise[:steps].uniform_(generator=generator)
    return torch.tensor([knobs], device=device), torch.tensor([[top_k]], device=device), noise


def batch_draw_inputs(
    seqs: list[SampleInput], vocab: int, device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `plain_draw` reads for one draw of each of `seqs` (`graph_draw` ones), a row each:
    (R, 3) knobs, (R, 1) top_k, (R, vocab) noise. A sampled row's noise is the numbers `race`
    would draw for it (a seeded row's from its generator), so the draw is `sample`'s token;
    greedy rows (temperature 0: their argmax) read none."""
    rows = [_draw_knobs(s.params, vocab) for s in seqs]
    sampled = [(i, s.generator) for i, s in enumerate(seqs) if not s.params.greedy]
    noise = (torch.rand if any(g is None for _, g in sampled) else torch.empty)(
        len(seqs), vocab, device=device
    )
    for i, generator in sampled:
        if generator is not None:
            noise[i].uniform_(generator=generator)
    knobs = torch.tensor([knobs for knobs, _ in rows], device=device)
    return knobs, torch.tensor([[top_k] for _, top_k in rows], device=device), noise


def plain_draw(
    logits: torch.Tensor, knobs: torch.Tensor, top_k: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """Each row's token (`SamplingParams.graph_draw`) in tensor ops alone, for a compiled
    graph: `sample`'s temperature, filters and race, the filters ranking GRAPH_CANDIDATES
    tokens with no data-dependent branch; from the same noise, `sample`'s token. A greedy
    row's (temperature 0) is its argmax, whatever its noise."""
    temperature, top_p, min_p = knobs.split(1, 1)
    greedy = temperature < GREEDY_BELOW
    x = logits.float() / temperature.masked_fill(greedy, 1.0)
    filtered = filter_logits(x, min_p, top_k, top_p, min(GRAPH_CANDIDATES, x.shape[1]), widen=False)
    drawn = exponential_race(filtered.softmax(-1), u).argmax(-1)
    return torch.where(greedy.squeeze(1), logits.argmax(-1), drawn)


class _Ahead:
    """A sequence as the sampler sees it at draft row j: with the draft's first j tokens
    already in its output (penalties and min_tokens count them)."""

    def __init__(self, seq: SampleInput, extra: list[int]):
        self.seq, self.extra = seq, extra
        self.params, self.generator = seq.params, seq.generator

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seq.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + self.extra


def residual(p: torch.Tensor, token: int) -> torch.Tensor:
    """max(0, p - q) normalized, for q the point mass at `token` (a deterministic draft's
    proposal): p without `token`, renormalized."""
    r = p.clone()
    r[token] = 0
    return r / r.sum()


def verify_draft(probs: torch.Tensor, draft: list[int], generator: torch.Generator | None) -> tuple[int, int]:
    """Rejection sampling of a draft proposed deterministically (Leviathan et al. 2023):
    `probs` (len(draft) + 1, V) are the target's distributions after each prefix of the
    draft. Draft token j is kept with probability p_j(d_j); the first rejected one is
    replaced by a draw from `residual(p_j, d_j)`, and if all are kept one more token is
    drawn from the last row. Every token so produced is distributed as the target's own.
    Returns (tokens kept, the token after them)."""
    d = len(draft)
    u = torch.rand(d, generator=generator, device=probs.device)
    p_draft = probs[torch.arange(d, device=probs.device), torch.tensor(draft, device=probs.device)]
    rejected = (u >= p_draft).tolist()
    kept = rejected.index(True) if True in rejected else d
    dist = residual(probs[kept], draft[kept]) if kept < d else probs[d]
    return kept, int(race(dist[None], [generator])[0])


def greedy_verdict(target: list[int], draft: list[int]) -> tuple[int, int]:
    """A greedy draft's verdict from `target`, the argmax after the last token and after
    each draft token: the draft's prefix greedy decoding would have produced too, then
    greedy's own next token. (kept, next token)."""
    kept = next((j for j, token in enumerate(draft) if target[j] != token), len(draft))
    return kept, target[kept]


def speculative_sample(
    logits: torch.Tensor,
    seqs: list[SampleInput],
    drafts: list[list[int]],
    eos_token_ids: frozenset[int] = frozenset(),
) -> list[tuple[int, int]]:
    """Verify each sequence's draft: `logits` has len(draft) + 1 rows per sequence, in
    order (after its last token and after each draft token). Greedy rows keep the draft's
    prefix their argmax agrees with, then the argmax (greedy's own output); sampled rows go
    through `verify_draft` with the request's generator (a seeded request's tokens are the
    same run to run). (kept, next token) per sequence."""
    rows = [_Ahead(s, d[:j]) for s, d in zip(seqs, drafts, strict=True) for j in range(len(d) + 1)]
    params = [r.params for r in rows]
    logits = _adjust(logits.float(), rows, eos_token_ids, None)
    greedy = argmax(logits).tolist() if any(p.greedy for p in params) else None
    probs = _probs(logits, params) if not all(p.greedy for p in params) else None
    out, at = [], 0
    for s, d in zip(seqs, drafts, strict=True):
        if s.params.greedy:
            out.append(greedy_verdict(greedy[at : at + len(d) + 1], d))
        else:
            out.append(verify_draft(probs[at : at + len(d) + 1], d, s.generator))
        at += len(d) + 1
    return out


def _logprobs(raw: torch.Tensor | None, token_ids: list[int], params) -> list[dict | None]:
    if raw is None:
        return [None] * len(token_ids)
    k = max(p.logprobs or 0 for p in params)
    chosen = raw.gather(1, torch.tensor(token_ids, device=raw.device)[:, None])[:, 0].tolist()
    top_vals, top_ids = raw.topk(k, -1) if k else (raw[:, :0], raw[:, :0].long())
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    out: list[dict | None] = []
    for i, p in enumerate(params):
        if p.logprobs is None:
            out.append(None)
            continue
        top = dict(zip(top_ids[i][: p.logprobs], top_vals[i][: p.logprobs], strict=True))
        out.append({"token_id": token_ids[i], "logprob": chosen[i], "top": top})
    return out
