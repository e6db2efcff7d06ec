"""Fitting the efficiencies to the calibration points: a coordinate search over each parameter
(within bounds that keep it physical), minimising the mean absolute log error plus a penalty on
any point off by more than a factor of 1.8, re-estimating only the points a parameter touches."""

from __future__ import annotations

import math

from ..hardware import resolve as resolve_hardware
from .calibration import Point, error
from .efficiency import Efficiency, device_class
from .steps import LOW_PRECISION

# name: (low, high). Shares of a peak stay within what kernels reach; costs stay non-negative.
BOUNDS = {
    "bandwidth.gpu": (0.4, 1.0), "bandwidth.apple": (0.3, 1.0), "bandwidth.cpu": (0.2, 1.5),
    "compute.gpu": (0.15, 0.9), "compute.apple": (0.15, 1.0), "compute.cpu": (0.05, 3.0),
    "precision.fp8": (0.3, 1.0), "precision.fp4": (0.2, 1.0), "moe": (0.15, 1.0), "attention": (0.15, 1.0),
    "layer_us": (0.0, 300.0), "moe_layer_us": (0.0, 600.0), "per_sequence_us": (0.0, 60.0),
}
RUNTIME_SPEED = (0.4, 1.6)
RUNTIME_OVERHEAD_MS = (0.0, 40.0)
OUTLIER = math.log(1.8)


def parameters(chosen: tuple[Point, ...]) -> dict[str, tuple[float, float]]:
    """What the points can inform: the global shares, and a speed and per-step overhead for each
    runtime on each device class it was measured on (vLLM on GPUs is the reference speed)."""
    out = dict(BOUNDS)
    for p in chosen:
        cls = device_class(resolve_hardware(p.hardware))
        key = p.runtime if cls == "gpu" else f"{p.runtime}@{cls}"
        if key != "vllm" and cls != "apple":
            out[f"runtime.{key}.speed"] = RUNTIME_SPEED
        if cls != "apple":
            out[f"runtime.{key}.overhead_ms"] = RUNTIME_OVERHEAD_MS
    return out


def touches(name: str, p: Point) -> bool:
    hw = resolve_hardware(p.hardware)
    cls = device_class(hw)
    head, _, rest = name.partition(".")
    if head in ("bandwidth", "compute"):
        return rest == cls
    if head == "precision":
        return cls == "gpu" and LOW_PRECISION.get(p.weights.lower()) == rest
    if head == "runtime":
        runtime = rest.rpartition(".")[0]
        return runtime == (p.runtime if cls == "gpu" else f"{p.runtime}@{cls}") or runtime == p.runtime
    if name in ("moe", "moe_layer_us"):
        return "moe" in p.regimes
    return cls == "gpu" or name == "attention"  # layer_us, per_sequence_us on GPUs; attention everywhere


def loss_of(errors: list[float]) -> float:
    capped = [min(e, math.log(10)) for e in errors]  # a point that does not fit counts as 10x off
    return sum(e + 4 * max(0.0, e - OUTLIER) ** 2 for e in capped) / max(1, len(capped))


def fit(chosen: tuple[Point, ...], start: Efficiency, rounds: int = 4, step: float = 1.5) -> Efficiency:
    names = parameters(chosen)
    values = {**{n: start.parameters().get(n, _prior(n)) for n in names}}
    eff = start.with_parameters(values)
    errors = {p.id: error(p.estimate(eff), p.value) for p in chosen}
    for _ in range(rounds):
        for name, (low, high) in names.items():
            affected = [p for p in chosen if touches(name, p)]
            if not affected:
                continue
            current = loss_of(list(errors.values()))
            for candidate in _moves(values[name], step, low, high):
                trial = start.with_parameters({**values, name: candidate})
                new = {p.id: error(p.estimate(trial), p.value) for p in affected}
                trial_loss = loss_of(list({**errors, **new}.values()))
                if trial_loss < current - 1e-6:
                    values[name], current = candidate, trial_loss
                    errors.update(new)
        step = 1 + (step - 1) / 2
    return start.with_parameters(values)


def _prior(name: str) -> float:
    return 1.0 if name.endswith(".speed") else 1.0 if name.endswith("overhead_ms") else 0.5


def _moves(value: float, step: float, low: float, high: float) -> list[float]:
    """Up and down by the step: multiplicative, or additive for a value at zero."""
    moves = [value * step, value / step] if value > 0 else [high * (step - 1) / 4]
    return [min(high, max(low, m)) for m in moves if min(high, max(low, m)) != value]
