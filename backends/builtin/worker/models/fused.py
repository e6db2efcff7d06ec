"""A decode step's decoder layers in one native call (`csrc/decode_layers.cpp`), where every layer
has the Llama shape and every projection is a native one: the same kernels the layers' own
forwards call, without a dozen Python calls a layer around them. The model's forward takes it for
steps of decode tokens only (a speculating sequence's rows among them: each is attended as a decode
token); prompt chunks, LoRA's wrapped projections, windows, q/k norms, experts and an int8 KV cache
keep the layers' own path."""

from __future__ import annotations

import torch

from backends.builtin.worker.attention import AttentionMetadata, LayerKV
from backends.builtin.worker.models.layers import MLP, CausalLM


def _projection(linear: torch.nn.Module) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """(kind, weight, bias or an empty tensor) of a native projection (one with `native_projection`:
    GGUF blocks, or bf16 pairs), None for any other."""
    native = getattr(linear, "native_projection", None)
    if native is None:
        return None
    kind, weight, bias = native
    return kind, weight, bias if bias is not None else torch.empty(0)


class FusedDecode:
    def __init__(self, model: CausalLM, layers: list[torch.Tensor], kinds: list[int]) -> None:
        config = model.config
        self.ops, self.layers, self.kinds = model.ops, layers, kinds
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.eps, self.scale = config.rms_norm_eps, config.attention_scale

    @classmethod
    def of(cls, model: CausalLM) -> FusedDecode | None:
        """The model's layers as the native call takes them, or None where one of them is not
        Llama-shaped with native projections (or the native ops are off)."""
        if model.ops is None or len(model.inv_freqs) != 1:
            return None
        layers: list[torch.Tensor] = []
        kinds: list[int] = []
        for layer in model.model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            if (layer.sandwich or not attention.plain or attention.qk_norm or not attention.full_rotary
                    or type(mlp) is not MLP or not mlp.silu):
                return None
            projections = [_projection(p) for p in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj,
                                                    mlp.down_proj)]
            if None in projections:
                return None
            layers += [layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()]
            for kind, weight, bias in projections:
                kinds.append(kind)
                layers += [weight, bias]
        return cls(model, layers, kinds)

    @staticmethod
    def serves(meta: AttentionMetadata, kv_caches: list[LayerKV]) -> bool:
        """Whether a step is decode tokens only, on a cache in the model's dtype."""
        return (meta.kernel is not None and meta.chunks is None and not meta.gather
                and kv_caches[0].scales is None)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: list[LayerKV],
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's output and the residual stream before it."""
        part = meta.kernel
        return tuple(self.ops.decode_layers(x, cos, sin, meta.slot_mapping, part.block_tables, part.positions,
                                            [kv.data for kv in kv_caches], self.layers, self.kinds, self.heads,
                                            self.kv_heads, self.eps, self.scale))
