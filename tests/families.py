"""Tiny random-weight models of each family the engine serves, built with transformers from the
family's own config class: sizes reduced, every architectural feature on (windows short enough
that prompts outrun them, soft-caps, q/k norms, biases, partial rotary, longrope, sinks, experts),
with the default model's tokenizer. Shared by the architecture, GGUF and format tests."""

from __future__ import annotations

from pathlib import Path

import torch

WINDOW = 8  # shorter than every test prompt: the sliding layers' masks matter
# Gemma scales its embeddings by sqrt(hidden): random ones are drawn that much smaller, else they
# swamp what the layers add and a tied model repeats its last token whatever its layers compute.
# head_dim 64: one the native attention kernels (and vLLM's CPU attention) compute
SMALL = dict(vocab_size=49152, hidden_size=256, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, initializer_range=0.2,
             tie_word_embeddings=False, eos_token_id=2, bos_token_id=1)


def family_configs():
    """HF model_type -> its config, every feature on."""
    import transformers as tf

    return {
        "llama": tf.LlamaConfig(**SMALL, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}),
        "mistral": tf.MistralConfig(**SMALL, sliding_window=WINDOW),
        "qwen2": tf.Qwen2Config(**{**SMALL, "tie_word_embeddings": True}),
        "qwen3": tf.Qwen3Config(**SMALL),
        "qwen3_moe": tf.Qwen3MoeConfig(**SMALL, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                       norm_topk_prob=True),
        "gemma2": tf.Gemma2Config(**{**SMALL, "tie_word_embeddings": True}, sliding_window=WINDOW,  # as vLLM's
                                  query_pre_attn_scalar=64, attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
        # Gemma 3's five sliding layers to one global, the pattern llama.cpp hard-codes (its GGUF has none)
        "gemma3_text": tf.Gemma3TextConfig(**{**SMALL, "num_hidden_layers": 6}, sliding_window=WINDOW,
                                           query_pre_attn_scalar=64,
                                           rope_parameters={
                                               "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                  "rope_theta": 1_000_000.0},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
        "phi3": tf.Phi3Config(**{**SMALL, "max_position_embeddings": 256}, original_max_position_embeddings=64,
                              partial_rotary_factor=0.75, rope_scaling={
                                  "rope_type": "longrope", "short_factor": [1.0 + i / 40 for i in range(24)],
                                  "long_factor": [2.0 + i / 4 for i in range(24)]}),
        "gpt_oss": tf.GptOssConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                                   rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                    "beta_slow": 1.0, "truncate": False,
                                                    "original_max_position_embeddings": 64, "rope_theta": 150000.0}),
    }


def build(model_type: str, directory: Path, tokenizer_dir: Path):
    """The family's random model, saved with the tokenizer; returns the transformers model (fp32, eager)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = family_configs()[model_type]
    config._attn_implementation = "eager"  # the reference: soft-caps and sinks as the family defines them
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # random, not zero, norms and biases (transformers initializes them trivially)
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name or name.endswith("sinks"):
                param.normal_(0.0, 0.3).add_(1.0 if name.endswith("norm.weight") and "gemma" not in model_type
                                             else 0.0)
        if model_type.startswith("gemma"):
            model.model.embed_tokens.weight /= config.hidden_size**0.5
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(directory)
    return model
