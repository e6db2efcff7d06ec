"""Attention over the paged KV cache, batched across sequences.

The cache of one layer (`LayerKV`) is `[2, num_blocks, block_size, num_kv_heads, head_dim]`,
in the model's dtype or in int8 with one float32 scale per token and head (absmax / 127).
A step's tokens arrive flattened (`[num_tokens, heads, head_dim]`); their K/V are first written
to their slots. Then two paths read the cache, one call each per layer:

- with the native kernels, decode tokens (one new token in their sequence, or any token of a
  speculating sequence, attended alone up to its position) go to `csrc/paged_attention.cpp` and
  prompt chunks to `csrc/chunk_attention.cpp`, both reading the blocks in place: no gather, no
  padding, and a chunk attends only its causal half (but chunks take the PyTorch path where
  `kernels.chunk_kernel_serves` says no: on AVX2; bf16 chunks on a CPU with working AMX take the
  chunk kernel's AMX tiles);
- without them (`--attention torch`, or where they cannot be built) every token goes to the
  PyTorch path: each sequence's context is gathered through its block table into a padded
  batch and attended with one SDPA call under a causal mask aligned bottom-right (a chunk that
  follows cached tokens sees all of them) that also hides padding, or plainly causal where a class
  holds only whole prompts of one length (SDPA then skips the upper half). Chunks are grouped by length
  (one call per power-of-two class), so a 32-token suffix that hit the prefix cache is not
  padded to a 544-token prompt beside it. It is the reference the kernels are tested against.
  Layers the kernels do not compute take it too: a sliding window narrows the mask; soft-capped
  scores (Gemma 2) and sinks (gpt-oss: a learned logit per head in the softmax's denominator)
  are attended eagerly, as transformers' reference does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from backends.builtin.worker import kernels


@dataclass
class LayerKV:
    data: torch.Tensor  # [2, num_blocks, block_size, kv_heads, head_dim]
    scales: torch.Tensor | None = None  # [2, num_blocks, block_size, kv_heads] float32 when data is int8

    @classmethod
    def allocate(cls, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, int8: bool) -> LayerKV:
        # Zeroed, not empty: masked-out slots still enter the attention product, and NaN garbage would spread.
        shape = (2, num_blocks, block_size, kv_heads, head_dim)
        if not int8:
            return cls(torch.zeros(shape, dtype=dtype, device=device))
        return cls(torch.zeros(shape, dtype=torch.int8, device=device),
                   torch.zeros(shape[:-1], dtype=torch.float32, device=device))

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (self.scales.nbytes if self.scales is not None else 0)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.data[:, dst] = self.data[:, src]
        if self.scales is not None:
            self.scales[:, dst] = self.scales[:, src]

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        _, num_blocks, block_size, kv_heads, head_dim = self.data.shape
        data = self.data.view(2, num_blocks * block_size, kv_heads, head_dim)
        if self.scales is None:
            data[0].index_copy_(0, slots, k)
            data[1].index_copy_(0, slots, v)
            return
        scales = self.scales.view(2, num_blocks * block_size, kv_heads)
        for i, x in enumerate((k, v)):
            scale = x.float().abs().amax(dim=-1).clamp_min(1e-8) / 127.0
            data[i].index_copy_(0, slots, (x.float() / scale[..., None]).round().to(torch.int8))
            scales[i].index_copy_(0, slots, scale)

    def gathered(self, i: int, block_tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Keys (i=0) or values (1) of each table's blocks: [b, max_blocks * block_size, kv_heads, head_dim]."""
        batch = block_tables.shape[0]
        flat = block_tables.flatten()  # index_select: faster than advanced indexing on the first dim
        data = self.data[i].index_select(0, flat).view(batch, -1, *self.data.shape[3:])
        if self.scales is None:
            return data
        scales = self.scales[i].index_select(0, flat).view(batch, -1, self.scales.shape[-1])
        return (data.float() * scales[..., None]).to(dtype)


@dataclass
class GatherPart:
    """Sequences attended by gather + SDPA."""

    tokens: torch.Tensor  # [t] indices into the step's tokens
    block_tables: torch.Tensor  # [b, max_blocks]
    # [t] position of each token in the flattened [b * max_q] query pad; None where every chunk is
    # max_q long: the tokens are the pad
    query_index: torch.Tensor | None
    # [b, 1, max_q, max_blocks * block_size], added to the scores: 0 where attention is allowed, -inf
    # elsewhere (in the queries' dtype, made once a step: SDPA would turn a bool mask into this in every
    # layer); None for whole prompts of max_q tokens each: plain causal, where SDPA skips the upper half
    mask: torch.Tensor | None
    max_q: int
    query_positions: torch.Tensor  # [b, max_q] absolute position of each query row (negative: padding)
    context_lens: torch.Tensor  # [b]
    key_len: int  # max_blocks * block_size: the gathered keys of each sequence
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # made once a step per window

    def mask_for(self, window: int | None, dtype: torch.dtype) -> torch.Tensor | None:
        """The step's mask (None: plain causal), or the one that also hides keys `window` or more
        positions behind their query."""
        if window is None:
            return self.mask
        if window not in self.window_masks:
            self.window_masks[window] = _mask(self.query_positions, self.context_lens, self.key_len, window, dtype)
        return self.window_masks[window]


@dataclass
class KernelPart:
    """Decode tokens attended by the native kernel."""

    tokens: torch.Tensor  # [t] indices into the step's tokens
    block_tables: torch.Tensor  # [t, max_blocks]
    positions: torch.Tensor  # [t] absolute position of each token


@dataclass
class ChunkPart:
    """Prompt chunks attended by the native chunk kernel."""

    tokens: torch.Tensor  # [t] indices into the step's tokens, one chunk after another
    block_tables: torch.Tensor  # [s, max_blocks]
    query_starts: torch.Tensor  # [s + 1] where each chunk starts in `tokens`, then the end
    context_lens: torch.Tensor  # [s] tokens in each sequence's cache once the chunk is written


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    gather: tuple[GatherPart, ...]  # one per class of chunk lengths (the PyTorch path)
    kernel: KernelPart | None
    chunks: ChunkPart | None = None

    @classmethod
    def build(cls, q_lens: list[int], ctx_lens: list[int], block_tables: list[list[int]], block_size: int,
              device: torch.device, dtype: torch.dtype, use_kernel: bool, chunk_kernel: bool = True,
              per_token: set[int] | None = None) -> AttentionMetadata:
        """dtype: the queries'; use_kernel: decode tokens to the native kernel; chunk_kernel: prompt
        chunks too (else they take the PyTorch path); per_token: the sequences (by index) whose every
        token is attended as a decode token is, alone up to its position: a speculating sequence's,
        so that the rows verifying its drafts are computed as decode steps would compute them."""
        if per_token:
            q_lens, ctx_lens, block_tables = _split(q_lens, ctx_lens, block_tables, per_token)
        starts = torch.cumsum(torch.tensor([0] + q_lens[:-1]), 0).tolist()
        slots: list[int] = []
        for q_len, ctx, table in zip(q_lens, ctx_lens, block_tables):
            slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx - q_len, ctx)]
        slot_mapping = torch.tensor(slots, device=device)
        decode = [i for i, q in enumerate(q_lens) if q == 1] if use_kernel else []
        rest = [i for i, q in enumerate(q_lens) if not (use_kernel and q == 1)]
        kernel = chunks = None
        gather: tuple[GatherPart, ...] = ()
        if decode:
            kernel = KernelPart(
                tokens=torch.tensor([starts[i] for i in decode], device=device),
                block_tables=_pad([block_tables[i] for i in decode]).to(device),
                positions=torch.tensor([ctx_lens[i] - 1 for i in decode], device=device),
            )
        if rest and use_kernel and chunk_kernel:
            chunks = ChunkPart(
                tokens=torch.cat([torch.arange(starts[i], starts[i] + q_lens[i]) for i in rest]).to(device),
                block_tables=_pad([block_tables[i] for i in rest]).to(device),
                query_starts=torch.cumsum(torch.tensor([0] + [q_lens[i] for i in rest]), 0).to(device),
                context_lens=torch.tensor([ctx_lens[i] for i in rest], device=device),
            )
        elif rest:
            classes: dict[int, list[int]] = {}
            for i in rest:  # chunks padded only to the longest of their class, at most twice their length
                classes.setdefault((q_lens[i] - 1).bit_length(), []).append(i)
            gather = tuple(_gather_part([q_lens[i] for i in group], [ctx_lens[i] for i in group],
                                        [block_tables[i] for i in group], [starts[i] for i in group], block_size,
                                        device, dtype)
                           for group in classes.values())
        return cls(slot_mapping, gather, kernel, chunks)


def _split(q_lens, ctx_lens, tables, per_token: set[int]) -> tuple[list[int], list[int], list[list[int]]]:
    """The sequences in `per_token` as one of a token each, on the same blocks, its context ending
    at the token."""
    split_q, split_ctx, split_tables = [], [], []
    for i, (q_len, ctx, table) in enumerate(zip(q_lens, ctx_lens, tables)):
        if i in per_token:
            split_q += [1] * q_len
            split_ctx += range(ctx - q_len + 1, ctx + 1)
            split_tables += [table] * q_len
        else:
            split_q.append(q_len)
            split_ctx.append(ctx)
            split_tables.append(table)
    return split_q, split_ctx, split_tables


def _pad(tables: list[list[int]]) -> torch.Tensor:
    out = torch.zeros(len(tables), max(len(t) for t in tables), dtype=torch.long)
    for row, table in enumerate(tables):
        out[row, : len(table)] = torch.tensor(table)
    return out


def _gather_part(q_lens, ctx_lens, tables, starts, block_size, device, dtype) -> GatherPart:
    batch, max_q = len(q_lens), max(q_lens)
    block_tables = _pad(tables)
    q_lens_t, ctx_t = torch.tensor(q_lens), torch.tensor(ctx_lens)
    seq_of_token = torch.repeat_interleave(torch.arange(batch), q_lens_t)
    offset_in_q = torch.cat([torch.arange(q) for q in q_lens])
    tokens = torch.tensor(starts)[seq_of_token] + offset_in_q
    query_index = None  # every chunk max_q long: no padding
    if min(q_lens) < max_q:
        query_index = (seq_of_token * max_q + (max_q - q_lens_t[seq_of_token]) + offset_in_q).to(device)
    # Query row r of sequence b sits at absolute position ctx - max_q + r (bottom-right aligned).
    q_pos = (ctx_t[:, None] - max_q + torch.arange(max_q)[None, :]).to(device)
    ctx_t, key_len = ctx_t.to(device), block_tables.shape[1] * block_size
    mask = None  # whole prompts of max_q tokens each: plain causal
    if not all(q == max_q == ctx for q, ctx in zip(q_lens, ctx_lens)):
        mask = _mask(q_pos, ctx_t, key_len, None, dtype)
    return GatherPart(tokens.to(device), block_tables.to(device), query_index, mask, max_q, q_pos, ctx_t, key_len)


def _mask(q_pos: torch.Tensor, ctx: torch.Tensor, key_len: int, window: int | None, dtype) -> torch.Tensor:
    """[b, 1, max_q, key_len], added to the scores: 0 where a query row may attend a key, -inf
    elsewhere: keys after it, beyond its sequence, or (with a window) `window` or more behind it."""
    k_pos = torch.arange(key_len, device=q_pos.device)[None, None, :]
    allowed = k_pos <= q_pos[:, :, None]
    if window is not None:
        allowed &= k_pos > q_pos[:, :, None] - window
    allowed |= (q_pos < 0)[:, :, None]  # padded query rows: any key, their output is dropped
    allowed &= k_pos < ctx[:, None, None]
    return torch.zeros(allowed.shape, dtype=dtype, device=q_pos.device).masked_fill_(~allowed, float("-inf"))[:, None]


def _gather_attention(q: torch.Tensor, kv: LayerKV, part: GatherPart, scale: float, window: int | None = None,
                      softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    num_heads, head_dim = q.shape[1:]
    batch = part.block_tables.shape[0]
    keys, values = (kv.gathered(i, part.block_tables, q.dtype).transpose(1, 2) for i in (0, 1))  # [b, Hkv, L, D]
    queries = q
    if part.query_index is not None:
        queries = q.new_zeros(batch * part.max_q, num_heads, head_dim)
        queries[part.query_index] = q
    queries = queries.view(batch, part.max_q, num_heads, head_dim).transpose(1, 2)
    mask = part.mask_for(window, q.dtype)
    if softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, is_causal=mask is None,
                                             scale=scale, enable_gqa=True)
    else:
        if mask is None:
            mask = _mask(part.query_positions, part.context_lens, part.key_len, None, q.dtype)
        out = _eager_attention(queries, keys, values, mask, scale, softcap, sinks)
    out = out.transpose(1, 2).reshape(batch * part.max_q, num_heads, head_dim)
    return out if part.query_index is None else out[part.query_index]


def _eager_attention(queries, keys, values, mask, scale, softcap, sinks) -> torch.Tensor:
    """Scores soft-capped (tanh(s / cap) * cap, Gemma 2) before the mask, and a sink per head
    (gpt-oss) as one more logit in each softmax, its share dropped after it."""
    groups = queries.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    scores = queries @ keys.transpose(2, 3) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + mask
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(queries.dtype) @ values
    batch, heads, rows, _ = scores.shape
    scores = torch.cat([scores, sinks.to(scores.dtype).view(1, heads, 1, 1).expand(batch, heads, rows, 1)], dim=-1)
    probs = torch.softmax(scores - scores.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    return probs.to(values.dtype) @ values


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, meta: AttentionMetadata,
                    scale: float, window: int | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D] -> [T, H, D]. A window, soft-cap or sinks need a step
    whose every token takes the PyTorch path (the runner builds such steps for such models)."""
    kv.write(meta.slot_mapping, k, v)
    if window is not None or softcap is not None or sinks is not None:
        out = torch.empty_like(q)
        for part in meta.gather:
            out[part.tokens] = _gather_attention(q[part.tokens], kv, part, scale, window, softcap, sinks)
        return out
    if meta.kernel is not None and meta.chunks is None and not meta.gather:  # pure decode: no reordering
        return kernels.paged_attention(q, kv, meta.kernel.block_tables, meta.kernel.positions, scale)
    if meta.kernel is None and meta.chunks is None and len(meta.gather) == 1:  # one class: every token, in order
        return _gather_attention(q, kv, meta.gather[0], scale)
    if meta.kernel is None and meta.chunks is not None and not meta.gather:  # chunks only: every token, in order
        part = meta.chunks
        return kernels.chunk_attention(q, kv, part.block_tables, part.query_starts, part.context_lens, scale)
    out = torch.empty_like(q)
    if meta.kernel is not None:
        part = meta.kernel
        out[part.tokens] = kernels.paged_attention(q[part.tokens], kv, part.block_tables, part.positions, scale)
    if (chunks := meta.chunks) is not None:
        out[chunks.tokens] = kernels.chunk_attention(q[chunks.tokens], kv, chunks.block_tables, chunks.query_starts,
                                                     chunks.context_lens, scale)
    for part in meta.gather:
        out[part.tokens] = _gather_attention(q[part.tokens], kv, part, scale)
    return out
