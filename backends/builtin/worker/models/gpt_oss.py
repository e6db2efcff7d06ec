"""gpt-oss: attention with q/k/v/o biases and a learned sink per head, sliding-window layers
alternating with global ones, YaRN RoPE, and a mixture of experts in every layer (top-k logits
softmaxed among themselves; experts with biases and a clamped SwiGLU)."""

from __future__ import annotations

import torch

from backends.builtin.worker.models.config import FULL, SLIDING, ModelConfig, common, layer_types, windows


def config(cfg: dict) -> ModelConfig:
    types = layer_types(cfg, lambda i: SLIDING if (i + 1) % 2 else FULL)
    bias = cfg.get("attention_bias", True)
    return common(cfg, qkv_bias=bias, o_bias=bias, sinks=True, layer_windows=windows(cfg, types),
                  num_experts=cfg["num_local_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
                  moe_intermediate_size=cfg["intermediate_size"], moe_layers=(True,) * cfg["num_hidden_layers"],
                  router="topk_softmax", swiglu_limit=cfg.get("swiglu_limit", 7.0))


def weights(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The checkpoint's experts multiply from the left (x @ W: [E, H, 2I], gate and up columns
    interleaved); here they are Linear weights, [E, 2I, H] with the gate rows first."""
    if any(name.endswith("_blocks") for name in weights):
        raise ValueError("gpt-oss weights in MXFP4 blocks (the released checkpoint): serve its GGUF, or a "
                         "checkpoint dequantized to bf16")
    out = {}
    for name, tensor in weights.items():
        if name.endswith("experts.gate_up_proj"):
            tensor = tensor.transpose(1, 2)
            tensor = torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1)
        elif name.endswith("experts.gate_up_proj_bias"):
            name, tensor = name.replace("gate_up_proj_bias", "gate_up_bias"), torch.cat(
                (tensor[:, 0::2], tensor[:, 1::2]), dim=1)
        elif name.endswith("experts.down_proj"):
            tensor = tensor.transpose(1, 2)
        elif name.endswith("experts.down_proj_bias"):
            name = name.replace("down_proj_bias", "down_bias")
        out[name] = tensor.contiguous()
    return out


ARCHITECTURES = {"gpt_oss": config}
WEIGHTS = {"gpt_oss": weights}
