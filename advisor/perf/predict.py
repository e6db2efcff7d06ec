"""A deployment's figures for a workload: its KV capacity, one rank simulated under the traffic,
and the percentiles, throughputs and goodput a benchmark would report."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..model_facts import ModelSpec
from .deployment import Deployment
from .efficiency import Efficiency, fitted
from .memory import kv_tokens
from .schedulers import scheduler
from .simulate import Outcome, Traffic, simulate
from .steps import StepCost


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between order statistics, as numpy's default and the
    benchmark tools compute it; None for no values. The one definition the advisor uses."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    low, high = math.floor(k), math.ceil(k)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


@dataclass
class Figures:
    """What one deployment does under one traffic, in a benchmark's terms (ms and tokens/s)."""
    deployment: Deployment
    kv_tokens: int
    fits: bool
    outcome: Outcome | None = None
    ranks: int = 1

    def latency(self, metric: str, q: float = 50) -> float | None:
        if not self.outcome:
            return None
        values = {"ttft": self.outcome.ttft, "tpot": self.outcome.tpot, "e2e": self.outcome.e2e}[metric]
        value = percentile(values, q)
        return None if value is None else value * 1000

    def mean(self, metric: str) -> float | None:
        values = {"ttft": self.outcome.ttft, "tpot": self.outcome.tpot, "e2e": self.outcome.e2e}[metric]
        return sum(values) / len(values) * 1000 if values else None

    @property
    def output_tokens_per_s(self) -> float:
        o = self.outcome
        return o.output_tokens / o.duration * self.ranks if o and o.duration else 0.0

    @property
    def prompt_tokens_per_s(self) -> float:
        o = self.outcome
        return o.prompt_tokens / o.duration * self.ranks if o and o.duration else 0.0

    @property
    def requests_per_s(self) -> float:
        o = self.outcome
        return o.completed / o.duration * self.ranks if o and o.duration else 0.0

    def goodput(self, slo_ttft_ms: float, slo_tpot_ms: float) -> float:
        """Requests/s that met both objectives (a one-token answer has no TPOT to miss)."""
        o = self.outcome
        if not o or not o.duration:
            return 0.0
        good = sum(1 for ttft, tpot in o.finished
                   if ttft * 1000 <= slo_ttft_ms and (tpot is None or tpot * 1000 <= slo_tpot_ms))
        return good / o.duration * self.ranks

    def summary(self) -> dict:
        return {"ttft_ms": {f"p{q}": self.latency("ttft", q) for q in (50, 90, 99)},
                "tpot_ms": {f"p{q}": self.latency("tpot", q) for q in (50, 90, 99)},
                "e2e_ms": {f"p{q}": self.latency("e2e", q) for q in (50, 90, 99)},
                "output_tokens_per_s": self.output_tokens_per_s, "requests_per_s": self.requests_per_s,
                "kv_tokens_per_rank": self.kv_tokens, "preemptions": self.outcome.preemptions if self.outcome else 0}


def predict(model: ModelSpec, d: Deployment, traffic: Traffic, eff: Efficiency | None = None,
            accepted: float = 1.0, drafts: int = 0) -> Figures:
    """Simulate one rank with its share of the traffic; `accepted` tokens per decode step when
    `drafts` speculative tokens are verified each step (MTP, EAGLE, a draft model)."""
    eff = eff or fitted()
    cost = StepCost(model, d, eff, speculative=1 + drafts)
    context = traffic.prompt + traffic.output
    capacity = kv_tokens(model, d, cost, context)
    ranks = d.dp
    if capacity < context:
        return Figures(d, capacity, False, ranks=ranks)
    outcome = simulate(cost, scheduler(d.runtime, d.hardware), capacity, traffic.share(ranks), accepted)
    return Figures(d, capacity, True, outcome, ranks)
