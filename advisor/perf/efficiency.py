"""What share of a device's datasheet peaks real kernels reach, and what each runtime adds per
step: the parameters the performance model fits to published measurements
(policies/catalog/perf-fit.yaml, written by `servegate advise --calibration --refit`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path

import yaml

from ..hardware import Hardware

FIT = Path(__file__).resolve().parents[2] / "policies" / "catalog" / "perf-fit.yaml"


def device_class(hw: Hardware) -> str:
    """gpu, apple or cpu: the classes whose kernels reach different shares of their peaks."""
    return "gpu" if hw.gpu else "apple" if hw.vendor == "apple" else "cpu"


@dataclass(frozen=True)
class Efficiency:
    """Shares and per-step costs. `runtime` holds each runtime's kernel speed relative to vLLM
    (`speed`, multiplying both shares; on a CPU `compute_speed` apart, for a runtime whose matmuls
    lag its memory-bound kernels, as llama.cpp's quantized prompt processing does), its fixed cost
    per step (`overhead_ms`: scheduling, sampling, launches), per running sequence
    (`per_sequence_us`) and per request before it is queued (`request_ms`: HTTP, chat template,
    tokenizer); `<runtime>@<class>` entries override a runtime on one device class."""
    bandwidth: dict[str, float] = field(default_factory=lambda: {"gpu": 0.8, "apple": 0.75, "cpu": 1.0})
    compute: dict[str, float] = field(default_factory=lambda: {"gpu": 0.5, "apple": 0.5, "cpu": 0.5})
    precision: dict[str, float] = field(default_factory=lambda: {"fp8": 0.8, "fp4": 0.6})
    moe: float = 0.7  # grouped expert GEMMs' share of a dense GEMM's rate (bytes and FLOPs) for wide experts
    moe_width: float = 2048.0  # the expert width (intermediate size) at which that share halves
    attention: float = 0.7  # attention kernels' share of what a GEMM reaches of the same roofline
    layer_us: float = 20.0  # fixed cost per layer per step on a GPU (launches, norms, small kernels)
    moe_layer_us: float = 60.0  # and per MoE layer (routing, permutation, dispatch)
    per_sequence_us: float = 10.0
    runtime: dict[str, dict[str, float]] = field(default_factory=dict)
    residuals: dict[str, list[float]] = field(default_factory=dict)  # regime -> [low, high] ratio measured/estimated

    def of(self, runtime: str, hw: Hardware) -> dict[str, float]:
        """The runtime's speed and overhead on this device class."""
        cls = device_class(hw)
        gpu = cls == "gpu"
        base = {"speed": 1.0, "overhead_ms": 1.0 if gpu else 0.0, "request_ms": 0.0,
                "per_sequence_us": self.per_sequence_us if gpu else 0.0}
        values = base | self.runtime.get(runtime, {}) | self.runtime.get(f"{runtime}@{cls}", {})
        return {"compute_speed": values["speed"]} | values  # matmuls as fast as the rest, unless fitted

    def range_for(self, tags: list[str]) -> tuple[float, float]:
        """The factors (low, high) an estimate in these regimes carries: the widest of their
        calibration ranges (measured / estimated, each source left out of the fit), or the overall one."""
        ranges = [self.residuals[t] for t in tags if t in self.residuals] or [self.residuals.get("all", [1.0, 1.0])]
        return min(r[0] for r in ranges), max(r[1] for r in ranges)

    def parameters(self) -> dict[str, float]:
        """Every fitted value under a flat name (`bandwidth.gpu`, `runtime.sglang.speed`...)."""
        flat = {f"bandwidth.{k}": v for k, v in self.bandwidth.items()}
        flat |= {f"compute.{k}": v for k, v in self.compute.items()}
        flat |= {f"precision.{k}": v for k, v in self.precision.items()}
        flat |= {name: getattr(self, name) for name in SCALARS}
        flat |= {f"runtime.{r}.{k}": v for r, values in self.runtime.items() for k, v in values.items()}
        return flat

    def with_parameters(self, flat: dict[str, float]) -> Efficiency:
        groups: dict = {"bandwidth": dict(self.bandwidth), "compute": dict(self.compute),
                        "precision": dict(self.precision), "runtime": {r: dict(v) for r, v in self.runtime.items()}}
        scalars = {}
        for name, value in flat.items():
            head, _, rest = name.partition(".")
            if head == "runtime":
                runtime, _, key = rest.rpartition(".")
                groups["runtime"].setdefault(runtime, {})[key] = value
            elif rest:
                groups[head][rest] = value
            else:
                scalars[head] = value
        return replace(self, **groups, **scalars)

    def to_dict(self) -> dict:
        return {"bandwidth": self.bandwidth, "compute": self.compute, "precision": self.precision,
                **{name: getattr(self, name) for name in SCALARS}, "runtime": self.runtime,
                "residuals": self.residuals}


SCALARS = ("moe", "moe_width", "attention", "layer_us", "moe_layer_us", "per_sequence_us")


@cache
def fitted() -> Efficiency:
    """The committed fit, or the priors where none is committed yet."""
    if not FIT.exists():
        return Efficiency()
    data = yaml.safe_load(FIT.read_text()) or {}
    return Efficiency(**{k: v for k, v in data.items() if k in Efficiency.__dataclass_fields__})
