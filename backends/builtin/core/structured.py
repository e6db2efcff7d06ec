"""Structured outputs: a request's `Constraint` (JSON schema, any JSON object, regex, a choice of
strings, or a Lark / GBNF grammar) turned into per-token masks by llguidance, the library behind
vLLM's `guidance` backend and llama.cpp's `%llguidance` grammars (3 MB and no dependencies,
where xgrammar pulls in a 1 GB Triton). Each constrained sequence has its own matcher (cheap
to make: the grammar text is cached per constraint, the lexer is built lazily as tokens
arrive); one step fills every constrained row's bitmask in one parallel call and applies them
all with one tensor operation, so constrained and free requests share a batch.

`check` validates without the tokenizer (cheap, in the API process): llguidance refuses what it
does not implement by name (`Unimplemented keys: ["not"]`) instead of silently ignoring it, so
a schema it accepts is a schema every output will match.
"""

from __future__ import annotations

import functools

import numpy
import torch

from backends.constraints import Constraint

# Compact JSON: a small model left free to indent tends to emit whitespace until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False}


@functools.lru_cache(maxsize=256)
def grammar(constraint: Constraint) -> str:
    """llguidance's grammar for a constraint, made once per distinct constraint."""
    import llguidance

    if constraint.schema is not None:
        return llguidance.LLMatcher.grammar_from_json_schema(constraint.schema, defaults=JSON_OPTIONS)
    return llguidance.grammar_from(constraint.kind, constraint.value)


def check(constraint: Constraint) -> None:
    """ValueError naming what llguidance cannot take."""
    import llguidance

    try:
        error = llguidance.LLMatcher.validate_grammar(grammar(constraint))
    except (ValueError, TypeError) as exc:  # a grammar text that is not one
        error = str(exc)
    if error:
        raise ValueError(error.strip().splitlines()[0])


class Grammars:
    """The engine's side: the tokenizer's vocabulary as llguidance sees it, and its executor for
    filling many masks at once."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        import llguidance
        import llguidance.hf

        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token_ids)
        self.executor = llguidance.LLExecutor()
        self.vocab_size = vocab_size

    def matcher(self, constraint: Constraint) -> Matcher:
        """ValueError where the grammar does not take this tokenizer."""
        matcher = Matcher(grammar(constraint), self)
        if matcher.state.is_error():
            raise ValueError(matcher.state.get_error().strip().splitlines()[0])
        return matcher


class Matcher:
    """One sequence's position in its grammar."""

    def __init__(self, text: str, grammars: Grammars) -> None:
        import llguidance

        self.text, self.grammars = text, grammars
        self.state = llguidance.LLMatcher(grammars.tokenizer, text, log_level=0)

    def fresh(self) -> Matcher:
        """A matcher at the grammar's start, for a sibling choice forked before its first token."""
        return Matcher(self.text, self.grammars)

    def accept(self, token: int) -> bool:
        """Advance by the sampled token; True once the grammar can take nothing more."""
        self.state.consume_token(token)
        return self.state.is_stopped()


def mask(logits: torch.Tensor, seqs) -> None:
    """Set to -inf, in place, every token a constrained row's grammar does not allow next."""
    rows = [i for i, seq in enumerate(seqs) if seq.matcher is not None]
    if not rows:
        return
    grammars = seqs[rows[0]].matcher.grammars
    vocab = logits.shape[-1]
    bitmask = torch.empty(len(rows), -(-grammars.vocab_size // 32), dtype=torch.int32)
    grammars.executor.unsafe_compute_mask_ptr([(seqs[i].matcher.state, row) for row, i in enumerate(rows)],
                                              bitmask.data_ptr(), bitmask.shape[1] * 4, len(rows))
    # Token 32w + j is bit j of word w: the words' little-endian bytes, unpacked least bit first.
    allowed = numpy.unpackbits(bitmask.numpy().view(numpy.uint8), axis=1, bitorder="little")[:, :vocab]
    index = torch.tensor(rows)
    logits[index] = logits[index].masked_fill(torch.from_numpy(allowed) == 0, float("-inf"))
