"""Request and sequence state, streaming detokenization, stop strings, and the output types.

A `Request` is what a user asked for (one prompt, n completions); each completion is a
`Sequence` with its own tokens, block table and text. A request with n > 1 runs its
prompt once: the first sequence prefills, and at its first sample it forks into n
sequences that share the prompt's KV blocks.
"""

from __future__ import annotations

import copy
import enum
import itertools
import logging
from dataclasses import dataclass, field

import llguidance
import torch
from tokenizers import Tokenizer

from lmops.runtime.engine.metrics import RequestMetrics
from lmops.runtime.engine.sampling import SamplingParams, seeded_generator

log = logging.getLogger(__name__)

# Prompt tokens decoded ahead of the first output token: tokenizers whose decoding
# depends on the left neighbour (leading-space handling) then render it correctly.
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Token-by-token text that never ends inside a UTF-8 character.

    Decodes a short window `ids[prefix:]` and emits only what extends the text of
    `ids[prefix:read]`; while the window decodes to a trailing U+FFFD (an incomplete
    byte sequence) it waits for the next token. `flush` emits whatever is left.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tok, self.skip = tokenizer, skip_special_tokens
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix = 0
        self.read = len(self.ids)

    def _window(self) -> tuple[str, str]:
        done = self.tok.decode(self.ids[self.prefix : self.read], skip_special_tokens=self.skip)
        full = self.tok.decode(self.ids[self.prefix :], skip_special_tokens=self.skip)
        return done, full

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        done, full = self._window()
        if len(full) > len(done) and not full.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return full[len(done) :]
        return ""

    def flush(self) -> str:
        done, full = self._window()
        self.prefix = self.read = len(self.ids)
        return full[len(done) :] if len(full) > len(done) else ""

    def copy(self) -> IncrementalDetokenizer:
        new = IncrementalDetokenizer.__new__(IncrementalDetokenizer)
        new.tok, new.skip, new.ids, new.prefix, new.read = (
            self.tok,
            self.skip,
            list(self.ids),
            self.prefix,
            self.read,
        )
        return new


def held_back(text: str, start: int, stops: list[str]) -> int:
    """Length of the longest tail of text[start:] that could still grow into a stop string."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text) - start), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class PromptScores:
    """What the runner computed for prompt positions `start` .. `start + len(logprobs)` of
    one sequence: the log-prob of the token each predicts (position p predicts token p + 1),
    its rank, and the top alternatives (`top_ids`, `top_logprobs`; empty lists unless the
    step's requests asked for prompt_logprobs)."""

    seq: Sequence
    start: int
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


class Sequence:
    """One completion: tokens (prompt + output), KV bookkeeping, text and stop state."""

    _ids = itertools.count()  # seq_id: unique in the process

    def __init__(
        self,
        request: Request,
        index: int,
        detok: IncrementalDetokenizer,
        generator: torch.Generator | None,
        grammar: llguidance.LLMatcher | None = None,
    ):
        self.seq_id, self.request, self.index = next(Sequence._ids), request, index
        # Structured outputs: the grammar's state after this sequence's output tokens.
        self.grammar = grammar
        self.params: SamplingParams = request.params
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []
        self.status = Status.WAITING
        self.pending_forks = 0
        # Speculative decoding: tokens proposed for this step after the last one (scheduler.py),
        # computed with it and kept as far as greedy decoding agrees.
        self.draft: list[int] = []
        # Multi-step decoding: how many tokens after the next one this step's graph generates
        # itself (greedy, so all are kept); their slots are reserved as a draft's are.
        self.lookahead = 0
        self.generator = generator
        self.detok = detok
        self.text = ""  # decoded output, including a tail held back for stop strings
        self.visible = 0  # len(text) that may be shown
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.logprobs: list[dict] | None = [] if request.params.logprobs is not None else None
        self.sent_text = 0  # what the previous RequestOutput carried
        self.sent_tokens = 0
        # The prompt's own log-probs, riding on its prefill: while `scoring`, the runner
        # scores each prompt token its rows predict (runner.score_prompts), and
        # `add_prompt_scores` adds the NLL (nats) to `prompt_nll` for the drift signal when
        # `score_prompt`, and appends entries to the request's `prompt_logprobs` when asked;
        # positions < `num_scored` are done (a recompute after preemption skips them).
        self.score_prompt = False
        self.prompt_nll = 0.0
        self.num_scored = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def graph_draws(self) -> bool:
        """A compiled graph can make this sequence's tokens: `SamplingParams.graph_draw`, and no
        grammar masks the logits."""
        return self.params.graph_draw and self.grammar is None

    @property
    def scoring(self) -> bool:
        """Prompt positions still to go through the LM head. Such a sequence is prefilled
        whole: cached prefix blocks hold K/V, not the log-probs it needs."""
        wanted = self.score_prompt or self.request.prompt_logprobs is not None
        return wanted and self.num_scored < self.num_prompt_tokens - 1

    def fork(self, index: int) -> Sequence:
        """Completion `index` of the request at the same point, sharing (by reference) the KV
        blocks; a seeded request's siblings draw from generators of their own."""
        grammar = None if self.grammar is None else self.grammar.deep_copy()
        generator = None
        if self.generator is not None:
            generator = seeded_generator(self.params.seed, index, self.generator.device)
        child = Sequence(self.request, index, self.detok.copy(), generator, grammar)
        child.token_ids = list(self.token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.block_table = list(self.block_table)
        child.block_hashes = list(self.block_hashes)
        child.status = self.status
        child.num_scored = self.num_prompt_tokens - 1  # the prompt is scored once, by the first sequence
        return child

    def add_prompt_scores(self, scores: PromptScores) -> None:
        """Record the runner's scores of prompt positions from `scores.start` on."""
        n = len(scores.logprobs)
        self.num_scored = scores.start + n
        if self.score_prompt:
            self.prompt_nll -= sum(scores.logprobs)
        out, want = self.request.prompt_logprobs, self.request.params.prompt_logprobs
        if out is None:
            return
        targets = self.token_ids[scores.start + 1 : scores.start + n + 1]
        for j, token in enumerate(targets):
            top = dict(zip(scores.top_ids[j][:want], scores.top_logprobs[j][:want], strict=True))
            out.append(
                {"token_id": token, "logprob": scores.logprobs[j], "rank": scores.ranks[j], "top": top}
            )

    def append(self, token_id: int, logprob: dict | None, eos_ids: frozenset[int], max_tokens: int) -> None:
        """Record a sampled token: text, stop strings, stop tokens (none before min_tokens), the
        grammar's end (nothing may follow: "stop", even at the length limit), length limit."""
        p = self.params
        self.token_ids.append(token_id)
        if self.logprobs is not None:
            self.logprobs.append(logprob)
        may_stop = self.num_output_tokens >= p.min_tokens  # (the sampler also masks stop tokens until then)
        if may_stop and (token_id in p.stop_token_ids or (not p.ignore_eos and token_id in eos_ids)):
            self.text += self.detok.flush()  # the stop token's own text is not part of the output
            self._finish("stop", token_id)
            return
        if self.grammar is not None and not self.grammar.consume_token(token_id):
            # the mask forbids such a token, so this is a bug: end this sequence, not the engine
            log.error(
                "sequence %d: token %d breaks its grammar: %s",
                self.seq_id,
                token_id,
                self.grammar.get_error(),
            )
            self._finish("abort", None)
            return
        complete = self.grammar is not None and self.grammar.is_stopped()
        start = self.visible
        self.text += self.detok.add(token_id)
        if complete or self.num_output_tokens >= max_tokens:
            self.text += self.detok.flush()
        for s in p.stop if may_stop else ():
            at = self.text.find(s, max(0, start - len(s) + 1))
            if at >= 0:
                self.text = self.text[: at + len(s) if p.include_stop_str_in_output else at]
                self._finish("stop", s)
                return
        if complete:
            self._finish("stop", None)
            return
        if self.num_output_tokens >= max_tokens:
            self._finish("length", None)
            return
        self.visible = len(self.text) - held_back(self.text, self.visible, p.stop)

    def finish_prompt_only(self) -> None:
        """max_tokens 0: the prefill (and its prompt log-probs) was all that was asked."""
        self._finish("length", None)

    def _finish(self, reason: str, stop_reason: str | int | None) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.visible = len(self.text)
        self.status = Status.FINISHED


class Request:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        arrival_time: float,
        grammar: llguidance.LLMatcher | None = None,
        priority: int = 0,
        score_prompt: bool = False,
    ):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        # The prompt's bits/byte wanted whatever the drift sample says (the service's shadow
        # comparison scores the same prompts on two models).
        self.score_prompt = score_prompt
        self.params, self.max_tokens = params, max_tokens
        self.priority = priority  # vLLM's: lower runs first (the "priority" scheduling policy)
        self.grammar = grammar  # the first sequence's; its siblings copy it when they fork
        self.metrics = RequestMetrics(arrival_time, num_prompt_tokens=len(prompt_token_ids))
        self.seqs: list[Sequence] = []
        # vLLM's prompt_logprobs: None for the first token (nothing predicts it), then one
        # {"token_id", "logprob", "rank", "top"} per prompt token; complete once prefilled.
        self.prompt_logprobs: list[dict | None] | None = None if params.prompt_logprobs is None else [None]
        self.aborted = False
        self.final_only = False  # generate() needs no intermediate outputs: skip building them

    @property
    def finished(self) -> bool:
        return self.aborted or (len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs))


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    delta_text: str
    delta_token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[dict] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(repr=False, default=None)
    prompt_logprobs: list[dict | None] | None = None

    # The first completion's fields, for the common n == 1 case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


def make_output(req: Request) -> RequestOutput:
    """Snapshot of `req` (fresh lists: safe to hand to another thread); advances the deltas."""
    outs = []
    for s in sorted(req.seqs, key=lambda s: s.index):
        ids = s.output_token_ids
        outs.append(
            CompletionOutput(
                index=s.index,
                text=s.text[: s.visible],
                token_ids=ids,
                delta_text=s.text[s.sent_text : s.visible],
                delta_token_ids=ids[s.sent_tokens :],
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                logprobs=None if s.logprobs is None else list(s.logprobs),
            )
        )
        s.sent_text, s.sent_tokens = s.visible, len(ids)
    plp = req.prompt_logprobs
    # Complete lists only; a complete one is never written again, so it is shared, not copied.
    plp = plp if plp is not None and len(plp) == len(req.prompt_token_ids) else None
    return RequestOutput(
        req.request_id,
        req.prompt,
        list(req.prompt_token_ids),
        outs,
        req.finished,
        copy.copy(req.metrics),
        plp,
    )
