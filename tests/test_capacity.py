"""KV bytes per token from architecture, against hand-derived figures for published configs."""

import pytest

from advisor.capacity import Architecture, MissingArchitectureField, kv_bytes_per_token

# Fields as in each model's config.json.
LLAMA_31_70B = {"model_type": "llama", "num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64,
                "num_key_value_heads": 8}
QWEN3_32B = {"model_type": "qwen3", "num_hidden_layers": 64, "hidden_size": 5120, "num_attention_heads": 64,
             "num_key_value_heads": 8, "head_dim": 128}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 128,
               "num_key_value_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64}


def test_known_configs_are_exact():
    assert kv_bytes_per_token(Architecture.from_config(LLAMA_31_70B)) == 327_680
    assert kv_bytes_per_token(Architecture.from_config(QWEN3_32B)) == 262_144  # head_dim 128, not 5120/64
    assert kv_bytes_per_token(Architecture.from_config(DEEPSEEK_V3)) == 70_272  # MLA latent + rope key


def test_tensor_parallel_and_dtype():
    llama = Architecture.from_config(LLAMA_31_70B)
    assert kv_bytes_per_token(llama, "fp8", tp=4) == 327_680 / 2 / 4
    assert kv_bytes_per_token(llama, tp=16) == 327_680 / 8  # 8 KV heads cannot split 16 ways: one each
    mla = Architecture.from_config(DEEPSEEK_V3)
    assert kv_bytes_per_token(mla, tp=8) == 70_272  # the latent is not sharded
    assert kv_bytes_per_token(llama, "q8_0") == 327_680 / 2 * 34 / 32  # llama.cpp's block carries its scale
    with pytest.raises(ValueError, match="unknown KV dtype 'fp3'"):
        kv_bytes_per_token(llama, "fp3")


def test_sliding_window_layers_are_capped():
    cfg = {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 1,
           "sliding_window": 1024, "layer_types": ["sliding_attention", "full_attention"] * 2}
    arch = Architecture.from_config(cfg)
    per_layer = 2 * 1 * 64 * 2
    assert kv_bytes_per_token(arch, context=512) == 4 * per_layer  # below the window: all layers pay
    assert kv_bytes_per_token(arch, context=4096) == per_layer * (2 + 2 * 1024 / 4096)
    mistral = Architecture.from_config({"model_type": "mistral", "num_hidden_layers": 32, "hidden_size": 4096,
                                        "num_attention_heads": 32, "num_key_value_heads": 8, "sliding_window": 4096})
    assert kv_bytes_per_token(mistral, context=8192) == kv_bytes_per_token(mistral, context=4096) / 2


def test_missing_fields_are_named_not_guessed():
    with pytest.raises(MissingArchitectureField, match="'num_hidden_layers'"):
        Architecture.from_config({"hidden_size": 10, "num_attention_heads": 2}, "my/config.json")
    with pytest.raises(MissingArchitectureField, match="qk_rope_head_dim"):
        Architecture.from_config({"num_hidden_layers": 2, "kv_lora_rank": 512})


@pytest.mark.slow
def test_weights_of_real_files_match_their_sizes(default_model_dir, tiny_model_dir):
    from advisor.capacity import gguf_weights, safetensors_weights
    from backends.default_model import default_model_path

    gguf = default_model_path()
    weights = gguf_weights(gguf)
    assert weights.params == 134_515_008  # SmolLM2-135M
    assert set(weights.params_by_format) == {"Q4_1", "Q8_0", "F32"}  # layers Q4_1, embeddings Q8_0, norms F32
    assert abs(weights.bytes - gguf.stat().st_size) / gguf.stat().st_size < 0.02  # the rest is metadata
    assert 5.0 < weights.bits_per_weight < 6.0
    for directory in (default_model_dir, tiny_model_dir):
        st = safetensors_weights(directory)
        on_disk = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
        assert abs(st.bytes - on_disk) / on_disk < 0.02
    assert safetensors_weights(default_model_dir).params == weights.params  # the same tensors, dequantized
