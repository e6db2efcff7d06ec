"""Continuous batching: which sequences run in the next step, and how many tokens each.

One token budget per step. Running sequences go first, oldest first (a decode needs one
token, an unfinished chunked prefill the rest of its prompt up to the budget); waiting
sequences are then admitted in arrival order into what is left, their prompts chunked to fit;
the full blocks a step will compute are in the prefix cache at once, so a request admitted after
another with the same prefix, even in the same step, computes only what differs.
When the KV cache runs out, the newest running sequence is preempted: its blocks are freed
and it goes back to the front of the waiting queue to be recomputed later (its cached full
blocks usually make that cheap). Nothing it generated is lost: its tokens stay in the sequence.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from .config import EngineConfig
from .kv_cache import KVCacheManager
from .sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens to compute for each sequence in this step

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager) -> None:
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.recomputed_tokens = 0
        self.queue_delay_sum = 0.0  # seconds from arrival to first admission, summed
        self.num_admitted = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch([], [])
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(len(seq) - seq.num_computed_tokens, budget)
            while not self.kv.allocate(seq, n):
                self._preempt(self.running.pop())
                preempted = True
                if seq.status is Status.WAITING:  # it preempted itself
                    break
            else:
                self._scheduled(batch, seq, n)
                budget -= n
                i += 1
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = self.kv.match_prefix(seq)
            n = min(len(seq) - seq.num_computed_tokens - len(hits) * self.kv.block_size, budget)
            if not self.kv.allocate(seq, n, hits):
                break
            self.waiting.popleft()
            if not seq.num_preemptions:
                self.queue_delay_sum += time.monotonic() - seq.arrival
                self.num_admitted += 1
            seq.status = Status.RUNNING
            self.running.append(seq)
            self._scheduled(batch, seq, n)
            budget -= n
        return batch

    def _scheduled(self, batch: ScheduledBatch, seq: Sequence, n: int) -> None:
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n)
        self.kv.cache_full_blocks(seq, seq.num_computed_tokens + n)  # the rest of this step may hit them

    def _preempt(self, seq: Sequence) -> None:
        self.recomputed_tokens += seq.num_computed_tokens
        self.kv.free(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def fork(self, parent: Sequence, n: int) -> list[Sequence]:
        """Split `parent` (just prefilled) into `n` choices sharing its blocks."""
        children = [parent.fork(i) for i in range(1, n)]
        at = self.running.index(parent) + 1
        for child in children:
            self.kv.share(parent, child)
        self.running[at:at] = children
        return children

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.is_finished:
            return
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.kv.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        seqs = [s for s in (*self.running, *self.waiting) if s.request_id == request_id]
        for seq in seqs:
            self.finish(seq, "abort")
        return seqs
