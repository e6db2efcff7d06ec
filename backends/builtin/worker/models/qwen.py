"""Qwen 2/2.5 (q/k/v biases), Qwen 3 (per-head q/k norms, no biases) and Qwen3-MoE (Qwen 3's
attention, experts routed by a softmax over all of them, the top-k renormalized)."""

from __future__ import annotations

from dataclasses import replace

import torch

from backends.builtin.worker.models.config import FULL, SLIDING, ModelConfig, common, layer_types, windows


def _windows(cfg: dict) -> tuple[int | None, ...]:
    """A window only where `use_sliding_window` is set, from layer `max_window_layers` on."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    first = cfg.get("max_window_layers", 0)
    return windows({**cfg, "sliding_window": window}, layer_types(cfg, lambda i: SLIDING if i >= first else FULL))


def qwen2(cfg: dict) -> ModelConfig:
    return common(cfg, qkv_bias=True, layer_windows=_windows(cfg))


def qwen3(cfg: dict) -> ModelConfig:
    bias = cfg.get("attention_bias", False)
    return common(cfg, qk_norm=True, qkv_bias=bias, o_bias=bias, layer_windows=_windows(cfg))


def qwen3_moe(cfg: dict) -> ModelConfig:
    experts = cfg.get("num_experts") or cfg["num_local_experts"]  # transformers 5 writes the latter
    step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
    moe_layers = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(cfg["num_hidden_layers"]))
    return replace(qwen3(cfg), num_experts=experts, num_experts_per_tok=cfg["num_experts_per_tok"],
                   moe_intermediate_size=cfg["moe_intermediate_size"], moe_layers=moe_layers,
                   norm_topk_prob=cfg.get("norm_topk_prob", False))


def moe_weights(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Checkpoints name each expert's projections (`mlp.experts.7.gate_proj.weight`; transformers 5
    stacks them itself, under this model's names) and the router `mlp.gate`: stacked and renamed."""
    out = {}
    for name, tensor in weights.items():
        if ".mlp.experts." in name and name.split(".mlp.experts.")[1][0].isdigit():
            continue
        out[name.replace(".mlp.gate.weight", ".mlp.router.weight")] = tensor
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        if f"{prefix}.0.gate_proj.weight" not in weights:
            continue
        each = range(config.num_experts)
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat(
            (weights[f"{prefix}.{e}.gate_proj.weight"], weights[f"{prefix}.{e}.up_proj.weight"])) for e in each])
        out[f"{prefix}.down_proj"] = torch.stack([weights[f"{prefix}.{e}.down_proj.weight"] for e in each])
    return out


ARCHITECTURES = {"qwen2": qwen2, "qwen3": qwen3, "qwen3_moe": qwen3_moe}
WEIGHTS = {"qwen3_moe": moe_weights}
