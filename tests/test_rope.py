"""RoPE frequencies, plain and scaled (linear, llama3), against transformers' own; a scaling the
model does not implement is refused by name."""

from __future__ import annotations

import pytest
import torch

from backends.builtin.worker.models.llama import LlamaConfig, rope_inv_freq


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
