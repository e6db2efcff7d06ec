"""Next-token choice for a batch: greedy, temperature, top-k, top-p, per-request seeds.

Each sampled sequence draws from its own generator, so a seeded request gets the same tokens
whatever else shares its batch.
"""

from __future__ import annotations

import torch

from .sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits: [len(seqs), vocab] float32 -> one token id per sequence."""
    tokens = logits.argmax(dim=-1).tolist()
    rows = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
    if not rows:
        return tokens
    params = [seqs[i].params for i in rows]
    chosen = logits[rows]
    # Shifted so the largest logit is 0: no temperature can overflow it into inf/nan.
    scaled = (chosen - chosen.max(dim=-1, keepdim=True).values) / torch.tensor([p.temperature for p in params])[:, None]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else scaled.shape[-1] for p in params])
    top_p = torch.tensor([p.top_p for p in params])
    probs = _filtered_probs(scaled, top_k, top_p)
    for row, i in zip(probs, rows):
        tokens[i] = int(torch.multinomial(row, 1, generator=seqs[i].generator))
    return tokens


def _filtered_probs(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Softmax restricted to each row's top-k tokens and smallest nucleus of mass top_p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1])[None, :]
    sorted_logits = sorted_logits.masked_fill(rank >= top_k[:, None], float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p[:, None], 0.0)  # keeps the first token
    sorted_probs /= sorted_probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)
