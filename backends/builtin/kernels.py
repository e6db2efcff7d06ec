"""The native paged-attention kernel, compiled on first use with `torch.utils.cpp_extension`.

The build (about a minute, once per machine: torch caches it under ~/.cache/torch_extensions)
needs a C++ compiler. Where it fails, `available()` says no, the reason is logged, and the
engine keeps to the pure-PyTorch path.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

log = logging.getLogger("servegate.kernels")
SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
_lock = threading.Lock()
_module = None
_failed: str | None = None


def _load():
    global _module, _failed
    with _lock:
        if _module is None and _failed is None:
            try:
                from torch.utils.cpp_extension import load

                # -fopenmp: at::parallel_for is inline and runs serially in code built without it.
                _module = load("servegate_paged_attention", [str(SOURCE)], extra_cflags=["-O3", "-march=native",
                               "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
            except Exception as exc:  # no compiler, no ninja, a failed build...
                _failed = f"{type(exc).__name__}: {exc}"
                log.warning("native paged attention unavailable, using the PyTorch path: %s", _failed)
    return _module


def available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel serves this device, cache dtype and head size."""
    served = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int8)
    return served and head_dim in (64, 128) and _load() is not None


def paged_attention(q: torch.Tensor, kv, block_tables: torch.Tensor, positions: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """q: [t, H, D]; kv: a `LayerKV`; one block table and position per token."""
    scales = kv.scales if kv.scales is not None else torch.empty(0)
    out = _load().paged_attention(q.float().contiguous(), kv.data[0], kv.data[1], scales, block_tables, positions,
                                  scale)
    return out.to(q.dtype)
