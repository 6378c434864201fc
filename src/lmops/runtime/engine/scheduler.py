"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step serves the running decodes first, then continues running prefills, then
admits waiting sequences, all within `max_num_batched_tokens` (a prompt longer than
what is left is prefilled in chunks over several steps) and `max_num_seqs`. Blocks
are allocated as tokens are scheduled; when none are left, the newest running
sequence is preempted: its blocks are freed and it waits at the head of the queue
to be recomputed (its cached prefix blocks usually survive, so that is cheap).

Under the "priority" policy (vLLM's) the waiting queue is kept in order of the requests'
`priority` (lower first), then arrival; running sequences are served in that order and
the preemption victim is the last of it: the lowest priority, newest first.

With `num_speculative_tokens`, a decode also carries a draft (`ngram_draft`: prompt
lookup, or a draft model's greedy tokens, draft.py): its tokens are computed in the same forward as the sequence's
last token, and the verifier keeps the prefix that greedy decoding would have produced
anyway, or, for a sampled request, what rejection sampling accepts (engine.py's `_verify`,
sampling.py's `speculative_sample`).

With `num_scheduler_steps` S (vLLM's multi-step scheduling), a lone decode whose draw a
graph can make (`SamplingParams.graph_draw`: greedy, or sampled with temperature and the
filters alone) gets a lookahead of up to S - 1 tokens: the
compiled graph generates them after its next token, each step's token (argmax or draw) the
next one's input, so one step of the engine makes up to S tokens (compiled.py). With
`lookup_tokens` too (prompt lookup, compiled: S x (1 + K)), a lone greedy decode drafts in
the graph's loop instead of here: it gets a lookahead of up to that many - 1, no draft, and the graph drafts, verifies and
keeps greedy's tokens until it has made them all.

`update` is the step's other half: it applies what the runner computed and the sampler
drew (tokens appended, prompt scores recorded, rejected draft tokens rolled back, finished
sequences freed), as nano-vllm's `postprocess` and vLLM's `update_from_output`.
"""

from __future__ import annotations

import bisect
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from lmops.runtime.engine.kv_cache import BlockManager
from lmops.runtime.engine.sampling import SampleResult
from lmops.runtime.engine.sequence import PromptScores, Request, Sequence, Status


class Proposer(Protocol):
    """Where drafts come from: `NgramProposer`, or a draft model (draft.py's `DraftModel`)."""

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to k draft tokens to follow seq's tokens."""

    def drop(self, seq: Sequence) -> None:
        """Forget seq (preempted, finished or aborted)."""


class NgramProposer:
    """Prompt lookup (`ngram_draft`): no state."""

    def propose(self, seq: Sequence, k: int) -> list[int]:
        return ngram_draft(seq.token_ids, k)

    def drop(self, seq: Sequence) -> None:
        pass


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    prefix_queries: int = 0
    prefix_hits: int = 0
    # Indices into `seqs` of the sequences that reach their last token this step: the runner
    # returns one logits row for each, in this order (1 + len(draft) rows for a drafted one).
    ready: list[int] = field(default_factory=list)
    # Who draws a token from which of those rows: a ready sequence, and after it the siblings
    # an n > 1 request forks from it at its first sample (they share its row).
    samples: list[Sequence] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    # Ready sequences (with their forks) that asked for prompt log-probs only (max_tokens 0).
    prompt_only: list[Sequence] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)


@dataclass
class StepUpdate:
    """What a step changed: the requests it touched (in order) and the tokens each gained."""

    requests: dict[str, Request] = field(default_factory=dict)
    new_tokens: dict[str, int] = field(default_factory=dict)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        eos_token_ids: frozenset[int] = frozenset(),
        num_speculative_tokens: int = 0,
        policy: str = "fcfs",
        proposer: Proposer | None = None,
        num_scheduler_steps: int = 1,
        lookup_tokens: int = 0,
    ):
        self.bm = block_manager
        self.by_priority = policy == "priority"
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = eos_token_ids
        self.num_speculative_tokens = num_speculative_tokens
        self.proposer = proposer or NgramProposer()
        self.num_scheduler_steps = num_scheduler_steps
        self.lookup_tokens = lookup_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        if self.by_priority:
            self._enqueue(seq)
        else:
            self.waiting.append(seq)

    @staticmethod
    def _rank(seq: Sequence) -> tuple[int, float, int]:
        """Serving order under the priority policy: priority, then arrival."""
        return seq.request.priority, seq.request.metrics.arrival_time, seq.seq_id

    def _enqueue(self, seq: Sequence) -> None:
        self.waiting.insert(bisect.bisect(self.waiting, self._rank(seq), key=self._rank), seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        order = sorted(self.running, key=self._rank) if self.by_priority else list(self.running)
        for decodes in (True, False):
            for seq in order:
                if budget == 0:
                    break
                todo = seq.num_tokens - seq.num_computed_tokens
                if seq.seq_id in scheduled or seq.status is not Status.RUNNING or (todo == 1) != decodes:
                    continue
                n = min(todo, budget)
                if decodes and self.num_speculative_tokens and not self._drafts_in_graph(seq):
                    seq.draft = self._draft(seq, budget - 1)
                    n += len(seq.draft)
                if decodes and not seq.draft:
                    seq.lookahead = self._lookahead(seq, budget - 1)
                    n += seq.lookahead
                while (copies := self.bm.allocate(seq, seq.num_computed_tokens + n)) is None:
                    victim = next(
                        s for s in reversed(order) if s.status is Status.RUNNING and s.seq_id not in scheduled
                    )
                    self.preempt(victim)
                    batch.preempted.append(victim)
                    if victim is seq:
                        break
                if copies is None:
                    continue
                self._add(batch, seq, n, copies)
                scheduled.add(seq.seq_id)
                budget -= n
        if not batch.preempted:  # blocks are short: admitting more would only thrash
            budget = self._admit(batch, budget)
        self._plan_samples(batch)
        return batch

    def _plan_samples(self, batch: ScheduledBatch) -> None:
        """Which rows the runner returns and who samples from them. Forks happen here, after
        every allocation of the step (so a fresh sibling is never a preemption victim)."""
        rows = 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            if seq.num_computed_tokens + n < seq.num_tokens:
                continue
            batch.ready.append(i)
            rows += 1 + len(seq.draft) + seq.lookahead
            row = rows - 1  # a drafted sequence samples from the row after its draft
            family = [seq, *self._fork(seq)]
            if seq.request.max_tokens == 0:  # prompt log-probs only: nothing to sample
                batch.prompt_only.extend(family)
                continue
            batch.samples.extend(family)
            batch.sample_rows.extend([row] * len(family))

    def _draft(self, seq: Sequence, room: int) -> list[int]:
        """Up to `num_speculative_tokens` draft tokens for a decode, within `room` tokens of
        the step's budget, the request's max_tokens, and the free blocks (a draft never
        causes a preemption). Greedy and sampled requests alike (penalties, biases, seeds:
        the verifier computes each draft row's distribution as the sampler would), but not
        a grammar's (its matcher would have to advance through the draft and roll back) nor
        one asking for logprobs (accepted draft tokens would need their own log-probs), nor a
        prompt's last token that n > 1 siblings fork from (they sample from its row)."""
        if seq.grammar is not None or seq.params.logprobs is not None or seq.pending_forks:
            return []
        k = min(self.num_speculative_tokens, room, seq.request.max_tokens - seq.num_output_tokens - 1)
        draft = self.proposer.propose(seq, k) if k > 0 else []
        if draft and self.bm.num_new_blocks(seq, seq.num_tokens + len(draft)) > self.bm.num_free_blocks:
            return []
        return draft

    def _lookahead(self, seq: Sequence, room: int) -> int:
        """Up to `num_scheduler_steps` - 1 (`lookup_tokens` - 1 for a run that drafts in the
        graph) for a decode that is the only sequence, nothing
        waiting (a newcomer would wait for the whole run of steps), a draw the graph can make
        (`SamplingParams.graph_draw`: a penalised, biased, masked or logprobs row, or top_p
        over the whole vocabulary, needs the eager sampler between steps): as many as `room`,
        the request's max_tokens and the free blocks allow (the graph's loop runs any count)."""
        run = self.lookup_tokens if self._drafts_in_graph(seq) else self.num_scheduler_steps
        k = min(run - 1, room, seq.request.max_tokens - seq.num_output_tokens - 1)
        if k <= 0 or not self._alone(seq) or not seq.graph_draws:
            return 0
        while k and self.bm.num_new_blocks(seq, seq.num_tokens + k) > self.bm.num_free_blocks:
            k -= 1
        return k

    def _alone(self, seq: Sequence) -> bool:
        """The only sequence, nothing waiting, no siblings to fork: a multi-step run's."""
        return len(self.running) == 1 and not self.waiting and not seq.pending_forks

    def _drafts_in_graph(self, seq: Sequence) -> bool:
        """A lone greedy decode whose run drafts in the graph (`lookup_tokens` > 0)."""
        return self.lookup_tokens > 0 and seq.params.greedy and seq.graph_draws and self._alone(seq)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """At the first sample of an n > 1 request: siblings sharing the prompt's blocks."""
        children = [parent.fork(i) for i in range(1, parent.pending_forks + 1)]
        for child in children:
            child.num_computed_tokens = parent.num_tokens  # the prompt this very step computes
            self.bm.share(parent)
            self.running.append(child)
            parent.request.seqs.append(child)
        parent.pending_forks = 0
        return children

    def update(
        self, batch: ScheduledBatch, scores: list[PromptScores], sampled: SampleResult | None
    ) -> StepUpdate:
        """Apply a step: the scheduled tokens are computed, the prompt scores recorded, the
        sampled tokens appended; finished sequences leave the queues and free their blocks."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
        for score in scores:
            score.seq.add_prompt_scores(score)
        update = StepUpdate()
        for seq in batch.prompt_only:
            seq.finish_prompt_only()
            self.remove(seq)
            update.requests.setdefault(seq.request.request_id, seq.request)
        for k, seq in enumerate(batch.samples):
            req = seq.request
            accepted, ahead = sampled.accepted.get(k, []), len(seq.draft) + seq.lookahead
            if ahead:  # KV rollback: the rejected tokens' slots are rewritten when reached
                seq.num_computed_tokens -= ahead - len(accepted)
                seq.draft, seq.lookahead = [], 0
            tokens = [*accepted, sampled.token_ids[k]]
            for j, token in enumerate(tokens):
                logprob = sampled.logprobs[k] if j == len(tokens) - 1 else None
                seq.append(token, logprob, self.eos_token_ids, req.max_tokens)
                update.new_tokens[req.request_id] = update.new_tokens.get(req.request_id, 0) + 1
                if seq.is_finished:
                    break
            if seq.is_finished:
                self.remove(seq)
            elif ahead:
                self.bm.truncate(seq, seq.num_tokens)
            update.requests.setdefault(req.request_id, req)
        return update

    def _admit(self, batch: ScheduledBatch, budget: int) -> int:
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if len(self.running) + 1 + seq.pending_forks > self.max_num_seqs:
                break
            # A prompt being scored (drift signal, prompt log-probs) is prefilled whole: cached
            # blocks hold K/V, not the log-probs it needs. (It still caches its blocks for others.)
            hits, hashes = ([], []) if seq.scoring else self.bm.match_prefix(seq.token_ids)
            cached = len(hits) * self.bm.block_size
            n = min(seq.num_tokens - cached, budget)
            copies = self.bm.allocate(seq, cached + n, hits, hashes)
            if copies is None:
                break
            self.waiting.popleft()
            seq.num_computed_tokens = cached
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.admitted.append(seq)
            batch.prefix_queries += seq.num_tokens
            batch.prefix_hits += cached
            self._add(batch, seq, n, copies)
            budget -= n
        return budget

    def _add(self, batch: ScheduledBatch, seq: Sequence, n: int, copies) -> None:
        self.bm.register(seq, min(seq.num_computed_tokens + n, seq.num_tokens))  # not a draft's blocks
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n)
        batch.copies.extend(copies)

    def preempt(self, seq: Sequence) -> None:
        """Drop seq's KV and requeue it first; it is recomputed from its tokens later."""
        self.running.remove(seq)
        self.bm.free(seq)
        self.proposer.drop(seq)
        seq.num_computed_tokens = 0
        seq.draft, seq.lookahead = [], 0
        seq.status = Status.WAITING
        if self.by_priority:
            self._enqueue(seq)  # before later arrivals of its priority
        else:
            self.waiting.appendleft(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of the queues and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)
        self.proposer.drop(seq)


def ngram_draft(token_ids: list[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Prompt lookup: the (up to) k tokens that followed the latest earlier occurrence of the
    sequence's last n tokens, for the longest min_n <= n <= max_n that occurs; [] if none does. An
    occurrence with k tokens after it comes first (in a loop the latest one has only the
    last token after it). Searched as bytes: `rfind` is C, a Python scan of a long context
    is not."""
    buf = array("i", token_ids).tobytes()
    size = array("i").itemsize  # bytes per token
    for n in range(min(max_n, len(token_ids) - 1), min_n - 1, -1):
        tail = buf[-n * size :]
        for after in (k, 1):  # tokens the occurrence must leave after it
            end = len(buf) - after * size
            while (at := buf.rfind(tail, 0, end)) >= 0:
                if at % size == 0:
                    start = at // size + n
                    return token_ids[start : start + k]
                end = at + len(tail) - 1
    return []
