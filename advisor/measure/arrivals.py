"""Open-loop arrival times: Poisson (burstiness 1) or gamma, as `vllm bench serve` draws them."""

from __future__ import annotations

import math

import numpy as np


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send offsets in seconds for `n` requests at `rate` requests/s (inf: all at once).

    Inter-arrival gaps are gamma-distributed with shape `burstiness` and mean 1/rate; shape 1
    is a Poisson process, below 1 burstier, above 1 more regular. As `vllm bench serve` does
    (`vllm/benchmarks/serve.py` `get_request`), the offsets are then scaled so the last request
    goes at exactly n / rate: the offered load is the asked rate whatever the seed. Unscaled, one
    seed's 48 requests at 2/s spanned 28.8 s (1.7 requests/s offered), and an overloaded
    server's latencies halved against vLLM's bench on the same server."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be positive")
    if math.isinf(rate):
        return [0.0] * n
    offsets = np.cumsum(np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n))
    return (offsets * (n / rate / offsets[-1])).tolist()
