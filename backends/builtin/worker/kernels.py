"""The native CPU kernels, compiled on first use with `torch.utils.cpp_extension`: attention over
the paged KV cache, of decode tokens (`csrc/paged_attention.cpp`) and of prompt chunks
(`csrc/chunk_attention.cpp`, built with AVX-512 only), a decoder layer's element-wise work
(`csrc/layer_ops.cpp`: residual add + RMSNorm, rotary embedding, SiLU-and-multiply), and bf16
Linear layers for CPUs with AVX512-BF16 but no AMX (`csrc/bf16_linear.cpp`), LoRA adapters
applied per token (`csrc/lora.cpp`), and Linear layers on GGUF-quantized weights as they are
(`csrc/quant_linear.cpp`, used by `quant.QuantLinear`).

The build (a minute or more, once per machine: torch caches it under
~/.cache/torch_extensions, under a name that carries the CPU's feature flags, since it is built
for `-march=native`) needs a C++ compiler; its progress is logged every 10 s. Where it fails,
`available()` says no, the reason is logged, and the engine keeps to the pure-PyTorch path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import time
from pathlib import Path

import torch

from backends.cpu import bf16_native, cpu_flags

log = logging.getLogger("servegate.kernels")
CSRC = Path(__file__).parent / "csrc"
SOURCES = [str(CSRC / name) for name in
           ("paged_attention.cpp", "chunk_attention.cpp", "layer_ops.cpp", "bf16_linear.cpp", "lora.cpp",
                             "quant_linear.cpp", "decode_layers.cpp", "module.cpp")]
_lock = threading.Lock()
_module = None
_failed: str | None = None


def load():
    """The native kernels' module, built on first use (once per CPU and source; minutes on 2
    cores), or None where they cannot be built (the PyTorch path runs instead)."""
    global _module, _failed
    if _module is not None:  # built already: the per-call path takes no lock
        return _module
    with _lock:
        if _module is None and _failed is None:
            started, done = time.monotonic(), threading.Event()
            threading.Thread(target=_report_progress, args=(started, done), daemon=True).start()
            try:
                from torch.utils.cpp_extension import load as build

                # the name carries the CPU's flags and every source's text (torch rebuilds on a changed
                # source, but not on a changed header), and where they lie (it rebuilds when they move:
                # two checkouts would take turns rebuilding one build)
                sources = "".join(p.read_text() for p in sorted(CSRC.iterdir()))
                built = " ".join([str(CSRC), *sorted(cpu_flags())]) + sources
                machine = hashlib.sha256(built.encode()).hexdigest()[:12]
                # -fopenmp: at::parallel_for is inline and runs serially in code built without it.
                _module = build(f"servegate_cpu_kernels_{machine}", SOURCES,
                                extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                                verbose=False)
            except Exception as exc:  # no compiler, no ninja, a failed build...
                _failed = f"{type(exc).__name__}: {exc}"
                log.warning("native CPU kernels unavailable, using the PyTorch path: %s", _failed)
            finally:
                done.set()
            if _module is not None and time.monotonic() - started > 5:
                log.info("native CPU kernels compiled in %.0f s", time.monotonic() - started)
    return _module


def _report_progress(started: float, done: threading.Event) -> None:
    while not done.wait(10):
        log.info("compiling the native CPU kernels: %.0f s so far (once per machine, about 80 s; "
                 "needs a C++ compiler)", time.monotonic() - started)


def available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel serves this device, cache dtype and head size."""
    served = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int8)
    return served and head_dim in (64, 128) and load() is not None


def _attend(kernel, q: torch.Tensor, kv, *indices) -> torch.Tensor:
    """Both attention kernels take a float32 query (but the chunk kernel on AMX tiles, below), the
    layer's K and V caches and their int8 scales (empty for other caches); they answer in float32,
    returned here in the query's dtype."""
    scales = kv.scales if kv.scales is not None else torch.empty(0)
    return kernel(q.float().contiguous(), kv.data[0], kv.data[1], scales, *indices).to(q.dtype)


def paged_attention(q: torch.Tensor, kv, block_tables: torch.Tensor, positions: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """q: [t, H, D]; kv: a `LayerKV`; one block table and position per token."""
    return _attend(load().paged_attention, q, kv, block_tables, positions, scale)


def chunk_kernel_serves(dtype: torch.dtype) -> bool:
    """Whether prompt chunks of this cache dtype go to the chunk kernel rather than to SDPA over
    their gathered context. The kernel is built where AVX-512 is (on AVX2 SDPA's GEMMs are faster
    than a portable form of it). bf16 chunks on a CPU with working AMX take its AMX tiles
    (`chunk_amx`) where they are built, else SDPA, whose GEMMs run on AMX tiles too, faster there
    than the kernel's VDPBF16PS pairs (which serve bf16 wherever AVX512-BF16 runs without AMX,
    faster than the float32 FMAs)."""
    module = load()
    if module is None or not module.chunk_attention_native():
        return False
    return chunk_amx(dtype) or not (dtype == torch.bfloat16 and bf16_native() == "AMX-BF16")


@functools.cache
def chunk_amx(dtype: torch.dtype) -> bool:
    """Whether the chunk kernel multiplies on AMX tiles: a bf16 cache, on a CPU whose tile state
    runs (`bf16_native` probes it: a CPU may report AMX that its hypervisor does not grant). Asked
    once per layer and step, so answered once."""
    return dtype == torch.bfloat16 and bf16_native() == "AMX-BF16" and load().chunk_attention_amx()


def chunk_attention(q: torch.Tensor, kv, block_tables: torch.Tensor, query_starts: torch.Tensor,
                    context_lens: torch.Tensor, scale: float, amx: bool | None = None) -> torch.Tensor:
    """q: [t, H, D], the chunks' tokens one chunk after another; one block table, start and
    context length per chunk (`query_starts` has one more: the end). amx: on AMX tiles (default:
    `chunk_amx`), or not, to compare the two."""
    amx = chunk_amx(kv.data.dtype) if amx is None else amx
    if not amx:
        return _attend(load().chunk_attention, q, kv, block_tables, query_starts, context_lens, scale, False)
    # on AMX tiles the query and the output are bf16 (a bf16 model's as they are), not float32
    out = load().chunk_attention(q.to(torch.bfloat16).contiguous(), kv.data[0], kv.data[1], torch.empty(0),
                                 block_tables, query_starts, context_lens, scale, True)
    return out.to(q.dtype)


def layer_ops(device: torch.device, dtype: torch.dtype):
    """The fused element-wise ops where they serve (float32 and bf16 on the CPU), else None."""
    return load() if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) else None


def bf16_linear(device: torch.device, dtype: torch.dtype):
    """The native bf16 GEMM where it serves: bf16 on a CPU whose bf16 multiply is AVX512-BF16
    (where AMX runs, oneDNN's tiles are faster), else None."""
    if device.type != "cpu" or dtype != torch.bfloat16 or bf16_native() != "AVX512-BF16":
        return None
    module = load()
    return module if module is not None and module.bf16_linear_native() else None
