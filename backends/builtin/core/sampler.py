"""Next-token choice for a batch, in vLLM v1's order: raw logprobs; grammar masks, logit bias and
min_tokens; repetition, frequency and presence penalties; then greedy rows take the argmax and
sampled rows temperature, min-p, top-k and top-p.

Every step is a tensor operation over the rows that asked for it; a batch that asked for none of
the extras costs one argmax. Sampled rows draw with the exponential race (argmax of p / q, q ~
Exp(1)), as vLLM does: one draw for the whole batch, redrawn only for a row with a seed, from a
generator seeded by the seed, the choice and the position the row samples. So a seeded request
gets the same tokens whatever else shares its batch, and whether or not it speculates.

Speculative decoding verifies a sequence's draft tokens with one row per draft and one more, each
row processed as if the drafts before it had been appended (`Sequence.ahead`): `accept` keeps the
drafts while each equals what its row drew, then that row's own token. Drawing x ~ p and accepting
the draft d iff x == d is the rule for a deterministic draft (accept d with probability p(d); on
rejection draw from p without d, renormalized: x given x != d), so the output's distribution is
the target's; greedy rows accept exactly the drafts the argmax would have produced.
"""

from __future__ import annotations

import itertools

import torch

from backends.builtin.core import structured
from backends.builtin.core.sequence import Sequence
from backends.builtin.protocol import Logprob


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: frozenset[int] = frozenset()
           ) -> tuple[list[int], list[Logprob | None]]:
    """logits: [len(seqs), vocab] float32, modified in place -> each sequence's token, and its
    logprobs where the sequence asked for them."""
    logprob_rows = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
    raw = torch.log_softmax(logits[logprob_rows], dim=-1) if logprob_rows else None
    structured.mask(logits, seqs)
    _bias(logits, seqs, eos_token_ids)
    _penalize(logits, seqs)
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
    if sampled:
        tokens[sampled] = _draw(logits[sampled], [seqs[i] for i in sampled])
    logprobs: list[Logprob | None] = [None] * len(seqs)
    if raw is not None:
        ks = [seqs[i].params.logprobs for i in logprob_rows]
        top_values, top_ids = raw.topk(max(ks), dim=-1)
        chosen = raw.gather(1, tokens[logprob_rows][:, None])[:, 0].tolist()
        for row, (i, k) in enumerate(zip(logprob_rows, ks)):
            logprobs[i] = Logprob(chosen[row], tuple(zip(top_ids[row, :k].tolist(), top_values[row, :k].tolist())))
    return tokens.tolist(), logprobs


def accept(drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens a speculating sequence emits: its drafts while each equals the token sampled at
    the row before it, then the token of the first row whose draft was rejected (or of the last)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == sampled[accepted]:
        accepted += 1
    return sampled[: accepted + 1]


def _bias(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: frozenset[int]) -> None:
    """logit_bias added; end-of-sequence and stop tokens barred until a row has min_tokens."""
    entries = [(i, token, bias) for i, seq in enumerate(seqs) for token, bias in seq.params.logit_bias]
    entries += [(i, token, float("-inf")) for i, seq in enumerate(seqs) if seq.num_output_tokens < seq.params.min_tokens
                for token in (*eos_token_ids, *seq.params.stop_token_ids)]
    if entries:
        rows, ids, values = zip(*entries)
        logits.index_put_((torch.tensor(rows), torch.tensor(ids)), torch.tensor(values), accumulate=True)


def _penalize(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """vLLM's penalties: repetition divides a positive logit (multiplies a negative one) of every
    token seen in the prompt or output, frequency subtracts per occurrence in the output, presence
    once per token that occurred. Computed on the (row, token) pairs that occurred, not on whole
    rows of the vocabulary."""
    rows = [i for i, seq in enumerate(seqs) if seq.params.penalized]
    if not rows:
        return
    vocab = logits.shape[-1]

    def per_row(name: str, default: float) -> torch.Tensor:
        values = torch.full((len(seqs),), default)
        values[rows] = torch.tensor([getattr(seqs[i].params, name) for i in rows])
        return values

    repetition = per_row("repetition_penalty", 1.0)
    if (repetition != 1).any():
        seen = _pairs(rows, [seqs[i].token_ids for i in rows], vocab).unique()
        row, token = seen // vocab, seen % vocab
        values = logits[row, token]
        logits[row, token] = torch.where(values > 0, values / repetition[row], values * repetition[row])
    pairs, counts = _pairs(rows, [seqs[i].output_ids for i in rows], vocab).unique(return_counts=True)
    row, token = pairs // vocab, pairs % vocab
    logits[row, token] -= per_row("frequency_penalty", 0.0)[row] * counts + per_row("presence_penalty", 0.0)[row]


def _pairs(rows: list[int], token_lists: list[list[int]], vocab: int) -> torch.Tensor:
    """Each (row, token) occurrence as row * vocab + token."""
    lengths = torch.tensor([len(tokens) for tokens in token_lists])
    tokens = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long)
    return torch.repeat_interleave(torch.tensor(rows), lengths) * vocab + tokens


def _draw(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    params = [seq.params for seq in seqs]
    # Shifted so the largest logit is 0: no temperature can overflow it into inf/nan.
    scaled = (logits - logits.max(dim=-1, keepdim=True).values) / torch.tensor([p.temperature for p in params])[:, None]
    probs = scaled.softmax(dim=-1)
    min_p = torch.tensor([p.min_p for p in params])[:, None]
    if min_p.any():
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):  # a sort of the vocabulary, only where asked
        top_k = torch.tensor([p.top_k if p.top_k > 0 else probs.shape[-1] for p in params])
        probs = _filtered(probs, top_k, torch.tensor([p.top_p for p in params]))
    race = torch.empty_like(probs).exponential_()
    seeded = [row for row, p in enumerate(params) if p.seed is not None]
    if seeded:
        generator = torch.Generator()
        for row in seeded:
            seq = seqs[row]
            # mt19937 reads the seed's low 32 bits: the key is hashed into them
            generator.manual_seed(hash((seq.params.seed + seq.index, len(seq))) & 0xFFFF_FFFF)
            race[row].exponential_(generator=generator)
    return (probs / race).argmax(dim=-1)


def _filtered(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Each row restricted to its top-k tokens and smallest nucleus of mass top_p (not renormalized:
    the exponential race does not need it)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1])[None, :]
    sorted_probs = sorted_probs.masked_fill(rank >= top_k[:, None], 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p[:, None], 0.0)  # keeps the first token
    return torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)
