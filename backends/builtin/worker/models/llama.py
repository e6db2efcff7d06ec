"""Llama 2/3.x (llama3 RoPE scaling), SmolLM, and Mistral (a sliding window over every layer)."""

from __future__ import annotations

from backends.builtin.worker.models.config import SLIDING, ModelConfig, common, layer_types, windows


def config(cfg: dict) -> ModelConfig:
    bias = cfg.get("attention_bias", False)
    types = layer_types(cfg, lambda i: SLIDING)  # a window, where the file sets one, applies to every layer
    return common(cfg, qkv_bias=bias, o_bias=bias, mlp_bias=cfg.get("mlp_bias", False),
                  layer_windows=windows(cfg, types))


ARCHITECTURES = {"llama": config, "mistral": config}
