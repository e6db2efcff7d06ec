"""The layers the families share, each switched by the `ModelConfig` fields it reads: attention
(fused q/k/v, optional biases, per-head q/k norms, partial rotary, sliding windows, soft-capped
scores, sinks), the gated MLP, the mixture of experts, the decoder layer (pre-norm, or Gemma's
sandwich of norms) and the causal LM around them.

Parameter names follow Hugging Face's but where a projection runs fused (q/k/v, gate/up, the
experts' stacked weights): each family's `weights()` maps a checkpoint onto these names, so a
safetensors checkpoint or a GGUF file's (read into the same names) loads as it is, and the
numerics follow the reference implementation step for step.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from backends.builtin.worker.attention import AttentionMetadata, LayerKV, paged_attention
from backends.builtin.worker.models.config import ModelConfig
from backends.builtin.worker.models.rope import Rope


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


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [t, heads, head_dim]; RoPE on its first cos.shape[-1] features (all but in Phi's partial rotary)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rotated, passed = x[..., :dim], x[..., dim:]
    return torch.cat((rotated * cos + rotate_half(rotated) * sin, passed), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, q_size, kv_size = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(hidden, sum(self.sizes), bias=config.qkv_bias)  # q, k, v in one GEMM
        self.o_proj = nn.Linear(q_size, hidden, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.scale = config.attention_scale
        self.window, self.softcap = config.window(layer), config.attn_softcap
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if config.sinks else None
        self.full_rotary = config.rope_of(layer).rotary_dim == self.head_dim

    @property
    def plain(self) -> bool:
        """Whether the native attention kernels compute this layer (no window, soft-cap or sinks)."""
        return self.window is None and self.softcap is None and self.sinks is None

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata, ops) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        native_rotary = ops is not None and self.full_rotary and not self.qk_norm
        if native_rotary:
            ops.rotary(qkv, cos, sin, self.num_heads, self.num_kv_heads)
        q, k, v = qkv.split(self.sizes, dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, _ = self.q_norm(q, None, None)
            k, _ = self.k_norm(k, None, None)
        if not native_rotary:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, self.window, self.softcap, self.sinks)
        return self.o_proj(out.flatten(1))


def activation(name: str):
    if name == "silu":
        return F.silu
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    raise ValueError(f"unsupported activation {name!r} (supported: silu, gelu_pytorch_tanh)")


class MLP(nn.Module):
    """act(gate) * up, then down; gate and up in one GEMM."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.silu = config.hidden_act == "silu"
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        if ops is not None and self.silu:
            return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Experts(nn.Module):
    """The experts' weights stacked: gate and up rows [E, 2I, H] (gate first), down [E, H, I]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        experts, hidden, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inter))
        biased = config.swiglu_limit is not None  # gpt-oss's experts have biases
        self.gate_up_bias = nn.Parameter(torch.empty(experts, 2 * inter)) if biased else None
        self.down_bias = nn.Parameter(torch.empty(experts, hidden)) if biased else None
        self.limit = config.swiglu_limit
        self.act = activation(config.hidden_act) if self.limit is None else None

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        if self.limit is None:
            return self.act(gate) * up
        # gpt-oss's SwiGLU: clamped, sigmoid(1.702 x) as the gate, and up shifted by one
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * 1.702))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x: [t, H]; each token's top-k expert ids and routing weights, [t, k]. The step's tokens
        are grouped by expert, so each expert runs once per step on all the tokens routed to it."""
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # the (token, slot) pairs, expert by expert
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        top_k, out, start = experts.shape[1], torch.zeros_like(x), 0
        weights = weights.flatten()
        for expert, count in enumerate(counts):
            if not count:
                continue
            pairs = order[start:start + count]
            start += count
            tokens = pairs // top_k
            bias = self.gate_up_bias[expert] if self.gate_up_bias is not None else None
            hidden = self.activate(F.linear(x[tokens], self.gate_up_proj[expert], bias))
            bias = self.down_bias[expert] if self.down_bias is not None else None
            y = F.linear(hidden, self.down_proj[expert], bias)
            out.index_add_(0, tokens, (y * weights[pairs, None]).to(x.dtype))
        return out


class SparseMoE(nn.Module):
    """Top-k routing, with the router's normalisation as each family defines it."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=config.router == "topk_softmax")
        self.experts = Experts(config)
        self.top_k, self.kind, self.renormalize = config.num_experts_per_tok, config.router, config.norm_topk_prob

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        logits = self.router(x)
        if self.kind == "topk_softmax":  # gpt-oss: the top-k logits, softmaxed among themselves
            top, experts = torch.topk(logits, self.top_k, dim=-1)
            weights = torch.softmax(top, dim=1)
        else:  # Qwen3-MoE: softmax over every expert, the top-k kept (and renormalized)
            top, experts = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), self.top_k, dim=-1)
            if self.renormalize:
                top /= top.sum(dim=-1, keepdim=True)
            weights = top.to(logits.dtype)
        return self.experts(x, weights, experts)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = SparseMoE(config) if config.moe_layers and config.moe_layers[layer] else MLP(config)
        norm = (config.hidden_size, config.rms_norm_eps)
        self.input_layernorm = RMSNorm(*norm)
        self.post_attention_layernorm = RMSNorm(*norm)
        self.sandwich = config.sandwich_norms
        if self.sandwich:  # Gemma: post_attention_layernorm ends the attention, these wrap the MLP
            self.pre_feedforward_layernorm = RMSNorm(*norm)
            self.post_feedforward_layernorm = RMSNorm(*norm)
        self.rope = config.rope_of(layer)

    def forward(self, x, residual, cos, sin, kv_cache, meta, ops) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the last sublayer's output, residual: the stream before it (None at the first layer)."""
        x, residual = self.input_layernorm(x, residual, ops)
        x = self.self_attn(x, cos, sin, kv_cache, meta, ops)
        if self.sandwich:
            x, _ = self.post_attention_layernorm(x, None, ops)
            x, residual = self.pre_feedforward_layernorm(x, residual, ops)
            x, _ = self.post_feedforward_layernorm(self.mlp(x, ops), None, ops)
            return x, residual
        x, residual = self.post_attention_layernorm(x, residual, ops)
        return self.mlp(x, ops), residual


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.inv_freqs: dict[Rope, torch.Tensor] = {}  # fp32 RoPE frequencies, set by `prepare`
        self.ops = None  # the native element-wise ops (kernels.layer_ops), set by the runner where they serve
        self.fused_decode = None  # the layers in one native call for decode steps (fused.FusedDecode), likewise

    def prepare(self, device: torch.device, max_len: int) -> None:
        """Settle what depends on where and how long the model runs: RoPE frequencies (fp32, as
        the reference keeps them; longrope's factors by the context length), and sliding windows
        no longer than the context dropped (such a window hides nothing)."""
        for layer in self.model.layers:
            attention = layer.self_attn
            if attention.window is not None and attention.window >= max_len:
                attention.window = None
            layer.rope = replace(layer.rope, max_len=max_len)
            if layer.rope not in self.inv_freqs:
                self.inv_freqs[layer.rope] = layer.rope.inv_freq().to(device)

    @property
    def plain_attention(self) -> bool:
        """Whether every layer's attention is one the native kernels compute."""
        return all(layer.self_attn.plain for layer in self.model.layers)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKV],
        meta: AttentionMetadata, logits_index: torch.Tensor, hidden_index: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states of the step's flattened tokens -> logits at `logits_index` only, and the
        final hidden states (after the last norm, which only these rows go through) at `hidden_index`,
        which pooling reads; both float32."""
        x = self.model.embed_tokens(input_ids)
        if self.config.embed_scale:
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        rotary = {rope: rope.cos_sin(inv_freq, positions, x.dtype) for rope, inv_freq in self.inv_freqs.items()}
        if self.fused_decode is not None and self.fused_decode.serves(meta, kv_caches):
            x, residual = self.fused_decode(x, *next(iter(rotary.values())), kv_caches, meta)
        else:
            residual = None
            for layer, kv_cache in zip(self.model.layers, kv_caches):
                x, residual = layer(x, residual, *rotary[layer.rope], kv_cache, meta, self.ops)
        index = torch.cat((logits_index, hidden_index))
        x, _ = self.model.norm(x[index], residual[index], self.ops)
        logits = self.lm_head(x[: len(logits_index)]).float()
        if self.config.final_softcap:
            logits = torch.tanh(logits / self.config.final_softcap) * self.config.final_softcap
        return logits, x[len(logits_index):].float()
