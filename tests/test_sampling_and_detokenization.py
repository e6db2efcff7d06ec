"""Incremental detokenization that never splits a character, a stop string across tokens held back
and cut, and the sampler's top-k and top-p filters."""

from __future__ import annotations

import torch

from backends.builtin.core.detokenizer import Detokenizer
from backends.builtin.core.sampler import _filtered

TEXT = "Café ☕ 東京 🚀🎉 naïve — ok"


def test_incremental_detokenization_never_splits_characters(default_model):
    tok = default_model.tokenizer
    ids = tok.encode(TEXT)
    detok = Detokenizer(tok, tok.encode("Say:"))
    pieces = [detok.add(t, final=i == len(ids) - 1)[0] for i, t in enumerate(ids)]
    assert "".join(pieces) == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces)
    assert len(ids) > len(TEXT.split())  # multi-byte characters really were split across tokens


def test_stop_string_across_tokens_is_held_back_and_cut(default_model):
    tok = default_model.tokenizer
    ids = tok.encode("alpha beta STOP gamma")
    detok = Detokenizer(tok, [], stop=("ST" + "OP",))
    released, hit = [], False
    for t in ids:
        piece, hit = detok.add(t)
        released.append(piece)
        if hit:
            break
    assert hit and "".join(released) == "alpha beta "


def test_top_k_and_top_p_filters():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])

    def kept(top_k: int, top_p: float) -> torch.Tensor:
        left = _filtered(probs, torch.tensor([top_k]), torch.tensor([top_p]))
        return left / left.sum()  # the exponential race draws from the unnormalized rest alike

    assert torch.allclose(kept(2, 1.0), torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    assert torch.allclose(kept(4, 0.7), torch.tensor([[0.625, 0.375, 0.0, 0.0]]))  # 0.5 + 0.3 covers 0.7
    assert torch.allclose(kept(4, 0.1), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))  # the top token always stays
