"""Token spans (id, text, character offsets) from what a runtime tells about its tokens.

Runtimes answer tokenization with ids and each token's bytes (llama.cpp's `detokenize`) or its
vocabulary string (vLLM's `token_strs`). Offsets follow from laying those bytes along the text's
UTF-8 encoding; vocabulary strings are first turned back into bytes by the two conventions that
cover the common tokenizers: byte-level BPE (GPT-2, Llama 3, Qwen: one printable character per
byte) and SentencePiece (Llama 2, Mistral: `▁` for a space, `<0xNN>` for a raw byte)."""

from __future__ import annotations

import re
from functools import cache

from .base import TokenSpan

_SENTENCEPIECE_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@cache
def _byte_level_decoder() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def vocabulary_bytes(piece: str) -> bytes:
    """The bytes a vocabulary string stands for."""
    if match := _SENTENCEPIECE_BYTE.fullmatch(piece):
        return bytes([int(match[1], 16)])
    if "▁" in piece:
        return piece.replace("▁", " ").encode()
    decoder = _byte_level_decoder()
    if all(char in decoder for char in piece):
        return bytes(decoder[char] for char in piece)
    return piece.encode()


def spans(text: str, ids: list[int], pieces: list[bytes]) -> list[TokenSpan]:
    """Lay each token's bytes along `text`. A piece that is not where the text says (SentencePiece's
    leading space on the first word, a special token) spans only the bytes that do match there."""
    data = text.encode()
    # byte offset -> the character it starts or lies inside, and -> the first character boundary at or after it
    inside, boundary = [0] * (len(data) + 1), [0] * (len(data) + 1)
    position = 0
    for index, char in enumerate(text):
        width = len(char.encode())
        inside[position:position + width] = [index] * width
        boundary[position:position + width] = [index] + [index + 1] * (width - 1)
        position += width
    inside[len(data)] = boundary[len(data)] = len(text)
    result, at = [], 0
    for token, piece in zip(ids, pieces):
        if not data.startswith(piece, at) and piece.startswith(b" ") and data.startswith(piece[1:], at):
            piece = piece[1:]  # SentencePiece's dummy prefix
        width = len(piece) if data.startswith(piece, at) else 0
        start, stop = inside[at], boundary[at + width] if width else inside[at]
        result.append(TokenSpan(token, text[start:stop], start, stop))
        at += width
    return result
