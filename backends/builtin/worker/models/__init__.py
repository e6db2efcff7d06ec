"""The decoder families the engine serves: each file reads its family's Hugging Face config into
a `ModelConfig` (and maps its checkpoint's names where they differ); `layers.CausalLM` runs them all."""

from __future__ import annotations

import torch

from backends.builtin.worker.models import gemma, gpt_oss, llama, phi3, qwen
from backends.builtin.worker.models.config import ModelConfig
from backends.builtin.worker.quant import QuantizedWeight

_FAMILIES = (llama, qwen, gemma, phi3, gpt_oss)
CONFIGS = {model_type: read for family in _FAMILIES for model_type, read in family.ARCHITECTURES.items()}
_WEIGHTS = {model_type: mapping for family in _FAMILIES
            for model_type, mapping in getattr(family, "WEIGHTS", {}).items()}
SUPPORTED_ARCHITECTURES = frozenset(CONFIGS)  # HF model_type values
# Projections this engine runs as one GEMM: fused name -> Hugging Face parts, in order.
PACKED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def model_config(cfg: dict) -> ModelConfig:
    """A Hugging Face config.json's contents -> the engine's config (ValueError for a family it
    does not serve)."""
    read = CONFIGS.get(cfg.get("model_type"))
    if read is None:
        raise ValueError(f"architecture {cfg.get('model_type')!r} is not supported by the built-in engine "
                         f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})")
    return read(cfg)


def model_weights(weights: dict[str, torch.Tensor | QuantizedWeight], config: ModelConfig) -> dict:
    """A checkpoint's state dict under the engine's parameter names: the family's own renames,
    then the fused projections concatenated (weights and biases; quantized weights of one type
    row by row, of mixed types kept as a tuple of parts)."""
    mapping = _WEIGHTS.get(config.architecture)
    packed = dict(mapping(weights, config) if mapping else weights)
    for name in list(packed):
        for fused, parts in PACKED.items():
            for kind in ("weight", "bias"):
                if name.endswith(f"{parts[0]}.{kind}"):
                    prefix = name.removesuffix(f"{parts[0]}.{kind}")
                    packed[f"{prefix}{fused}.{kind}"] = _fuse([packed.pop(f"{prefix}{p}.{kind}") for p in parts])
    return packed


def _fuse(parts: list) -> torch.Tensor | QuantizedWeight | tuple:
    if all(isinstance(part, torch.Tensor) for part in parts):
        return torch.cat(parts)
    if all(isinstance(part, QuantizedWeight) and part.qtype == parts[0].qtype for part in parts):
        return QuantizedWeight.concat(parts)
    return tuple(parts)
