"""What a decoder's code needs to know of its checkpoint: one frozen config for every family,
read from a Hugging Face `config.json` (as transformers 4.x and 5.x write it) by each family's
own `config()` with the helpers here. Every feature a family may switch on is a field, off by
default, so a layer reads plainly what it does."""

from __future__ import annotations

from dataclasses import dataclass

from backends.builtin.worker.models.rope import Rope

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # HF model_type
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope: Rope
    rms_norm_eps: float = 1e-5
    local_rope: Rope | None = None  # sliding-window layers' own (Gemma 3's local base frequency)
    layer_windows: tuple[int | None, ...] = ()  # each layer's sliding window, None for global attention
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm of each head's query and key before RoPE (Qwen 3, Gemma 3)
    query_scale: float | None = None  # attention scale is query_scale**-0.5 (Gemma), else head_dim**-0.5
    attn_softcap: float | None = None  # tanh soft-capping of attention scores (Gemma 2)
    final_softcap: float | None = None  # and of the logits
    sinks: bool = False  # a learned per-head logit in every softmax's denominator (gpt-oss)
    hidden_act: str = "silu"
    embed_scale: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    sandwich_norms: bool = False  # norms after attention and MLP too, before the residual add (Gemma 2/3)
    num_experts: int = 0  # mixture-of-experts layers: experts, and how many each token takes
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_layers: tuple[bool, ...] = ()
    norm_topk_prob: bool = False  # Qwen3-MoE: the top-k routing weights renormalized to sum to 1
    router: str = "softmax_topk"  # softmax over all experts, then top-k | top-k logits, then softmax (gpt-oss)
    swiglu_limit: float | None = None  # gpt-oss's clamped SwiGLU (its experts' activation)

    @property
    def attention_scale(self) -> float:
        return (self.query_scale or self.head_dim) ** -0.5

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    def rope_of(self, layer: int) -> Rope:
        return self.local_rope if self.local_rope and self.window(layer) else self.rope


def eos_ids(cfg: dict) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    return tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])


def rope_of(cfg: dict, head_dim: int, layer_type: str = FULL) -> Rope:
    """One layer type's RoPE: transformers 5 writes `rope_parameters` (per layer type where they
    differ), older files `rope_theta` and `rope_scaling`; the partial rotary factor sits in either."""
    params = cfg.get("rope_parameters") or {}
    if isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    scaling = cfg.get("rope_scaling") or params
    theta = params.get("rope_theta") or cfg.get("rope_theta") or 10000.0
    partial = params.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0
    return Rope.of(theta, int(head_dim * partial), scaling, cfg.get("rope_freq_factors"))


def layer_types(cfg: dict, default) -> list[str]:
    """Each layer's attention, full or sliding: as the file lists them, else `default(i)`."""
    layers = cfg["num_hidden_layers"]
    return list(cfg.get("layer_types") or [default(i) for i in range(layers)])


def windows(cfg: dict, types: list[str]) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    return tuple(window if kind == SLIDING and window else None for kind in types)


def common(cfg: dict, **overrides) -> ModelConfig:
    """The fields every family reads alike; a family passes what it reads its own way."""
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    fields = dict(
        architecture=cfg["model_type"], vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg.get("intermediate_size", 0), num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=cfg.get("num_key_value_heads") or heads, head_dim=head_dim,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        rope=rope_of(cfg, head_dim), rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False), bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids(cfg), hidden_act=cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu",
    )
    return ModelConfig(**{**fields, **overrides})
