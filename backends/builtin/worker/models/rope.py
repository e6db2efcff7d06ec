"""Rotary position embeddings: the inverse frequencies and the cos/sin scale of each variant the
served families use (default, linear, llama3, yarn, longrope), as transformers'
`modeling_rope_utils.py` computes them, over the first `rotary_dim` features of a head (Phi's
partial rotary)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Rope:
    theta: float
    rotary_dim: int
    scaling: tuple[tuple[str, object], ...] = ()  # HF's scaling dict, frozen: (("rope_type", "llama3"), ...)
    freq_factors: tuple[float, ...] | None = None  # GGUF's rope_freqs (llama3 scaling, precomputed)
    max_len: int = 0  # the engine's context length: longrope takes its long factors beyond the original

    @classmethod
    def of(cls, theta: float, rotary_dim: int, scaling: dict | None = None, freq_factors=None) -> Rope:
        items = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in (scaling or {}).items()
                             if k not in ("rope_theta", "partial_rotary_factor")))
        return cls(theta, rotary_dim, items, tuple(freq_factors) if freq_factors else None)

    @property
    def kind(self) -> str:
        scaling = dict(self.scaling)
        return scaling.get("rope_type", scaling.get("type", "default"))

    def inv_freq(self) -> torch.Tensor:
        dim = self.rotary_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if self.freq_factors:
            return inv_freq / torch.tensor(self.freq_factors, dtype=torch.float32)
        scaling, kind = dict(self.scaling), self.kind
        if kind == "default":
            return inv_freq
        if kind == "linear":
            return inv_freq / scaling["factor"]
        if kind == "llama3":
            return _llama3(inv_freq, scaling)
        if kind == "yarn":
            return _yarn(self.theta, dim, scaling)
        if kind == "longrope":
            original = scaling["original_max_position_embeddings"]
            factors = scaling["long_factor"] if self.max_len > original else scaling["short_factor"]
            shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
            return 1.0 / (torch.tensor(factors, dtype=torch.float32) * self.theta**shape)
        raise ValueError(f"unsupported rope scaling {kind!r} (supported: default, linear, llama3, yarn, longrope)")

    def attention_factor(self) -> float:
        """What cos and sin are multiplied by (yarn's and longrope's attention scaling; 1 elsewhere)."""
        scaling = dict(self.scaling)
        if scaling.get("attention_factor") is not None:
            return scaling["attention_factor"]
        factor = scaling.get("factor") or 1.0
        if self.kind == "yarn":
            mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
            if mscale and mscale_all_dim:
                return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
            return _yarn_mscale(factor)
        if self.kind == "longrope":
            original = scaling["original_max_position_embeddings"]
            return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        return 1.0

    def cos_sin(self, inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
        """cos and sin of each position, [t, rotary_dim] each, in the activations' dtype."""
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = self.attention_factor()
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def _llama3(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(base: float, dim: int, scaling: dict) -> torch.Tensor:
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers does, against a division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
