"""Devices the advisor knows (policies/catalog/hardware.yaml), and `local`: this machine's CPU,
measured rather than looked up."""

from __future__ import annotations

import difflib
import os
import platform
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

CATALOG = Path(__file__).resolve().parent.parent / "policies" / "catalog" / "hardware.yaml"


class UnknownHardware(ValueError):
    """Not a catalogue id; the message names the nearest ones."""


@dataclass(frozen=True)
class Hardware:
    id: str
    name: str
    vendor: str  # nvidia, amd, intel, apple, cpu
    family: str  # the matrices' hardware column
    memory_gib: float
    bandwidth_gbs: float
    bf16_tflops: float | None = None
    fp8_tflops: float | None = None
    compute_capability: str | None = None
    interconnect: str = ""
    source: str = ""
    note: str = ""

    @property
    def gpu(self) -> bool:
        return self.vendor in ("nvidia", "amd", "intel") and not self.family.startswith("cpu")

    @property
    def usable_share(self) -> float:
        """The share of memory a process may fill: VRAM 0.92, Apple unified memory 0.75 (the
        macOS GPU wired limit), system RAM 0.80 (tools.metakraftlabs.com's defaults)."""
        return 0.75 if self.vendor == "apple" else 0.92 if self.gpu else 0.80


@cache
def catalogue() -> dict[str, Hardware]:
    data = yaml.safe_load(CATALOG.read_text())
    return {key: Hardware(id=key, **{**entry, "source": data["sources"][entry["source"]]["ref"]})
            for key, entry in data["devices"].items()}


def resolve(hardware: str) -> Hardware:
    if hardware == "local":
        return local()
    devices = catalogue()
    if hardware.lower() in devices:
        return devices[hardware.lower()]
    near = difflib.get_close_matches(hardware.lower(), list(devices), n=3, cutoff=0.3)
    raise UnknownHardware(f"unknown hardware {hardware!r}" + (f"; did you mean {', '.join(near)}?" if near else "")
                          + " (`servegate advise --list-hardware` lists them all, plus `local`)")


@cache
def local() -> Hardware:
    """This machine's CPU: memory from the OS; bandwidth as decode sees it, from a matrix-vector
    product over a 256 MiB float32 matrix (far beyond the caches); FLOPS from a float32 matmul;
    both across the threads PyTorch uses, best of a few runs."""
    import torch

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    weights, vector = torch.randn(8192, 8192), torch.randn(8192)
    matvec = _best(lambda: torch.mv(weights, vector))
    a = torch.randn(1024, 1024)
    matmul = _best(lambda: torch.mm(a, a))
    family = "cpu-arm" if platform.machine().lower() in ("arm64", "aarch64") else "cpu-x86"
    return Hardware(id="local", name=f"this machine ({os.cpu_count()} CPUs, measured)", vendor="cpu", family=family,
                    memory_gib=memory / 2**30, bandwidth_gbs=weights.nbytes / matvec / 1e9,
                    bf16_tflops=2 * 1024**3 / matmul / 1e12, source="measured: float32 matrix-vector and matmul")


def _best(work, runs: int = 5) -> float:
    work()  # warm up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)
