"""GGUF-quantized Linear layers (`QuantLinear`, `csrc/quant_linear.cpp`) against the float32 and bf16
GEMMs the engine runs otherwise (oneDNN's prepacked float32, the native bf16 one where AVX512-BF16
serves it, else oneDNN's), on the default model's Linear shapes, at a decode step's one row.

Each shape and kind has as many weights of its own as fill twice the last-level cache, called in
turn, so that they stream from memory as a decode step's do (the default model's weights do not
fit in cache). Prints ms per call (see `ms_per_call`) and, for the quantized types, the GB/s of
weight bytes that makes; K-quants need K % 256 == 0 (not the hidden size 576).

Usage: python benchmarks/quant_linear.py [ROWS [THREADS]]   (default: 1 row, PyTorch's threads)
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from backends.builtin.worker import kernels
from backends.builtin.worker.model_runner import PackedLinear, PairedLinear
from backends.builtin.worker.quant import QuantizedWeight, QuantLinear

CALLS = 500
SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576)]  # (N, K)
TYPES = [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
         GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K]


def ms_per_call(modules, x: torch.Tensor) -> float:
    """The 10th percentile of CALLS single calls' times (after a round to warm up): other work on a
    shared machine only ever slows a call, and a percentile stays clear of the odd lucky one."""
    for m in modules:
        m(x)
    times = []
    for _ in range(math.ceil(CALLS / len(modules))):
        for m in modules:
            start = time.perf_counter()
            m(x)
            times.append(time.perf_counter() - start)
    return statistics.quantiles(times, n=10)[0] * 1000


def last_level_cache() -> int:
    try:
        size = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        return int(size.rstrip("K")) * 1024 if size.endswith("K") else int(size)
    except (OSError, ValueError):
        return 32 << 20


def copies(module_bytes: int) -> int:
    """Weights enough to fill twice the last-level cache."""
    return max(2, math.ceil(2 * last_level_cache() / module_bytes))


def quantized(weight: torch.Tensor, qtype: GGMLQuantizationType) -> QuantizedWeight:
    """gguf's quantization where it has one; K-quants: random blocks with small fp16 scales."""
    if qtype not in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K):
        return QuantizedWeight.from_float(weight, qtype)
    n, k = weight.shape
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = torch.randint(0, 256, (n, k // block, block_bytes), dtype=torch.uint8)
    scale = torch.tensor([1e-3], dtype=torch.float16).view(torch.uint8)
    for offset in ((0, 2) if qtype == GGMLQuantizationType.Q4_K else (208,)):
        raw[..., offset:offset + 2] = scale
    return QuantizedWeight(qtype, (n, k), raw.reshape(n, -1))


@torch.inference_mode()
def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    if len(sys.argv) > 2:
        torch.set_num_threads(int(sys.argv[2]))
    ops = kernels.load()
    if ops is None:
        sys.exit(f"the native kernels did not build: {kernels._failed}")
    gemm = kernels.bf16_linear(torch.device("cpu"), torch.bfloat16)
    print(f"quant_linear: {ops.quant_linear_isa()}; bf16: {'native' if gemm else 'oneDNN'}; "
          f"{torch.get_num_threads()} threads; rows {rows}")
    print(f"{'N x K':>12} {'f32':>7} {'bf16':>7}" + "".join(f" {t.name:>13}" for t in TYPES))
    torch.manual_seed(0)
    for n, k in SHAPES:
        linear = torch.nn.Linear(k, n, bias=False)
        x = torch.randn(rows, k)
        f32 = ms_per_call([PackedLinear(linear) for _ in range(copies(n * k * 4))], x)
        half = linear.bfloat16()
        bf16 = ms_per_call([PairedLinear(half, gemm) if gemm else PackedLinear(half) for _ in range(copies(n * k * 2))],
                       x.bfloat16())
        cells = []
        for qtype in TYPES:
            if k % GGML_QUANT_SIZES[qtype][0]:
                cells.append(f"{'-':>13}")
                continue
            weight = quantized(linear.weight.float(), qtype)
            layers = [QuantLinear(QuantizedWeight(qtype, weight.shape, weight.raw.clone()))
                      for _ in range(copies(weight.bytes))]
            ms = ms_per_call(layers, x)
            cells.append(f" {ms:6.3f} {weight.bytes / ms / 1e6:3.0f}GB/s")
        print(f"{n:>6} x {k:<4} {f32:7.3f} {bf16:7.3f}" + "".join(cells))
    print("ms per call; GB/s: quantized weight bytes read per second")


if __name__ == "__main__":
    main()
