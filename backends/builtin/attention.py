"""Attention over the paged KV cache, batched across sequences in one call per layer.

The cache of one layer is `[2, num_blocks, block_size, num_kv_heads, head_dim]`. A step's
tokens arrive flattened (`[num_tokens, heads, head_dim]`); their K/V are written to their
slots, then each sequence's context is gathered through its block table into a padded batch
and attended with one SDPA call under a mask that is causal, bottom-right aligned (a chunk
that follows cached tokens sees all of them) and hides padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] padded with 0
    query_index: torch.Tensor  # [T] position of each token in the flattened [B * max_q] query pad
    mask: torch.Tensor  # [B, 1, max_q, max_blocks * block_size] True where attention is allowed
    max_q: int

    @classmethod
    def build(
        cls, q_lens: list[int], ctx_lens: list[int], block_tables: list[list[int]],
        block_size: int, device: torch.device,
    ) -> AttentionMetadata:
        batch, max_q = len(q_lens), max(q_lens)
        max_blocks = max(len(t) for t in block_tables)
        tables = torch.zeros(batch, max_blocks, dtype=torch.long)
        for b, table in enumerate(block_tables):
            tables[b, : len(table)] = torch.tensor(table)
        q_lens_t = torch.tensor(q_lens)
        ctx_t = torch.tensor(ctx_lens)
        seq_of_token = torch.repeat_interleave(torch.arange(batch), q_lens_t)
        offset_in_q = torch.arange(len(seq_of_token)) - torch.repeat_interleave(
            torch.cumsum(q_lens_t, 0) - q_lens_t, q_lens_t
        )
        positions = ctx_t[seq_of_token] - q_lens_t[seq_of_token] + offset_in_q
        slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
        # Query row r of sequence b sits at absolute position ctx - max_q + r (bottom-right aligned).
        q_pos = ctx_t[:, None] - max_q + torch.arange(max_q)[None, :]
        k_pos = torch.arange(max_blocks * block_size)[None, None, :]
        mask = k_pos <= q_pos[:, :, None]
        mask |= (q_pos < 0)[:, :, None]  # padded query rows: any key, their output is dropped
        mask &= k_pos < ctx_t[:, None, None]
        query_index = seq_of_token * max_q + (max_q - q_lens_t[seq_of_token]) + offset_in_q
        return cls(
            slot_mapping=slots.to(device), block_tables=tables.to(device),
            query_index=query_index.to(device), mask=mask[:, None].to(device), max_q=max_q,
        )


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D]; kv_cache: [2, N, block_size, Hkv, D] -> [T, H, D]."""
    num_tokens, num_heads, head_dim = q.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0].index_copy_(0, meta.slot_mapping, k)
    flat[1].index_copy_(0, meta.slot_mapping, v)
    batch = meta.block_tables.shape[0]
    # [B, max_blocks, block_size, Hkv, D] -> [B, Hkv, L, D]
    keys = kv_cache[0][meta.block_tables].flatten(1, 2).transpose(1, 2)
    values = kv_cache[1][meta.block_tables].flatten(1, 2).transpose(1, 2)
    queries = q.new_zeros(batch * meta.max_q, num_heads, head_dim)
    queries[meta.query_index] = q
    queries = queries.view(batch, meta.max_q, num_heads, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=meta.mask, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2).reshape(batch * meta.max_q, num_heads, head_dim)[meta.query_index]
