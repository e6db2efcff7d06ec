"""Token logprobs in OpenAI's two shapes: chat's `content` entries (token, logprob, bytes,
top_logprobs) and completions' parallel lists (tokens, token_logprobs, top_logprobs,
text_offset). A token's text is its own bytes (a byte-level token may be part of a UTF-8
character: its text then shows U+FFFD and `bytes` says what it is)."""

from __future__ import annotations

from backends.builtin.protocol import Logprob
from backends.tokenization import vocabulary_bytes


class TokenTexts:
    """Every vocabulary id's bytes, read once from the tokenizer."""

    def __init__(self, tokenizer) -> None:
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        self.bytes = [vocabulary_bytes(piece) if piece is not None else b"" for piece in pieces]

    def text(self, token: int) -> str:
        return self.of(token).decode("utf-8", errors="replace")

    def of(self, token: int) -> bytes:
        return self.bytes[token] if token < len(self.bytes) else b""


def chat(texts: TokenTexts, tokens: tuple[int, ...], logprobs: tuple[Logprob, ...]) -> dict:
    def entry(token: int, logprob: float) -> dict:
        return {"token": texts.text(token), "logprob": logprob, "bytes": list(texts.of(token))}

    return {"content": [entry(token, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for token, lp in zip(tokens, logprobs)]}


def completion(texts: TokenTexts, tokens: tuple[int, ...], logprobs: tuple[Logprob, ...], offset: int) -> dict:
    """`offset`: characters of this choice's text before these tokens."""
    words = [texts.text(token) for token in tokens]
    offsets = []
    for word in words:
        offsets.append(offset)
        offset += len(word)
    return {"tokens": words, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{texts.text(t): v for t, v in lp.top} for lp in logprobs], "text_offset": offsets}
