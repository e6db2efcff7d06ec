"""Incremental detokenization with stop strings.

Text is released only when it is final: bytes of a character split across tokens wait for
the rest (no U+FFFD mid-stream), and when stop strings are set, the last `len(stop) - 1`
characters wait until they cannot begin a stop string. The stop string itself is never sent, nor
the token that ended the sequence as a stop token (an end of sequence or a stop token id), as in
vLLM. Special tokens are skipped, unless the request keeps them.
"""

from __future__ import annotations

CONTEXT_TOKENS = 5  # prompt tokens decoded along, so the first word keeps its leading space


class Detokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...] = (),
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.context = prompt_ids[-CONTEXT_TOKENS:]
        self.tokens = list(self.context)
        self.prefix_offset, self.read_offset = 0, len(self.tokens)
        self.stop = tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # decoded output so far
        self.sent = 0  # characters of `text` already released

    def fresh(self) -> Detokenizer:
        """One at the prompt's end, for a sibling choice forked before its first token."""
        return Detokenizer(self.tokenizer, self.context, self.stop, self.skip_special_tokens)

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int, final: bool = False, stop_token: bool = False) -> tuple[str, bool]:
        """Feed one token (`stop_token`: it ends the sequence, and is not text); returns (text to
        release now, whether a stop string was hit)."""
        if not stop_token:
            self.tokens.append(token_id)
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            start = len(self.text)
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            hit = self._find_stop(start)
            if hit is not None:
                self.text = self.text[:hit]
                return self._release(hit), True
        return self._release(len(self.text) if final else len(self.text) - self.hold), False

    def _find_stop(self, new_from: int) -> int | None:
        """Earliest start of a stop string that overlaps the text added at `new_from`."""
        found = [self.text.find(s, max(0, new_from - len(s) + 1)) for s in self.stop]
        return min((at for at in found if at != -1), default=None)

    def _release(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : upto], upto
        return out
