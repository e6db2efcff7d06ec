"""Linear layers on GGUF blocks (`backends/builtin/worker/quant.py`, `csrc/quant_linear.cpp`) against
gguf's own dequantizers.

Weights: Q8_0, Q4_0, Q4_1 quantized by `gguf.quants.quantize`; Q4_K and Q6_K (which gguf does not
quantize) random blocks with sane fp16 scales. The reference is gguf's dequantized weight times x
(as given, float32 or bf16) in float64. Three paths: the integer kernels (x quantized to int8 per
block: an error of at most half a step, max |x of the block| / 254, per element), the bf16 one a
batch's or a prompt's rows take from 16 where AVX512-BF16 is built (weights rounded to bf16: the native
bf16 tiles up to 31 rows, oneDNN's GEMM from 32), and the PyTorch fallback.

Max errors measured on an AMD EPYC Zen 4 (AVX512-VNNI, AVX512-BF16), over M in ROWS, N 40 and 48, and
the Ks below, relative to the largest |reference| output (absolute: the weights' scales set them; Q8_0,
Q4_0, Q4_1 outputs reach about 90, the random K-quant blocks' several hundred):
    native, float32 x (integer kernels): Q8_0 6.9e-3 (abs 0.87), Q4_0 6.7e-3 (0.84), Q4_1 6.7e-3 (0.89),
        Q4_K 9.4e-3 (5.3), Q6_K 9.9e-3 (23)
    native, bf16 x (integer kernels below 16 rows, bf16 GEMMs from 16; output bf16): Q8_0 8.7e-3,
        Q4_0 8.0e-3, Q4_1 8.4e-3, Q4_K 1.0e-2, Q6_K 1.1e-2
    PyTorch fallback: float32 at most 7.4e-7, bf16 4.3e-3 (its weight and output rounded to bf16)
and every output within the bound its path guarantees (`allowed`): a swapped nibble order, halves of
a block, d and m, or a neighbour's scale puts 30 to 99% of the outputs over it. The integer kernels
also equal their own arithmetic (x quantized as they do it, the rest in float64) to float32
rounding, which pins every nibble and scale (a swap of two Q4_K mins among them).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from backends.builtin.worker import kernels
from backends.builtin.worker.quant import (
    ConcatLinear,
    QuantizedWeight,
    QuantLinear,
    dequantize_torch,
    fused_linear,
)

Q = GGMLQuantizationType
TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K]
K_QUANTS = (Q.Q4_K, Q.Q6_K)
ROWS = (1, 3, 8, 20, 33, 100)  # bf16 x: the integer kernels (below 16), the native bf16 tiles (16-31), oneDNN
N = 40  # not a whole number of the kernels' 16-row tiles (bf16 x from 16 rows then takes oneDNN's GEMM)
TILED = 48  # a whole number of them (bf16 x from 16 rows takes the native bf16 tiles)


def columns(qtype) -> tuple[int, ...]:
    """96: an odd number of 32-element blocks; 576: SmolLM2's hidden size (no whole number of 256s)."""
    return (256, 1536) if qtype in K_QUANTS else (96, 576, 1536)


def random_weight(qtype, n: int, k: int, seed: int = 0) -> QuantizedWeight:
    rng = np.random.default_rng(seed)
    if qtype not in K_QUANTS:
        return QuantizedWeight.from_float(torch.from_numpy(rng.standard_normal((n, k), dtype=np.float32)), qtype)
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // block, block_bytes), dtype=np.uint8)
    for offset in (0, 2) if qtype == Q.Q4_K else (208,):  # d (and Q4_K's dmin)
        raw[..., offset:offset + 2] = rng.uniform(2e-3, 2e-2, (n, k // block, 1)).astype(np.float16).view(np.uint8)
    return QuantizedWeight(qtype, (n, k), torch.from_numpy(raw.reshape(n, -1)))


def reference(weight: QuantizedWeight) -> np.ndarray:
    return dequantize(weight.raw.numpy(), weight.qtype).reshape(weight.shape).astype(np.float64)


def native():
    ops = kernels.load()
    assert ops is not None, kernels._failed
    return ops


def integer_path(x: torch.Tensor) -> bool:
    """Whether the native kernel runs x through its integer kernels (else dequantized, its bf16 GEMM)."""
    rows = kernels.load().quant_linear_dequantized_rows()
    return not (x.dtype == torch.bfloat16 and rows and len(x) >= rows)


def quantized_rows(x: np.ndarray, block: int) -> np.ndarray:
    """x's rows as the integer kernels quantize them (float32 arithmetic, round half to even), in float64."""
    m, k = x.shape
    blocks = x.reshape(m, k // block, block).astype(np.float32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    inverse = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    return (np.rint(blocks * inverse) * (amax / np.float32(127))).astype(np.float64).reshape(m, k)


def allowed(x: np.ndarray, w: np.ndarray, qtype, integer: bool, dtype: torch.dtype) -> np.ndarray:
    """The error each output may have: bf16 rounding (of the weights on the bf16 paths, of the output,
    2^-9 each, with room for the sums' order) or float32 sums, and on the integer kernels x's int8
    rounding: half a step (max |x| of the block / 127) per element, times |w|."""
    bound = np.abs(x) @ np.abs(w).T * (2.0**-7 if dtype == torch.bfloat16 else 1e-5)
    if integer:
        block = GGML_QUANT_SIZES[qtype][0] if qtype not in K_QUANTS else 256
        m, k = x.shape
        steps = np.repeat(np.abs(x.reshape(m, k // block, block)).max(-1) / 254, block, axis=1)
        bound = bound + steps @ np.abs(w).T
    return bound * 1.001 + 1e-6


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantizers_equal_ggufs(qtype):
    for k in columns(qtype):
        weight = random_weight(qtype, N, k)
        expected = reference(weight).astype(np.float32)
        assert np.array_equal(weight.dequantize().numpy(), expected)  # native
        assert np.array_equal(dequantize_torch(weight.raw, qtype, k).numpy(), expected)
        rows = torch.tensor([[3, 0], [39, 3]])
        assert np.array_equal(weight.dequantize(rows).numpy(), expected[rows.numpy()])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_integer_kernels_equal_their_arithmetic(qtype):
    """x quantized as the kernels do it, the rest exact: any misread nibble, bit or scale shows."""
    ops = native()
    block = 256 if qtype in K_QUANTS else 32
    rng = np.random.default_rng(1)
    for k in columns(qtype):
        weight = random_weight(qtype, N, k)
        w = reference(weight)
        for m in (1, 2, 5, 8, 9, 17):
            x = rng.standard_normal((m, k), dtype=np.float32)
            expected = quantized_rows(x, block) @ w.T
            y = ops.quant_linear(torch.from_numpy(x), weight.raw, int(qtype)).double().numpy()
            scale = np.abs(quantized_rows(x, block)) @ np.abs(w).T
            assert (np.abs(y - expected) <= scale * 1e-6 + 1e-6).all(), (k, m, np.abs(y - expected).max())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_bf16_tiles_are_the_weights_rounded(qtype):
    """From the rows where bf16 x multiplies the weight dequantized to bf16, one-hot rows of x give
    the weight itself, each value gguf's rounded to bf16: on the native tiles (their layout) and on
    oneDNN's GEMM."""
    rows = native().quant_linear_dequantized_rows()
    if not rows:
        pytest.skip("this build has no bf16 path (no AVX512-BF16)")
    for n in (N, TILED):
        for k in columns(qtype):
            weight = random_weight(qtype, n, k)
            expected = torch.from_numpy(reference(weight).astype(np.float32)).to(torch.bfloat16).T
            for chunk in (rows, 20, 32):  # calls of that many rows: the tiles' (below 32) or oneDNN's
                eye = torch.eye(-(-k // chunk) * chunk, k, dtype=torch.bfloat16)  # rows past k: zeros
                y = torch.cat([native().quant_linear(part, weight.raw, int(qtype)) for part in eye.split(chunk)])
                assert torch.equal(y[:k], expected), (n, k, chunk)


@pytest.mark.parametrize("native_path", [True, False], ids=["native", "pytorch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_quant_linear_within_its_rounding(qtype, dtype, native_path):
    if native_path:
        native()
    rng = np.random.default_rng(2)
    worst_abs = worst = 0.0
    for n, k in [(n, k) for n in (N, TILED) for k in columns(qtype)]:
        weight = random_weight(qtype, n, k)
        layer = QuantLinear(weight, native=native_path)
        w = reference(weight)
        for m in ROWS:
            x = torch.from_numpy(rng.standard_normal((m, k), dtype=np.float32)).to(dtype)
            y = layer(x)
            assert y.dtype == dtype and y.shape == (m, n)
            x64 = x.double().numpy()
            expected = x64 @ w.T
            error = np.abs(y.double().numpy() - expected)
            integer = native_path and integer_path(x)
            assert (error <= allowed(x64, w, qtype, integer, dtype)).all(), (k, m, error.max())
            worst_abs, worst = max(worst_abs, error.max()), max(worst, error.max() / np.abs(expected).max())
    print(f"{qtype.name} {dtype} {'native' if native_path else 'pytorch'}: max error {worst_abs:.1e}, "
          f"{worst:.1e} of max |y|")


def test_weights_read_from_a_gguf_file(tmp_path):
    """A GGUF tensor's blocks as they are, its shape in PyTorch's order (ggml lists it innermost first)."""
    from gguf import GGUFReader, GGUFWriter

    written = {"blk.0.attn_q.weight": random_weight(Q.Q4_1, 64, 96),
               "blk.0.ffn_down.weight": random_weight(Q.Q6_K, 24, 512)}
    writer = GGUFWriter(tmp_path / "model.gguf", "llama")
    for name, weight in written.items():
        writer.add_tensor(name, weight.raw.numpy(), raw_dtype=weight.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for tensor in GGUFReader(tmp_path / "model.gguf").tensors:
        weight = QuantizedWeight.from_gguf(tensor)
        assert (weight.qtype, weight.shape) == (written[tensor.name].qtype, written[tensor.name].shape)
        assert torch.equal(weight.raw, written[tensor.name].raw)
        assert np.array_equal(weight.dequantize().numpy(),
                              dequantize(tensor.data, tensor.tensor_type).reshape(weight.shape))
    with pytest.raises(ValueError, match="Q5_0"):
        QuantizedWeight(Q.Q5_0, (2, 32), torch.zeros(2, 22, dtype=torch.uint8))


def test_permuted_rows_undo_llama_cpps_order():
    """Q/K rows: moving whole quantized rows equals the loader's unpermute of the dequantized weight."""
    from backends.builtin.worker.gguf_weights import unpermute, unpermuted_rows

    heads, rows = 4, 64
    weight = random_weight(Q.Q4_0, rows, 96)
    order = unpermuted_rows(rows, heads)
    assert torch.equal(weight.permute_rows(order).dequantize(), unpermute(weight.dequantize(), heads))


def test_fused_projections():
    """One type: one QuantLinear over every part's rows; types that differ (a Q4_K_M file mixes Q4_K
    and Q6_K): one each, their outputs concatenated. Either way each part's own outputs."""
    native()
    x = torch.randn(3, 256)
    same = [random_weight(Q.Q4_K, n, 256, seed) for seed, n in enumerate((48, 16, 16))]
    mixed = [same[0], random_weight(Q.Q6_K, 16, 256, 3), same[2]]
    for parts, kind in ((same, QuantLinear), (mixed, ConcatLinear)):
        fused = fused_linear(parts)
        assert isinstance(fused, kind) and (fused.in_features, fused.out_features) == (256, 80)
        assert fused.bytes == sum(w.bytes for w in parts)
        assert torch.equal(fused(x), torch.cat([QuantLinear(w)(x) for w in parts], dim=-1))
    with pytest.raises(ValueError, match="one type"):
        QuantizedWeight.concat(mixed)


@pytest.mark.parametrize("native_path", [True, False], ids=["native", "pytorch"])
def test_bias_and_leading_dimensions(native_path):
    if native_path:
        native()
    weight, bias = random_weight(Q.Q8_0, N, 96), torch.randn(N)
    layer = QuantLinear(weight, bias, native=native_path)
    assert layer.bytes == weight.bytes + 4 * N
    x = torch.randn(2, 5, 96)
    y = layer(x)
    assert y.shape == (2, 5, N)
    x64, w = x.reshape(10, 96).double().numpy(), reference(weight)
    error = np.abs(y.reshape(10, N).double().numpy() - (x64 @ w.T + bias.double().numpy()))
    assert (error <= allowed(x64, w, Q.Q8_0, native_path, torch.float32)).all()
    # dtypes the kernel does not take run on the PyTorch path
    exact = layer(x.double())
    assert exact.dtype == torch.float64
    assert np.allclose(exact.reshape(10, N).numpy(), x64 @ w.T + bias.double().numpy(), rtol=1e-6, atol=1e-5)
