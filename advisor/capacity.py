"""Capacity model: what a model's KV cache costs per token, from its architecture.

Formulas (sources in the project's reference notes on advisor tools):
- MHA/GQA: 2 (K and V) x layers x ceil(kv_heads / tp) x head_dim x bytes, using the config's own
  `head_dim` when it has one (Qwen3-32B: 128, not hidden / heads = 80);
- MLA (DeepSeek V2/V3): layers x (kv_lora_rank + qk_rope_head_dim) x bytes, not sharded by TP;
- sliding-window layers hold at most `window` tokens, so at a context length they cost
  min(context, window) / context of a full layer per token.
It refuses to guess: a missing field is named in the error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KV_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}


class MissingArchitectureField(ValueError):
    """The config lacks a field the formula needs; the message names it."""


@dataclass(frozen=True)
class Architecture:
    layers: int
    kv_heads: int | None  # None for MLA
    head_dim: int | None
    kv_lora_rank: int | None = None  # MLA
    qk_rope_head_dim: int | None = None  # MLA
    sliding_window: int | None = None
    sliding_layers: int = 0  # how many of `layers` use the window

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank is not None

    @classmethod
    def from_config(cls, cfg: dict, source: str = "config") -> Architecture:
        """From a Hugging Face config.json (the text config of a multimodal one)."""
        cfg = cfg.get("text_config", cfg)

        def need(*names: str):
            for name in names:
                if cfg.get(name) is not None:
                    return cfg[name]
            raise MissingArchitectureField(f"{source}: field {' or '.join(map(repr, names))} is missing")

        layers = need("num_hidden_layers", "n_layer", "num_layers")
        if cfg.get("kv_lora_rank") is not None:
            return cls(layers, None, None, cfg["kv_lora_rank"], need("qk_rope_head_dim"))
        heads = need("num_attention_heads", "n_head")
        kv_heads = cfg.get("num_key_value_heads") or heads  # absent means plain MHA, as transformers reads it
        head_dim = cfg.get("head_dim") or need("hidden_size", "n_embd") // heads
        window, sliding = cfg.get("sliding_window"), 0
        if window and cfg.get("layer_types"):
            sliding = sum(t == "sliding_attention" for t in cfg["layer_types"])
        elif window and cfg.get("use_sliding_window", True) and cfg.get("model_type") in ("mistral", "mixtral"):
            sliding = layers
        return cls(layers, kv_heads, head_dim, sliding_window=window if sliding else None, sliding_layers=sliding)


def kv_bytes_per_token(arch: Architecture, kv_dtype: str = "bf16", tp: int = 1, context: int | None = None) -> float:
    """KV cache bytes one token costs on one GPU, averaged over a sequence of `context` tokens
    (which only matters for sliding-window layers)."""
    if kv_dtype not in KV_DTYPE_BYTES:
        raise ValueError(f"unknown KV dtype {kv_dtype!r} (choose from {', '.join(KV_DTYPE_BYTES)})")
    size = KV_DTYPE_BYTES[kv_dtype]
    if arch.mla:
        return arch.layers * (arch.kv_lora_rank + arch.qk_rope_head_dim) * size
    per_layer = 2 * math.ceil(arch.kv_heads / tp) * arch.head_dim * size
    full = arch.layers - arch.sliding_layers
    share = min(context, arch.sliding_window) / context if arch.sliding_layers and context else 1.0
    return per_layer * (full + arch.sliding_layers * share)
