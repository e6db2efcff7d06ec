"""Open-loop arrival times: Poisson (burstiness 1) or gamma, as `vllm bench serve` draws them."""

from __future__ import annotations

import math

import numpy as np


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send offsets in seconds for `n` requests at `rate` requests/s (inf: all at once).

    Inter-arrival gaps are gamma-distributed with shape `burstiness` and mean 1/rate; shape 1
    is a Poisson process, below 1 burstier, above 1 more regular."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be positive")
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0  # the first request goes at once
    return np.cumsum(gaps).tolist()
