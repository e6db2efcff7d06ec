"""Prompt lookup: draft tokens for speculative decoding found in the sequence itself, as vLLM's
`ngram` method finds them. The longest suffix of the tokens so far, from `max_n` down to `min_n`
tokens, that occurred earlier in the prompt or output proposes what followed its earliest
occurrence (vLLM's choice). Free to compute, and right where the output copies its input: code
edits, extraction, quoting, rewrites.
"""

from __future__ import annotations

import numpy


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to `k` tokens to follow `token_ids` (none where no n-gram of at least `min_n` recurs)."""
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = numpy.asarray(token_ids)
        ends = numpy.flatnonzero(tokens[:-1] == tokens[-1])  # earlier occurrences of the last token
        n = 1  # every one of `ends` matches the last n tokens
        while n < min(self.max_n, len(tokens) - 1):
            before = ends - n
            longer = ends[(before >= 0) & (tokens[before] == tokens[-1 - n])]
            if not len(longer):
                break
            ends, n = longer, n + 1
        if n < self.min_n or not len(ends):
            return []
        start = ends[0] + 1
        return tokens[start : start + k].tolist()
