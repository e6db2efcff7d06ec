"""GGUF files of every architecture the engine reads, written from tiny random transformers models the
way llama.cpp's converter writes them, read back into the Hugging Face config and checkpoint they came
from: config values equal, every tensor equal under its checkpoint name."""

from __future__ import annotations

import pytest
import torch
import transformers
from gguf.quants import dequantize
from safetensors.torch import load_file

from backends.builtin.worker.gguf_weights import GGUF_TO_HF_ARCH, read_gguf
from backends.builtin.worker.quant import QuantizedWeight
from tests.gguf_writer import write_gguf

# Dimensions multiples of 32, ggml's quantization block. The files have no vocabulary (reading one takes
# seconds), hence no BOS or EOS token, but one test's.
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None)
# One tiny model per GGUF architecture, with each of its features on: model class, config class, features.
MODELS = {
    "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig, dict(
        head_dim=16, attention_bias=True, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config, dict(tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config, dict(head_dim=32)),
    "qwen3moe": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig, dict(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)),
    "gemma2": (transformers.Gemma2ForCausalLM, transformers.Gemma2Config, dict(
        num_hidden_layers=4, head_dim=32, query_pre_attn_scalar=32, sliding_window=32,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
    "gemma3": (transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig, dict(
        num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32, sliding_window=32,
        final_logit_softcapping=30.0, rope_theta=1e6, rope_local_base_freq=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0})),
    "phi3": (transformers.Phi3ForCausalLM, transformers.Phi3Config, dict(
        pad_token_id=0, partial_rotary_factor=0.5, original_max_position_embeddings=64, sliding_window=32,
        rope_scaling={"rope_type": "longrope", "long_factor": [1.0, 1.5, 2.25, 4.0],
                      "short_factor": [1.0, 1.1, 1.2, 1.3]})),
    "gpt-oss": (transformers.GptOssForCausalLM, transformers.GptOssConfig, dict(
        intermediate_size=32, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=32)),
}
# Config entries no GGUF carries, none of which changes the model's outputs.
NOT_IN_GGUF = {"dtype", "architectures", "transformers_version", "initializer_range", "pad_token_id"}


def tiny_model(arch: str, **overrides) -> transformers.PreTrainedModel:
    model_class, config_class, features = MODELS[arch]
    torch.manual_seed(0)
    model = model_class(config_class(**{**SMALL, **features, **overrides}))
    for name, parameter in model.named_parameters():
        if name.endswith("norm.weight"):  # dyadic, so Gemma's norm + 1 - 1 is exact in float32
            parameter.data = torch.randint(-64, 64, parameter.shape) / 64
    return model


@pytest.mark.parametrize("arch", MODELS)
def test_round_trip(arch, tmp_path):
    model = tiny_model(arch)
    model.save_pretrained(tmp_path / "hf")
    write_gguf(tmp_path / "hf", tmp_path / "model.gguf", tokenizer=False)
    checkpoint = load_file(tmp_path / "hf" / "model.safetensors")
    config, weights = read_gguf(tmp_path / "model.gguf")

    assert sorted(weights) == sorted(checkpoint)
    for name, tensor in checkpoint.items():
        assert torch.equal(weights[name], tensor), name

    assert config["model_type"] == GGUF_TO_HF_ARCH[arch] == model.config.model_type
    ours = transformers.AutoConfig.for_model(**config).to_dict()
    theirs = model.config.to_dict()
    if arch == "llama":  # Llama 3's scaling comes as llama.cpp's per-frequency divisors
        for rope in ("rope_parameters", "rope_scaling"):  # transformers 5's and 4's
            theirs.pop(rope, None)
        assert config["rope_theta"] == 500000.0
        head_dim = model.config.head_dim
        unscaled = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        assert torch.allclose(torch.tensor(config["rope_freq_factors"]), unscaled / model.model.rotary_emb.inv_freq,
                              rtol=1e-6)
    assert {k: ours.get(k) for k in theirs if k not in NOT_IN_GGUF} == \
        {k: v for k, v in theirs.items() if k not in NOT_IN_GGUF}


def test_mxfp4_experts(tmp_path):
    """gpt-oss as its GGUFs ship, experts in MXFP4: values on MXFP4's grid come back exactly."""
    model = tiny_model("gpt-oss")
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6]) / 8  # e2m1 values, scaled
    for layer in model.model.layers:
        for parameter in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
            parameter.data = grid[torch.randint(len(grid), parameter.shape)]
    write_gguf(model, tmp_path / "mxfp4.gguf", "MXFP4", tokenizer=False)
    _, weights = read_gguf(tmp_path / "mxfp4.gguf")
    for name, tensor in model.state_dict().items():
        assert torch.equal(weights[name], tensor), name


@pytest.mark.parametrize("arch,qtype", [("llama", "Q8_0"), ("llama", "Q4_1"), ("qwen2", "Q8_0")])
def test_raw_quantized_weights(arch, qtype, tmp_path):
    """Quantized weights kept as the file has them (Q/K rows reordered whole) dequantize to the weights
    read dequantized."""
    write_gguf(tiny_model(arch), tmp_path / "model.gguf", qtype, tokenizer=False)
    _, dense = read_gguf(tmp_path / "model.gguf")
    _, raw = read_gguf(tmp_path / "model.gguf", dequantize=False)
    quantized = {name: weight for name, weight in raw.items() if isinstance(weight, QuantizedWeight)}
    assert "model.layers.0.self_attn.q_proj.weight" in quantized and "model.embed_tokens.weight" in quantized
    for name, weight in raw.items():
        if isinstance(weight, QuantizedWeight):
            assert weight.qtype.name == qtype and weight.shape == tuple(dense[name].shape)
            assert torch.equal(torch.from_numpy(dequantize(weight.raw.numpy(), weight.qtype)), dense[name]), name
        else:
            assert weight.dim() == 1 and torch.equal(weight, dense[name]), name


def test_default_tokenizer(tmp_path):
    """A file with the default model's vocabulary, as parity tests on the engine write them: the config's
    special tokens are the vocabulary's."""
    write_gguf(tiny_model("qwen3", vocab_size=49152), tmp_path / "model.gguf", "Q8_0")
    config, _ = read_gguf(tmp_path / "model.gguf")
    assert (config["vocab_size"], config["bos_token_id"], config["eos_token_id"]) == (49152, 1, 2)
