"""Small pieces checked against their references: RoPE scaling, detokenization, sampling filters."""

from __future__ import annotations

import pytest
import torch

from backends.builtin.detokenizer import Detokenizer
from backends.builtin.models.llama import LlamaConfig, rope_inv_freq
from backends.builtin.sampler import _filtered_probs


@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
])
def test_rope_frequencies_match_transformers(scaling):
    from transformers import LlamaConfig as HFConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = HFConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0, max_position_embeddings=131072,
                  rope_scaling=scaling)
    ours = LlamaConfig.from_hf(hf.to_dict())
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        want = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.int64).float() / 128))
    else:
        want, _ = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
    assert torch.equal(rope_inv_freq(ours), want)


def test_unknown_rope_scaling_is_refused():
    cfg = LlamaConfig(10, 8, 8, 1, 2, 2, 4, 16, rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="yarn"):
        rope_inv_freq(cfg)


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
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = _filtered_probs(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    probs = _filtered_probs(logits, torch.tensor([4]), torch.tensor([0.7]))
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))  # 0.5 + 0.3 covers 0.7
    probs = _filtered_probs(logits, torch.tensor([4]), torch.tensor([0.1]))
    assert torch.allclose(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))  # the top token always stays


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kernel_equals_the_pytorch_path(dtype):
    from backends.builtin import kernels
    from backends.builtin.attention import AttentionMetadata, paged_attention

    assert kernels.available(torch.device("cpu"), dtype), kernels._failed
    torch.manual_seed(0)
    blocks, block_size, kv_heads, head_dim, heads = 64, 16, 3, 64, 9
    tables = [[3, 7, 9, 11, 20], [1, 2], [30, 31, 32], [40]]
    ctx = [70, 20, 40, 1]
    cache = torch.randn(2, blocks, block_size, kv_heads, head_dim).to(dtype)
    for q_lens in ([1, 1, 1, 1], [1, 5, 1, 1], [3, 5, 2, 1]):  # decode only, mixed, prefill chunks only
        tokens = sum(q_lens)
        q, k, v = (torch.randn(tokens, h, head_dim).to(dtype) for h in (heads, kv_heads, kv_heads))
        outs = []
        for use_kernel in (True, False):
            meta = AttentionMetadata.build(q_lens, ctx, tables, block_size, torch.device("cpu"), use_kernel)
            assert (meta.kernel is not None) == (use_kernel and 1 in q_lens)
            outs.append(paged_attention(q, k, v, cache.clone(), meta, head_dim**-0.5).float())
        assert (outs[0] - outs[1]).abs().max().item() < (1e-5 if dtype == torch.float32 else 2e-2)
