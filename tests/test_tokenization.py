"""Token offsets from runtimes' token pieces (backends/tokenization.py), checked against a real
tokenizer's own offsets."""

from __future__ import annotations

import pytest

from backends.tokenization import spans, vocabulary_bytes

TEXTS = ["Hello world", "  leading spaces and\ttabs\n", "naïve café — 東京 🙂!", "x"]


@pytest.mark.parametrize("text", TEXTS)
def test_vocabulary_strings_give_the_tokenizers_own_offsets(default_model_dir, text):
    """vLLM's `token_strs` are vocabulary strings: for the default model's byte-level BPE they
    must give exactly the offsets the tokenizer itself reports."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"]
    result = spans(text, ids, [vocabulary_bytes(piece) for piece in tokenizer.convert_ids_to_tokens(ids)])
    assert [(s.start, s.stop) for s in result] == [tuple(o) for o in encoded["offset_mapping"]]
    assert [s.id for s in result] == ids


def test_sentencepiece_pieces_lose_the_dummy_prefix_and_keep_raw_bytes():
    pieces = ["▁Hello", "▁world", "<0xC3>", "<0xA1>"]
    assert [vocabulary_bytes(p) for p in pieces] == [b" Hello", b" world", b"\xc3", b"\xa1"]
    result = spans("Hello worldá", [1, 2, 3, 4], [vocabulary_bytes(p) for p in pieces])
    assert [(s.text, s.start, s.stop) for s in result] == [("Hello", 0, 5), (" world", 5, 11), ("á", 11, 12),
                                                           ("á", 11, 12)]


def test_a_piece_not_in_the_text_spans_nothing():
    result = spans("hi", [0, 1], [b"<s>", b"hi"])
    assert [(s.text, s.start, s.stop) for s in result] == [("", 0, 0), ("hi", 0, 2)]
