"""RoPE frequencies and cos/sin scales, plain and scaled (linear, llama3, yarn, longrope, partial
rotary), against transformers' own; a scaling the model does not implement is refused by name."""

from __future__ import annotations

import pytest
import torch

from backends.builtin.worker.models import model_config
from backends.builtin.worker.models.rope import Rope

SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
     "original_max_position_embeddings": 4096},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
]


@pytest.mark.parametrize("scaling", SCALINGS)
def test_rope_frequencies_match_transformers(scaling):
    from transformers import LlamaConfig as HFConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = HFConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0, max_position_embeddings=131072,
                  rope_scaling=scaling)
    ours = model_config(hf.to_dict()).rope
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        want, factor = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.int64).float() / 128)), 1.0
    else:
        want, factor = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
    assert torch.allclose(ours.inv_freq(), want, rtol=1e-6, atol=0)
    assert ours.attention_factor() == pytest.approx(factor)


@pytest.mark.parametrize("max_len", [4096, 131072])
def test_longrope_with_partial_rotary_matches_phi3(max_len):
    """Phi-3's longrope: short factors within the original context, long ones beyond it."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = Phi3Config(hidden_size=3072, num_attention_heads=24, max_position_embeddings=131072,
                    original_max_position_embeddings=4096, partial_rotary_factor=0.75,
                    rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + i / 40 for i in range(48)],
                                  "long_factor": [2.0 + i / 10 for i in range(48)]})
    ours = model_config(hf.to_dict()).rope
    assert ours.rotary_dim == 96
    want, factor = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=max_len)
    assert torch.allclose(Rope(**{**ours.__dict__, "max_len": max_len}).inv_freq(), want, rtol=1e-6, atol=0)
    assert ours.attention_factor() == pytest.approx(factor)


def test_unknown_rope_scaling_is_refused():
    with pytest.raises(ValueError, match="dynamic"):
        Rope.of(10000.0, 8, {"rope_type": "dynamic", "factor": 2.0}).inv_freq()
