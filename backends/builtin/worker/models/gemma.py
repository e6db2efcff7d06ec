"""Gemma 2 and Gemma 3 (text): embeddings scaled by sqrt(hidden), RMSNorms that multiply by
(1 + weight), a norm after each sublayer as well as before, GELU-tanh MLPs, sliding-window layers
interleaved with global ones; Gemma 2 soft-caps attention scores and logits, Gemma 3 norms each
head's query and key and gives its sliding layers a RoPE base of their own."""

from __future__ import annotations

import torch

from backends.builtin.worker.models.config import FULL, SLIDING, ModelConfig, common, layer_types, rope_of, windows
from backends.builtin.worker.models.rope import Rope


def _common(cfg: dict, every: int, **fields) -> ModelConfig:
    bias = cfg.get("attention_bias", False)
    types = layer_types(cfg, lambda i: SLIDING if (i + 1) % every else FULL)
    return common(cfg, rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), query_scale=cfg.get("query_pre_attn_scalar"),
                  embed_scale=True, sandwich_norms=True, qkv_bias=bias, o_bias=bias,
                  hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
                  layer_windows=windows(cfg, types), **fields)


def gemma2(cfg: dict) -> ModelConfig:
    return _common(cfg, 2, attn_softcap=cfg.get("attn_logit_softcapping"),
                   final_softcap=cfg.get("final_logit_softcapping"))


def gemma3(cfg: dict) -> ModelConfig:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if isinstance((cfg.get("rope_parameters") or {}).get(SLIDING), dict):  # transformers 5
        local = rope_of(cfg, head_dim, SLIDING)
    else:
        local = Rope.of(cfg.get("rope_local_base_freq", 10000.0), head_dim)
    if not (cfg.get("rope_parameters") or cfg.get("rope_theta")):
        cfg = {**cfg, "rope_theta": 1_000_000.0}  # Gemma 3's global default
    return _common(cfg, cfg.get("sliding_window_pattern", 6), qk_norm=True, local_rope=local,
                   attn_softcap=cfg.get("attn_logit_softcapping"), final_softcap=cfg.get("final_logit_softcapping"))


def weights(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Gemma's norms multiply by (1 + weight): the 1 is added once here, so the shared RMSNorm
    (and its native kernel) serves them (llama.cpp's converter does the same)."""
    return {name: tensor + 1 if name.endswith("norm.weight") else tensor for name, tensor in weights.items()}


ARCHITECTURES = {"gemma2": gemma2, "gemma3_text": gemma3}
WEIGHTS = {"gemma2": weights, "gemma3_text": weights}
