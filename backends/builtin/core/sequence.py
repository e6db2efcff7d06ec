"""A sequence's state inside the engine: token ids, progress, block table, grammar and text, or an
embedding request's pooled hidden states. After a step only the scheduler writes it
(`Scheduler.update_from_output`)."""

from __future__ import annotations

import copy
import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from backends.builtin.core.detokenizer import Detokenizer
from backends.builtin.core.structured import Matcher
from backends.builtin.protocol import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One generated continuation. `n > 1` requests fork into several after their prefill."""

    token_ids: list[int]
    params: SamplingParams
    request_id: str = ""
    index: int = 0  # choice index within the request
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (first admission)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks
    num_registered_blocks: int = 0  # leading blocks already offered to the prefix cache
    status: Status = Status.WAITING
    finish_reason: str | None = None
    matcher: Matcher | None = None  # where a grammar constrains the output
    detokenizer: Detokenizer | None = None  # the output's text, made by the engine with the request's stop strings
    seq_id: int = field(default_factory=lambda: next(_ids))
    num_preemptions: int = 0
    arrival: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None  # prefix-cache namespace: the first block's key starts from it
    adapter_id: int = 0  # the LoRA adapter's weights it runs with (0: none), also a prefix-cache namespace
    # An embedding request's pooling ("last" | "mean", `EngineConfig.pooling_type`; None: it generates):
    # it ends once its prompt is computed, with `pooled`, the final hidden states pooled so far (the
    # last token's, or the sum of those computed, in float32).
    pooling: str | None = None
    pooled: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    def ahead(self, drafts: list[int]) -> Sequence:
        """A shallow copy as it would be with `drafts` appended: what the sampler reads at the
        verification row that follows them (penalties, min_tokens and the seeded position see them)."""
        view = copy.copy(self)
        view.token_ids = self.token_ids + drafts
        return view

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def reads_prefix_cache(self) -> bool:
        """Mean pooling needs every prompt token's hidden state, which a cached prefix would skip
        (its blocks still join the cache for others)."""
        return self.pooling != "mean"

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def fork(self, index: int) -> Sequence:
        """A sibling choice before its first token, sharing everything computed so far; the
        scheduler gives it the blocks (and the step's computed tokens) when it takes it in."""
        return Sequence(
            list(self.token_ids), self.params, self.request_id, index, self.num_prompt_tokens,
            self.num_computed_tokens, self.num_cached_tokens, status=self.status,
            block_hashes=list(self.block_hashes), num_registered_blocks=self.num_registered_blocks,
            matcher=self.matcher.fresh() if self.matcher else None,
            detokenizer=self.detokenizer.fresh() if self.detokenizer else None, cache_salt=self.cache_salt,
            adapter_id=self.adapter_id,
        )
