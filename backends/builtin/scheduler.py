"""Continuous batching: which sequences run in the next step, and how many tokens each.

One token budget per step. Running sequences go first, oldest first (a decode needs one
token, an unfinished chunked prefill the rest of its prompt up to the budget); waiting
sequences are then admitted in queue order into what is left, their prompts chunked to fit.
The full blocks a step will compute are in the prefix cache at once, so a request admitted after
another with the same prefix, even in the same step, computes only what differs.
Requests join the queue cheapest first among those that arrived since the last step: the fewest
tokens left to compute after prefix-cache hits (SGLang's longest-prefix-match order, kept within
one step's arrivals: a request is passed over only by those that came with it). A step whose
first admitted prompt is short admits no long one (more than `long_prefill_tokens` to compute):
of a burst, the requests on a cached prefix take their first token from a short step instead of
waiting for the cold prompts' prefill, which starts one step later.
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
        self.long_prefill_tokens = config.long_prefill_tokens
        self.kv = kv
        self.arrived: list[Sequence] = []  # since the last step, in arrival order
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.recomputed_tokens = 0
        self.queue_delay_sum = 0.0  # seconds from arrival to first admission, summed
        self.num_admitted = 0

    def add(self, seq: Sequence) -> None:
        self.arrived.append(seq)

    @property
    def num_waiting(self) -> int:
        return len(self.arrived) + len(self.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.arrived or self.waiting or self.running)

    def _to_compute(self, seq: Sequence, hits: list[int]) -> int:
        return len(seq) - seq.num_computed_tokens - len(hits) * self.kv.block_size

    def schedule(self) -> ScheduledBatch:
        # sorted() is stable: ties keep arrival order
        self.waiting.extend(sorted(self.arrived, key=lambda seq: self._to_compute(seq, self.kv.match_prefix(seq))))
        self.arrived.clear()
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
        short_first = None  # whether this step's first admitted prompt is short
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = self.kv.match_prefix(seq)
            to_compute = self._to_compute(seq, hits)
            short = to_compute <= self.long_prefill_tokens
            if short_first is None:
                short_first = short
            elif short_first and not short:
                break
            n = min(to_compute, budget)
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
        for queue in (self.running, self.waiting, self.arrived):
            if seq in queue:
                queue.remove(seq)
                break

    def abort(self, request_id: str) -> list[Sequence]:
        seqs = [s for s in (*self.running, *self.waiting, *self.arrived) if s.request_id == request_id]
        for seq in seqs:
            self.finish(seq, "abort")
        return seqs
