"""The native bf16 GEMM (`csrc/bf16_linear.cpp`) against oneDNN's on prepacked weights, on the
default model's Linear shapes (30 layers of q/k/v, o, gate/up and down projections, and the LM
head), each with its own weights so that they stream from memory as in a decode step.

Usage: python benchmarks/bf16_linear.py [ROWS ...]   (default: 1 4 8 16 24 64 544 2016)
Prints, per row count, the best of three rounds of every shape, for both GEMMs.
"""

from __future__ import annotations

import sys
import time

import torch

from backends.builtin.worker import kernels
from backends.builtin.worker.model_runner import PackedLinear, PairedLinear

SHAPES = [(960, 576, 30), (576, 576, 30), (3072, 576, 30), (576, 1536, 30), (49152, 576, 1)]  # (N, K, layers)


def best_ms(modules, x: torch.Tensor) -> float:
    best = float("inf")
    for _ in range(3):
        for m in modules:
            m(x)
        start = time.perf_counter()
        for m in modules:
            m(x)
        best = min(best, time.perf_counter() - start)
    return best * 1000


@torch.inference_mode()
def main() -> None:
    ops = kernels.load()
    if ops is None or not ops.bf16_linear_native():
        sys.exit("the native bf16 GEMM needs AVX512-BF16, which this CPU lacks")
    rows = [int(a) for a in sys.argv[1:]] or [1, 4, 8, 16, 24, 64, 544, 2016]
    torch.manual_seed(0)
    linears = {(n, k): [torch.nn.Linear(k, n, bias=False).bfloat16() for _ in range(layers)]
               for n, k, layers in SHAPES}
    packed = {shape: [PackedLinear(lin) for lin in lins] for shape, lins in linears.items()}
    paired = {shape: [PairedLinear(lin, ops) for lin in lins] for shape, lins in linears.items()}
    print(f"{'rows':>5} {'oneDNN ms':>10} {'native ms':>10} {'ratio':>6}")
    for m in rows:
        onednn = native = 0.0
        for n, k, _ in SHAPES:
            x = torch.randn(m, k).bfloat16()
            onednn += best_ms(packed[n, k], x)
            native += best_ms(paired[n, k], x)
        print(f"{m:>5} {onednn:>10.1f} {native:>10.1f} {onednn / native:>5.2f}x")


if __name__ == "__main__":
    main()
