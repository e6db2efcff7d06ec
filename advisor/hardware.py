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
ROW_WIDTH = 4096  # `local`'s matrix rows when the model's hidden size is unknown


class UnknownHardware(ValueError):
    """Not a catalogue id; the message names the nearest ones."""


@dataclass(frozen=True)
class Hardware:
    id: str
    name: str
    vendor: str  # nvidia, amd, intel, google, huawei, apple, cpu
    family: str  # the matrices' hardware column
    memory_gib: float
    bandwidth_gbs: float
    bf16_tflops: float | None = None
    fp8_tflops: float | None = None
    fp4_tflops: float | None = None  # dense FP4 (NVFP4/MXFP4) tensor-core peak, where the device has one
    compute_capability: str | None = None
    interconnect: str = ""
    link_gbs: float | None = None  # to peers, one direction, GB/s: what tensor-parallel all-reduces move over
    source: str = ""
    link_source: str = ""
    flops_source: str = ""  # where the FLOPS figures come from, when not from `source`
    note: str = ""
    measured: bool = False  # figures read off this machine, not a datasheet

    @property
    def gpu(self) -> bool:
        return self.vendor in ("nvidia", "amd", "intel", "google", "huawei") and not self.family.startswith("cpu")

    @property
    def usable_share(self) -> float:
        """The share of memory a process may fill: VRAM 0.92, Apple unified memory 0.75 (the
        macOS GPU wired limit), system RAM 0.80 (tools.metakraftlabs.com's defaults)."""
        return 0.75 if self.vendor == "apple" else 0.92 if self.gpu else 0.80


@cache
def catalogue() -> dict[str, Hardware]:
    data = yaml.safe_load(CATALOG.read_text())
    refs = {key: source["ref"] for key, source in data["sources"].items()}
    return {key: Hardware(id=key, **{**entry, "source": refs[entry["source"]],
                                     "link_source": refs[entry.get("link_source", entry["source"])],
                                     "flops_source": refs[entry.get("flops_source", entry["source"])]})
            for key, entry in data["devices"].items()}


def resolve(hardware: str, row_width: int = 0) -> Hardware:
    """A catalogue device, or `local` measured with matrix rows `row_width` wide (the model's hidden size)."""
    if hardware == "local":
        return local(row_width or ROW_WIDTH)
    devices = catalogue()
    if hardware.lower() in devices:
        return devices[hardware.lower()]
    near = difflib.get_close_matches(hardware.lower(), list(devices), n=3, cutoff=0.3)
    raise UnknownHardware(f"unknown hardware {hardware!r}" + (f"; did you mean {', '.join(near)}?" if near else "")
                          + " (`servegate advise --list-hardware` lists them all, plus `local`)")


@cache
def local(row_width: int = ROW_WIDTH) -> Hardware:
    """This machine's CPU. Memory from the OS. Bandwidth as decode sees it: matrix-vector products
    over 256 MiB of float32 matrices (far beyond the caches) whose rows are `row_width` wide, the
    model's hidden size, because a CPU's matrix-vector kernel streams short rows at as little as
    half the rate of long ones. FLOPS from a float32 matmul. Both across the threads PyTorch uses,
    best of a few runs. The bandwidth is what a real kernel reached, so the advisor does not derate it."""
    import torch

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    rows = max(1, 2**22 // row_width)  # 16 MiB matrices, layer-sized
    matrices = [torch.randn(rows, row_width) for _ in range(max(1, 2**28 // (rows * row_width * 4)))]
    vector = torch.randn(row_width)
    matvec = _best(lambda: [torch.mv(m, vector) for m in matrices])
    a = torch.randn(1024, 1024)
    matmul = _best(lambda: torch.mm(a, a))
    family = "cpu-arm" if platform.machine().lower() in ("arm64", "aarch64") else "cpu-x86"
    return Hardware(id="local", name=f"this machine ({os.cpu_count()} CPUs, measured)", vendor="cpu", family=family,
                    memory_gib=memory / 2**30, bandwidth_gbs=sum(m.nbytes for m in matrices) / matvec / 1e9,
                    bf16_tflops=2 * 1024**3 / matmul / 1e12, measured=True,
                    source=f"measured: float32 matrix-vector products with {row_width}-wide rows, float32 matmul")


def _best(work, runs: int = 5) -> float:
    work()  # warm up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)
