"""Continuous batching: which sequences run in the next step, and how many tokens each.

One token budget per step. Running sequences go first, oldest first (a decode needs one
token, an unfinished chunked prefill the rest of its prompt up to the budget); waiting
sequences are then admitted into what is left, their prompts chunked to fit: each tenant's in
its queue's order, the tenants taking turns (`FairQueue`). One tenant's flood of prompts (an
embedding request's many inputs) never sits in front of another tenant's request, which is
admitted after at most one sequence of each other tenant waiting.
The full blocks a step will compute are in the prefix cache at once, so a request admitted after
another with the same prefix, even in the same step, computes only what differs.
Requests join their tenant's queue cheapest first among those that arrived since the last step:
the fewest tokens left to compute after prefix-cache hits (SGLang's longest-prefix-match order,
kept within one step's arrivals: a request is passed over only by those that came with it). A
step whose first admitted prompt is short admits no long one (more than `long_prefill_tokens` to
compute): of a burst, the requests on a cached prefix take their first token from a short step
instead of waiting for the cold prompts' prefill, which starts one step later.
The running sequences use at most `max_loras` LoRA adapters among them (the model's compute
slots): a waiting request on another adapter is passed over, as vLLM's scheduler passes it, until
one of them finishes.
When the KV cache runs out, the newest running sequence is preempted: its blocks are freed
and it goes back to the front of its tenant's queue, whose turn is next, to be recomputed later
(its cached full blocks usually make that cheap). Nothing it generated is lost: its tokens stay in
the sequence.

An embedding request is a sequence that only prefills: scheduled, chunked and cached like any
prompt within the same budget, it finishes once its prompt is computed, with its pooled vector
instead of a token. A mean-pooled one reads no cached prefix and, preempted, starts over: it is
admitted only once the free blocks hold its whole prompt (vLLM schedules such a prompt whole).

With speculative decoding (`num_speculative_tokens`), a decoding sequence may carry draft tokens
proposed by prompt lookup (`NgramProposer`): they take budget and KV slots beside its next token
and are verified in the same forward. A sequence whose grammar constrains its output does not
speculate (its mask at a draft's row would need the grammar advanced by the drafts before it), nor
does one before its first token. Drafts are added once every running sequence has its own token:
they take what is left of the budget and the free blocks, never preempting. Only verified tokens
reach the prefix cache: blocks are registered when their tokens are scheduled, before any draft,
and a rejected draft's slot is written over by the next step (its K/V count as computed only once
accepted).

After the model ran, `update_from_output` applies the step to the sequences, as vLLM v1's
`Scheduler.update_from_output` and nano-vllm's `Scheduler.postprocess` do: the scheduler is the
one writer of a sequence's state (computed tokens, the choices an n > 1 request forks into,
tokens, text, pooled hidden states, status and finish reason).
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from backends.builtin.config import EngineConfig
from backends.builtin.core.kv_cache import KVCacheManager
from backends.builtin.core.ngram import NgramProposer
from backends.builtin.core.sequence import Sequence, Status
from backends.builtin.protocol import Logprob, StepOutput


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens to compute for each sequence in this step, its drafts included
    drafts: dict[Sequence, list[int]] = field(default_factory=dict)  # speculated tokens, computed after its own

    def __bool__(self) -> bool:
        return bool(self.seqs)


@dataclass
class ModelOutput:
    """A step's sampled tokens: for each sequence whose prompt is now computed its next token (a
    speculating one's accepted drafts first), with their logprobs where it asked; one token for
    each further choice of an n > 1 request, forked from that prompt to draw its first token from
    the same logits (`forks`: parent -> its new choices, which the scheduler takes in); and each
    embedding request's share of the step's final hidden states (`pooled`: its prompt's last one once
    computed, or, for mean pooling, the sum of the chunk's)."""

    seqs: list[Sequence]
    tokens: list[list[int]]
    logprobs: list[list[Logprob]]
    forks: dict[Sequence, list[Sequence]]
    pooled: dict[Sequence, torch.Tensor]


class FairQueue:
    """The waiting sequences, a queue per tenant, the tenants taking turns: the next sequence is
    the head of the queue of the tenant whose turn it is, and taking it sends that tenant to the
    back. A tenant new to the queue takes its turn after those waiting; a sequence put back at the
    front (preempted, or passed over) makes its tenant's turn the next. With one tenant it is a
    plain FIFO queue."""

    def __init__(self, tenant_of: Callable[[Sequence], str | None]) -> None:
        self._tenant_of = tenant_of
        self._queues: OrderedDict[str | None, deque[Sequence]] = OrderedDict()  # in turn order

    def __len__(self) -> int:
        return sum(map(len, self._queues.values()))

    def __bool__(self) -> bool:
        return bool(self._queues)  # a tenant's queue is dropped once empty

    def __iter__(self) -> Iterator[Sequence]:
        return itertools.chain.from_iterable(self._queues.values())

    def __contains__(self, seq: Sequence) -> bool:
        return seq in self._queues.get(self._tenant_of(seq), ())

    def first(self) -> Sequence:
        return next(iter(self._queues.values()))[0]

    def popleft(self) -> Sequence:
        tenant, queue = next(iter(self._queues.items()))
        seq = queue.popleft()
        if queue:
            self._queues.move_to_end(tenant)
        else:
            del self._queues[tenant]
        return seq

    def extend(self, seqs: Iterable[Sequence]) -> None:
        for seq in seqs:
            self._queues.setdefault(self._tenant_of(seq), deque()).append(seq)

    def appendleft(self, seq: Sequence) -> None:
        tenant = self._tenant_of(seq)
        self._queues.setdefault(tenant, deque()).appendleft(seq)
        self._queues.move_to_end(tenant, last=False)

    def extendleft(self, seqs: Iterable[Sequence]) -> None:
        for seq in seqs:
            self.appendleft(seq)

    def remove(self, seq: Sequence) -> None:
        tenant = self._tenant_of(seq)
        self._queues[tenant].remove(seq)
        if not self._queues[tenant]:
            del self._queues[tenant]


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, eos_token_ids: frozenset[int],
                 max_model_len: int) -> None:
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.long_prefill_tokens = config.long_prefill_tokens
        self.max_loras = config.max_loras
        self.num_speculative_tokens = config.num_speculative_tokens
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.kv = kv
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.requests: dict[str, int] = {}  # request id -> its choices still generating
        self.tenants: dict[str, str | None] = {}  # request id -> whose it is
        self.arrived: list[Sequence] = []  # since the last step, in arrival order
        self.waiting = FairQueue(lambda seq: self.tenants[seq.request_id])
        self.running: list[Sequence] = []
        self.computed_prompt_tokens = 0  # prefill tokens actually run through the model
        self.num_preemptions = 0
        self.recomputed_tokens = 0
        self.queue_delay_sum = 0.0  # seconds from arrival to first admission, summed
        self.num_admitted = 0
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0  # speculation, summed over steps

    def add(self, seq: Sequence, tenant: str | None = None) -> None:
        """Queue a new request's sequence (its id unique among `requests`), `tenant`'s."""
        self.requests[seq.request_id] = seq.params.n
        self.tenants[seq.request_id] = tenant
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
        if self.num_speculative_tokens:
            budget -= self._speculate(batch, budget)
        short_first = None  # whether this step's first admitted prompt is short
        passed_over = []  # on an adapter that has no slot this step
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.first()
            if not self._adapter_fits(seq):
                passed_over.append(self.waiting.popleft())
                continue
            if not seq.reads_prefix_cache and self.kv.blocks_for(len(seq)) > self.kv.num_free:
                break  # a mean-pooled prompt waits until all of it fits
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
        self.waiting.extendleft(reversed(passed_over))
        return batch

    def _speculate(self, batch: ScheduledBatch, budget: int) -> int:
        """Drafts for the batch's decoding sequences, in what the running sequences' own tokens left
        of the budget and the free blocks (drafts never preempt); returns the tokens they take."""
        taken = 0
        for i, seq in enumerate(batch.seqs):
            if seq.matcher is not None or not seq.num_output_tokens or seq.num_computed_tokens != len(seq) - 1:
                continue  # not decoding, or under a grammar
            k = min(self.num_speculative_tokens, budget - taken, seq.params.max_tokens - seq.num_output_tokens - 1,
                    self.max_model_len - len(seq) - 1)
            drafts = self.proposer.propose(seq.token_ids, k)
            if drafts and self.kv.allocate(seq, 1 + len(drafts)):
                batch.drafts[seq] = drafts
                batch.num_new_tokens[i] += len(drafts)
                taken += len(drafts)
        return taken

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Whether `seq` may run beside the running sequences: no adapter, or one of theirs, or a
        slot left for its own."""
        if not seq.adapter_id:
            return True
        adapters = {s.adapter_id for s in self.running} - {0}
        return seq.adapter_id in adapters or len(adapters) < self.max_loras

    def _scheduled(self, batch: ScheduledBatch, seq: Sequence, n: int) -> None:
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n)
        self.kv.cache_full_blocks(seq, seq.num_computed_tokens + n)  # the rest of this step may hit them

    def _preempt(self, seq: Sequence) -> None:
        self.recomputed_tokens += seq.num_computed_tokens
        self.kv.free(seq)
        seq.pooled = None  # its prompt is computed again from its start (or a cached prefix: last pooling only)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # -- applying a step's output -------------------------------------------------------
    def update_from_output(self, batch: ScheduledBatch, output: ModelOutput) -> list[StepOutput]:
        """The step's tokens computed and sampled: computed counts advance (by a speculating
        sequence's accepted drafts, not its rejected ones), new choices join their parent, the
        sampled tokens are appended, and their sequence finished where it stops; embedding requests
        add up their pooled hidden states, and finish once their prompt is computed."""
        new_tokens = dict(zip(output.seqs, output.tokens))
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.computed_prompt_tokens += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
            if drafts := batch.drafts.get(seq):
                accepted = len(new_tokens[seq]) - 1
                self.num_drafts += 1
                self.num_draft_tokens += len(drafts)
                self.num_accepted_tokens += accepted
                n -= len(drafts) - accepted
            seq.num_computed_tokens += n
        for parent, choices in output.forks.items():
            self._take_in(parent, choices)
        embedded = []
        for seq, share in output.pooled.items():
            seq.pooled = share if seq.pooled is None else seq.pooled + share
            if seq.num_computed_tokens == len(seq):
                embedded.append(self._embedded(seq))
        return embedded + [self._append(seq, tokens, logprobs)
                           for seq, tokens, logprobs in zip(output.seqs, output.tokens, output.logprobs)]

    def _embedded(self, seq: Sequence) -> StepOutput:
        """An embedding request's vector: its pooled hidden states L2-normalized, as vLLM's embedding
        pooler does (a sum normalizes to its mean's direction), and the request finished."""
        vector = torch.nn.functional.normalize(seq.pooled, dim=-1).tolist()
        self._finish(seq, "stop")
        return StepOutput(seq.request_id, seq.index, "", (), "stop", seq.num_cached_tokens, embedding=vector)

    def _take_in(self, parent: Sequence, choices: list[Sequence]) -> None:
        """Choices forked from `parent` (just prefilled) run next to it, on its blocks."""
        for choice in choices:
            choice.num_computed_tokens = parent.num_computed_tokens
            self.kv.share(parent, choice)
        at = self.running.index(parent) + 1
        self.running[at:at] = choices

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list[Logprob]) -> StepOutput:
        """Append the tokens one by one, up to the first that stops the sequence: none after it is
        emitted."""
        params = seq.params
        text, reason, emitted = "", None, 0
        for token in tokens:
            seq.token_ids.append(token)
            emitted += 1
            grammar_done = seq.matcher is not None and seq.matcher.accept(token)  # every token advances it
            stop_token = (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids
            if grammar_done or stop_token:
                reason = "stop"
            elif seq.num_output_tokens >= params.max_tokens or len(seq) >= self.max_model_len:
                reason = "length"
            piece, stopped = seq.detokenizer.add(token, final=reason is not None, stop_token=stop_token)
            text += piece
            if stopped:
                reason = "stop"
            if reason:
                self._finish(seq, reason)
                break
        return StepOutput(seq.request_id, seq.index, text, tuple(tokens[:emitted]), reason, seq.num_cached_tokens,
                          tuple(logprobs[:emitted]))

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.kv.free(seq)
        for queue in (self.running, self.waiting, self.arrived):
            if seq in queue:
                queue.remove(seq)
                break
        self.requests[seq.request_id] -= 1
        if not self.requests[seq.request_id]:
            del self.requests[seq.request_id], self.tenants[seq.request_id]

    def abort(self, request_id: str) -> None:
        for seq in [s for s in (*self.running, *self.waiting, *self.arrived) if s.request_id == request_id]:
            self._finish(seq, "abort")
        self.requests.pop(request_id, None)  # its choices not forked yet finish with it
        self.tenants.pop(request_id, None)
