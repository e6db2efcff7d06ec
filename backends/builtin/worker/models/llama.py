"""Llama-architecture decoder (Llama 2/3, SmolLM, Mistral without sliding window...).

Parameter names follow Hugging Face's `LlamaForCausalLM`, so a safetensors checkpoint loads
as it is and the numerics follow the reference implementation step for step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from backends.builtin.worker.attention import AttentionMetadata, LayerKV, paged_attention


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF's dict: {"rope_type": "llama3" | "linear", ...}
    rope_freq_factors: tuple[float, ...] | None = None  # GGUF's rope_freqs (llama3 scaling, precomputed)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: dict) -> LlamaConfig:
        eos = cfg.get("eos_token_id")
        heads = cfg["num_attention_heads"]
        # transformers >= 5 writes `rope_parameters`; older files `rope_theta` + `rope_scaling`.
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=cfg.get("rope_theta") or rope.get("rope_theta", 10000.0), rope_scaling=scaling,
            rope_freq_factors=tuple(cfg["rope_freq_factors"]) if cfg.get("rope_freq_factors") else None,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        )


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies with the scaling variants Llama configs use (default, linear, llama3)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if config.rope_freq_factors:
        return inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    if kind != "default":
        raise ValueError(f"unsupported rope scaling {kind!r} (supported: default, linear, llama3)")
    return inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ops) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream's next value (x + residual, or x first) and its normalized form;
        with the native ops, in one pass that overwrites x and residual."""
        if ops is not None:
            residual = torch.zeros_like(x) if residual is None else residual
            ops.add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = x if residual is None else x + residual
        dtype = residual.dtype
        x = residual.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype), residual


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, q_size, kv_size = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(hidden, sum(self.sizes), bias=False)  # q, k, v in one GEMM
        self.o_proj = nn.Linear(q_size, hidden, bias=False)

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata, ops) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if ops is not None:
            ops.rotary(qkv, cos, sin, self.num_heads, self.num_kv_heads)
        q, k, v = qkv.split(self.sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if ops is None:
            cos, sin = cos[:, None, :], sin[:, None, :]
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        out = paged_attention(q, k, v, kv_cache, meta, self.head_dim**-0.5)
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        if ops is not None:
            return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


# Hugging Face projections this model runs as one GEMM: fused name -> parts, in order.
PACKED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def pack_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict with the fused projections concatenated (other names unchanged)."""
    packed = dict(weights)
    for name in weights:
        for fused, parts in PACKED.items():
            if name.endswith(f"{parts[0]}.weight"):
                prefix = name.removesuffix(f"{parts[0]}.weight")
                packed[f"{prefix}{fused}.weight"] = torch.cat([packed.pop(f"{prefix}{p}.weight") for p in parts])
    return packed


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, cos, sin, kv_cache, meta, ops) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the last sublayer's output, residual: the stream before it (None at the first layer)."""
        x, residual = self.input_layernorm(x, residual, ops)
        x = self.self_attn(x, cos, sin, kv_cache, meta, ops)
        x, residual = self.post_attention_layernorm(x, residual, ops)
        return self.mlp(x, ops), residual


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.inv_freq: torch.Tensor | None = None  # fp32 RoPE frequencies, set by the runner on its device
        self.ops = None  # the native element-wise ops (kernels.layer_ops), set by the runner where they serve

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKV],
        meta: AttentionMetadata, logits_index: torch.Tensor, hidden_index: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states of the step's flattened tokens -> logits at `logits_index` only, and the
        final hidden states (after the last norm, which only these rows go through) at `hidden_index`,
        which pooling reads; both float32."""
        x = self.model.embed_tokens(input_ids)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, cos, sin, kv_cache, meta, self.ops)
        index = torch.cat((logits_index, hidden_index))
        x, _ = self.model.norm(x[index], residual[index], self.ops)
        return self.lm_head(x[: len(logits_index)]).float(), x[len(logits_index) :].float()
