"""A Linear from GGUF blocks: a weight kept in ggml's quantized block format (Q8_0, Q4_0, Q4_1, Q4_K,
Q6_K) and multiplied as it is, by the native kernel (`csrc/quant_linear.cpp`: x's rows quantized to
int8, integer dot products per block), so a decode step reads the quantized bytes, not a float copy.
A prompt's rows in bf16 (16 and more, where AVX512-BF16 is built) multiply the weight dequantized to
bf16 a tile at a time instead, on oneDNN's GEMM. Where the native kernels are not built, or x's dtype
is neither float32 nor bf16, the weight is dequantized in PyTorch for each call (slow, but the
engine runs).

Wiring a GGUF model (reader: a `gguf.GGUFReader`; ggml lists shapes innermost first, these are
PyTorch's (N, K)):

    weight = QuantizedWeight.from_gguf(tensor)            # a tensor of reader.tensors, raw bytes copied
    q = q.permute_rows(order)                             # llama.cpp's Q/K row order undone: whole rows move
    qkv = fused_linear([q, k, v])                         # one QuantLinear over the rows of all three where
                                                          # their types agree, else one each, outputs concatenated
    y = QuantLinear(weight)(x)                            # x [..., K] float32/bf16 -> [..., N] in x's dtype
    rows = weight.dequantize(token_ids)                   # float32 rows: a quantized (tied) embedding's lookup

`order` for llama.cpp's Q/K rows: `gguf_weights.unpermuted_rows(n, heads)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from backends.builtin.worker import kernels

SUPPORTED = frozenset({GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
                       GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K})
NATIVE_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A [N, K] weight as ggml blocks: `raw` is uint8 [N, K / block elements * block bytes], each row
    its K / block elements blocks."""

    qtype: GGMLQuantizationType
    shape: tuple[int, int]  # (N, K), PyTorch's order
    raw: torch.Tensor

    def __post_init__(self) -> None:
        if self.qtype not in SUPPORTED:
            served = ", ".join(sorted(t.name for t in SUPPORTED))
            raise ValueError(f"{self.qtype.name} weights are not served (only {served})")
        n, k = self.shape
        block, block_bytes = GGML_QUANT_SIZES[self.qtype]
        if k % block or self.raw.dtype != torch.uint8 or tuple(self.raw.shape) != (n, k // block * block_bytes):
            raise ValueError(f"{self.qtype.name} [{n}, {k}]: raw bytes {tuple(self.raw.shape)} {self.raw.dtype} do not "
                             f"hold {k} / {block} blocks of {block_bytes} bytes a row")

    @property
    def type_name(self) -> str:
        return self.qtype.name

    @classmethod
    def from_gguf(cls, tensor) -> QuantizedWeight:
        """A 2-D tensor of a `gguf.GGUFReader` (its memory-mapped bytes copied)."""
        qtype = GGMLQuantizationType(tensor.tensor_type)
        if len(tensor.shape) != 2:
            raise ValueError(f"{tensor.name}: a {len(tensor.shape)}-D tensor is no Linear weight")
        k, n = (int(d) for d in tensor.shape)
        return cls(qtype, (n, k), torch.from_numpy(np.array(tensor.data, dtype=np.uint8)).reshape(n, -1))

    @classmethod
    def from_float(cls, weight: torch.Tensor, qtype: GGMLQuantizationType) -> QuantizedWeight:
        """`weight` quantized by gguf's own quantizer (Q8_0, Q4_0, Q4_1: gguf quantizes no K-quant)."""
        from gguf.quants import quantize

        raw = quantize(weight.detach().float().cpu().numpy(), qtype)
        return cls(qtype, tuple(weight.shape), torch.from_numpy(np.ascontiguousarray(raw)))

    @property
    def bytes(self) -> int:
        return self.raw.numel()

    def permute_rows(self, order: torch.Tensor) -> QuantizedWeight:
        """The weight whose row i is row order[i]: a row is whole blocks, so quantized rows move as bytes."""
        return QuantizedWeight(self.qtype, self.shape, self.raw[order].contiguous())

    @staticmethod
    def concat(weights: Sequence[QuantizedWeight]) -> QuantizedWeight:
        """The rows of `weights`, one after another (a fused projection): all of one type and K."""
        first = weights[0]
        if any(w.qtype != first.qtype or w.shape[1] != first.shape[1] for w in weights):
            raise ValueError("concatenated weights need one type and K: "
                             + ", ".join(f"{w.type_name} {list(w.shape)}" for w in weights))
        return QuantizedWeight(first.qtype, (sum(w.shape[0] for w in weights), first.shape[1]),
                               torch.cat([w.raw for w in weights]))

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 values [N, K], or of the rows indexed by `rows` only (an embedding lookup)."""
        raw = self.raw if rows is None else self.raw[rows.reshape(-1)]
        ops = kernels.load()
        values = (ops.quant_dequantize(raw, int(self.qtype)) if ops is not None
                  else dequantize_torch(raw, self.qtype, self.shape[1]))
        return values if rows is None else values.reshape(*rows.shape, self.shape[1])


class QuantLinear(torch.nn.Module):
    """y = x @ W^T (+ bias), W a `QuantizedWeight`, on the CPU. native=False: the PyTorch path (tests)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None, native: bool = True) -> None:
        super().__init__()
        self.qtype = weight.qtype
        self.type_id = int(weight.qtype)
        self.out_features, self.in_features = weight.shape
        # plain attributes, not buffers: a model's .to(dtype) leaves them as they are (the bias float32, as
        # the kernel takes it), and the forward reads them without nn.Module's lookups
        self.raw = weight.raw
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.ops = kernels.load() if native else None

    @property
    def weight(self) -> QuantizedWeight:
        return QuantizedWeight(self.qtype, (self.out_features, self.in_features), self.raw)

    @property
    def native_projection(self) -> tuple[int, torch.Tensor, torch.Tensor | None] | None:
        """(kind, weight, bias) as `csrc/decode_layers.cpp` takes a projection: the ggml type id;
        None where the native kernels are off."""
        return None if self.ops is None else (self.type_id, self.raw, self.bias)

    @property
    def bytes(self) -> int:
        """Bytes of weights read per forward."""
        return self.raw.numel() + (0 if self.bias is None else self.bias.numel() * 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None and x.dtype in NATIVE_DTYPES and x.is_cpu:
            if x.dim() == 2:
                return self.ops.quant_linear(x, self.raw, self.type_id, self.bias)
            y = self.ops.quant_linear(x.reshape(-1, self.in_features), self.raw, self.type_id, self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        y = x @ dequantize_torch(self.raw, self.qtype, self.in_features).to(x).T
        return y if self.bias is None else y + self.bias.to(x)

    def extra_repr(self) -> str:
        return f"{self.qtype.name}, in_features={self.in_features}, out_features={self.out_features}"


class ConcatLinear(torch.nn.Module):
    """A fused projection whose parts differ in type (a Q4_K_M file mixes Q4_K and Q6_K): each part's
    own QuantLinear, their outputs concatenated."""

    def __init__(self, parts: Sequence[torch.nn.Module]) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    @property
    def bytes(self) -> int:
        return sum(p.bytes for p in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


class QuantEmbedding(torch.nn.Module):
    """An embedding table kept as ggml blocks: each looked-up row dequantized, in `dtype`."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight, self.dtype = weight, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight.dequantize(ids).to(self.dtype)


def fused_linear(weights: Sequence[QuantizedWeight], native: bool = True) -> QuantLinear | ConcatLinear:
    """One Linear over the rows of all `weights` (fused qkv, gate_up): a QuantLinear of their
    concatenation where they share a type, else a ConcatLinear of one QuantLinear each."""
    if all(w.qtype == weights[0].qtype for w in weights):
        return QuantLinear(QuantizedWeight.concat(weights), native=native)
    return ConcatLinear([QuantLinear(w, native=native) for w in weights])


def _halves(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte `start` of each block, as float32 [..., 1]."""
    return blocks[..., start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """Bytes [..., n] -> [..., 2 n]: their low nibbles, then their high nibbles."""
    return torch.cat([q & 15, q >> 4], dim=-1)


def dequantize_torch(raw: torch.Tensor, qtype: GGMLQuantizationType, k: int) -> torch.Tensor:
    """float32 [N, K] from raw ggml blocks [N, row bytes], in PyTorch (gguf's dequantizers' arithmetic)."""
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(raw.shape[0], k // block, block_bytes)
    if qtype == GGMLQuantizationType.Q8_0:
        values = _halves(blocks, 0) * blocks[..., 2:].contiguous().view(torch.int8).float()
    elif qtype == GGMLQuantizationType.Q4_0:
        values = _halves(blocks, 0) * (_nibbles(blocks[..., 2:]).float() - 8)
    elif qtype == GGMLQuantizationType.Q4_1:
        values = _halves(blocks, 0) * _nibbles(blocks[..., 4:]).float() + _halves(blocks, 2)
    elif qtype == GGMLQuantizationType.Q4_K:
        packed = blocks[..., 4:16].int()
        low, mins, extra = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
        scales = torch.cat([low & 63, (extra & 15) | ((low >> 6) << 4)], dim=-1).float()
        offsets = torch.cat([mins & 63, (extra >> 4) | ((mins >> 6) << 4)], dim=-1).float()
        # 4 chunks of 32 bytes: sub-block 2c the low nibbles of chunk c, 2c + 1 the high ones
        q = _nibbles(blocks[..., 16:].reshape(*blocks.shape[:2], 4, 32)).reshape(*blocks.shape[:2], 8, 32)
        values = (_halves(blocks, 0)[..., None] * scales[..., None] * q.float()
                  - _halves(blocks, 2)[..., None] * offsets[..., None])
    elif qtype == GGMLQuantizationType.Q6_K:
        ql = _nibbles(blocks[..., :128].reshape(*blocks.shape[:2], 2, 64))  # per half: elements 0-127's low 4 bits
        qh = blocks[..., 128:192].reshape(*blocks.shape[:2], 2, 1, 32)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=raw.device).reshape(4, 1)
        high = ((qh >> shifts) & 3).reshape(*blocks.shape[:2], 2, 128)
        q = ((ql | (high << 4)).to(torch.int8) - 32).reshape(*blocks.shape[:2], 16, 16)
        scales = blocks[..., 192:208].contiguous().view(torch.int8).float()
        values = _halves(blocks, 208)[..., None] * scales[..., None] * q.float()
    else:
        raise ValueError(f"{qtype.name} weights are not served")
    return values.reshape(raw.shape[0], k)
