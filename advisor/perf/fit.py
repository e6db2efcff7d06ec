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
    "precision.fp8": (0.3, 1.0), "precision.fp4": (0.2, 1.0), "moe": (0.15, 1.0), "moe_width": (0.0, 16384.0),
    "attention": (0.15, 1.0),
    "layer_us": (0.0, 300.0), "moe_layer_us": (0.0, 600.0),
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
        key = p.engine if cls == "gpu" else f"{p.engine}@{cls}"
        if key != "vllm" and cls != "apple":
            out[f"runtime.{key}.speed"] = RUNTIME_SPEED
        if cls != "apple":
            out[f"runtime.{key}.overhead_ms"] = RUNTIME_OVERHEAD_MS
            out[f"runtime.{key}.request_ms"] = (0.0, 100.0)
        if cls == "gpu":
            out[f"runtime.{key}.per_sequence_us"] = (0.0, 200.0)
        if cls == "cpu":
            out[f"runtime.{key}.compute_speed"] = (0.1, 3.0)
            out[f"runtime.{key}.per_sequence_us"] = (0.0, 20000.0)  # sampling a vocabulary on a CPU costs ms
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
        return runtime == (p.engine if cls == "gpu" else f"{p.engine}@{cls}") or runtime == p.engine
    if name in ("moe", "moe_width", "moe_layer_us"):
        return "moe" in p.regimes
    return cls == "gpu" or name == "attention"  # layer_us, per_sequence_us on GPUs; attention everywhere


def loss_of(errors: list[float]) -> float:
    capped = [min(e, math.log(10)) for e in errors]  # a point that does not fit counts as 10x off
    return sum(e + 20 * max(0.0, e - OUTLIER) ** 2 for e in capped) / max(1, len(capped))


def fit(chosen: tuple[Point, ...], start: Efficiency, rounds: int = 4, step: float = 1.5,
        only: str = "") -> Efficiency:
    """`only`: fit just the parameters whose names contain it (e.g. "cpu"), the rest held."""
    names = {n: b for n, b in parameters(chosen).items() if only in n}
    known = start.parameters()
    # a new compute speed starts where the runtime's one speed stood
    values = {n: known.get(n, known.get(n.replace(".compute_speed", ".speed"), _prior(n))) for n in names}
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
    priors = {"speed": 1.0, "compute_speed": 1.0, "overhead_ms": 1.0, "request_ms": 5.0,
              "per_sequence_us": 1000.0 if "@cpu" in name else 10.0}
    return priors.get(name.rpartition(".")[2], 0.5)


def _moves(value: float, step: float, low: float, high: float) -> list[float]:
    """Up and down by the step: multiplicative, or additive for a value at zero."""
    moves = [value * step, value / step] if value > 0 else [high * (step - 1) / 4]
    return [min(high, max(low, m)) for m in moves if min(high, max(low, m)) != value]


def left_out(chosen: tuple[Point, ...], start: Efficiency) -> dict[str, float | None]:
    """Each point's estimate by a fit (started from `start`) made without the points of its source."""
    estimates = {}
    for source in sorted({p.source for p in chosen}):
        without = fit(tuple(p for p in chosen if p.source != source), start, rounds=2, step=1.25)
        estimates |= {p.id: p.estimate(without) for p in chosen if p.source == source}
    return estimates
