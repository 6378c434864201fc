"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step serves the running decodes first, then continues running prefills, then
admits waiting sequences, all within `max_num_batched_tokens` (a prompt longer than
what is left is prefilled in chunks over several steps) and `max_num_seqs`. Blocks
are allocated as tokens are scheduled; when none are left, the newest running
sequence is preempted: its blocks are freed and it waits at the head of the queue
to be recomputed (its cached prefix blocks usually survive, so that is cheap).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from lmops.runtime.engine.kv_cache import BlockManager
from lmops.runtime.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    prefix_queries: int = 0
    prefix_hits: int = 0

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        for decodes in (True, False):
            for seq in list(self.running):
                if budget == 0:
                    break
                todo = seq.num_tokens - seq.num_computed_tokens
                if seq.seq_id in scheduled or seq.status is not Status.RUNNING or (todo == 1) != decodes:
                    continue
                n = min(todo, budget)
                while (copies := self.bm.allocate(seq, seq.num_computed_tokens + n)) is None:
                    victim = next(s for s in reversed(self.running) if s.seq_id not in scheduled)
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
        return batch

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
        self.bm.register(seq, seq.num_computed_tokens + n)
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n)
        batch.copies.extend(copies)

    def preempt(self, seq: Sequence) -> None:
        """Drop seq's KV and requeue it first; it is recomputed from its tokens later."""
        self.running.remove(seq)
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def add_running(self, seq: Sequence) -> None:
        """A fork that shares its parent's blocks joins the running batch directly."""
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of the queues and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)
