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


@dataclass(frozen=True)
class Weights:
    params: int
    bytes: int
    params_by_format: dict[str, int]  # e.g. {"Q4_1": ..., "Q8_0": ..., "F32": ...}

    @property
    def bits_per_weight(self) -> float:
        return self.bytes * 8 / self.params


def gguf_weights(path) -> Weights:
    """Parameters and bytes of a GGUF file's tensors, from each tensor's quantization type
    (block and byte sizes as the `gguf` package defines them): no guess about k-quant mixes."""
    from gguf import GGUFReader
    from gguf.constants import GGML_QUANT_SIZES

    params = size = 0
    by_format: dict[str, int] = {}
    for tensor in GGUFReader(path).tensors:
        block, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
        count = int(tensor.n_elements)
        params += count
        size += count // block * block_bytes
        by_format[tensor.tensor_type.name] = by_format.get(tensor.tensor_type.name, 0) + count
    return Weights(params, size, by_format)


SAFETENSORS_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1,
                           "I32": 4, "I64": 8, "BOOL": 1}


def safetensors_weights(directory) -> Weights:
    """Parameters and bytes of a Hugging Face directory's *.safetensors, read from their headers."""
    import json
    import struct
    from pathlib import Path

    params = size = 0
    by_format: dict[str, int] = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        with open(file, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            count = math.prod(entry["shape"])
            params += count
            size += count * SAFETENSORS_DTYPE_BYTES[entry["dtype"]]
            by_format[entry["dtype"]] = by_format.get(entry["dtype"], 0) + count
    if not params:
        raise FileNotFoundError(f"{directory}: no *.safetensors weights")
    return Weights(params, size, by_format)
