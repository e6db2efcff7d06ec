"""Per-request measurements and the summary, with the result keys of `vllm bench serve`."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    prompt_tokens: int
    output_tokens: int = 0
    cached_tokens: int = 0
    start: float = 0.0  # when it was sent, seconds from the start of the run
    ttft: float | None = None  # seconds to the first output text
    itl: list[float] = field(default_factory=list)  # seconds between later outputs
    e2el: float | None = None  # seconds from send to the last byte
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None for one-token answers."""
        if self.ttft is None or self.e2el is None or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    def meets(self, slo_ms: dict[str, float]) -> bool:
        """Whether the request satisfies every SLO given (in ms); a one-token answer has TPOT 0."""
        values = {"ttft": self.ttft, "tpot": self.tpot or 0.0, "e2el": self.e2el}
        return self.ok and all(values[k] is not None and values[k] * 1000 <= v for k, v in slo_ms.items())


def parse_goodput(specs: list[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0}, refusing unknown keys by name."""
    slo = {}
    for spec in specs:
        key, _, value = spec.partition(":")
        if key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput: unknown metric {key!r} (choose from {', '.join(GOODPUT_KEYS)})")
        try:
            slo[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput: {spec!r} is not KEY:MILLISECONDS") from None
        if slo[key] <= 0:
            raise ValueError(f"--goodput: {key} must be positive")
    return slo


def _stats(name: str, values_s: list[float], percentiles: tuple[int, ...]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=float) * 1000 if values_s else np.zeros(1)
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(ms.std())}
    out.update({f"p{p}_{name}_ms": float(np.percentile(ms, p)) for p in percentiles})
    return out


def summarize(results: list[RequestResult], duration: float, slo_ms: dict[str, float] | None = None,
              percentiles: tuple[int, ...] = (50, 95, 99)) -> dict:
    done = [r for r in results if r.ok]
    inputs = sum(r.prompt_tokens for r in done)
    outputs = sum(r.output_tokens for r in done)
    summary = {
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": inputs,
        "total_output_tokens": outputs,
        "total_cached_tokens": sum(r.cached_tokens for r in done),
        "request_throughput": len(done) / duration,
        "request_goodput": sum(r.meets(slo_ms) for r in done) / duration if slo_ms else None,
        "output_throughput": outputs / duration,
        "total_token_throughput": (inputs + outputs) / duration,
    }
    series = {
        "ttft": [r.ttft for r in done if r.ttft is not None],
        "tpot": [r.tpot for r in done if r.tpot is not None],
        "itl": [x for r in done for x in r.itl],
        "e2el": [r.e2el for r in done if r.e2el is not None],
    }
    for name in METRICS:
        summary.update(_stats(name, series[name], percentiles))
    return summary


def kv_summary(samples: list[dict[str, float]]) -> dict:
    """KV accounting over the engine figures sampled during a run (servegate engines report them)."""
    if not samples:
        return {}
    peak = max(samples, key=lambda s: s.get("kv_blocks_used", 0))
    first, last = samples[0], samples[-1]

    def delta(key: str) -> float:
        return last.get(key, 0.0) - first.get(key, 0.0)

    admitted, slot_steps = delta("admitted_requests_total"), delta("kv_slot_steps_total")
    return {
        "kv_blocks_total": peak.get("kv_blocks_total"),
        "kv_peak_blocks_used": peak.get("kv_blocks_used"),
        "kv_live_token_fraction_at_peak": peak.get("kv_live_token_fraction"),
        # Over every engine step of the run: live tokens / allocated slots.
        "kv_live_token_fraction": delta("kv_live_token_steps_total") / slot_steps if slot_steps else None,
        "peak_running": max(s.get("running", 0) for s in samples),
        "preemptions": delta("preemptions_total"),
        "recomputed_tokens": delta("recomputed_tokens_total"),
        "mean_queue_delay_ms": delta("queue_delay_seconds_total") / admitted * 1000 if admitted else None,
    }


def slo_attainment(summary: dict) -> float | None:
    """Share of the run's requests that met every SLO (None without --goodput)."""
    total = summary["completed"] + summary["failed"]
    if summary.get("request_goodput") is None or not total:
        return None
    return summary["request_goodput"] * summary["duration"] / total


def knee(runs: list[dict], attainment: float) -> float | None:
    """The highest request rate whose run had at least `attainment` of its requests meet the SLO."""
    meeting = [r["request_rate"] for r in runs if (a := slo_attainment(r)) is not None and a >= attainment]
    return max(meeting, default=None)
