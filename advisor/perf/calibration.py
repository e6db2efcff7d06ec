"""The model against published measurements (policies/catalog/calibration.yaml): each point's
estimate and error, per regime, and with each source left out of the fit in turn."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import yaml

from ..hardware import resolve as resolve_hardware
from ..model_facts import resolve as resolve_model
from .deployment import Deployment
from .efficiency import Efficiency
from .predict import Figures, predict
from .simulate import Traffic

POINTS = Path(__file__).resolve().parents[2] / "policies" / "catalog" / "calibration.yaml"
REGIMES = ("prefill-heavy", "decode-heavy", "mixed", "latency", "moe", "fp8", "fp4", "multi-gpu", "multi-node",
           "cpu", "apple")


def regimes(prompt: int, output: int, moe: bool, weights: str, hw, gpus: int, nodes: int = 1,
            metric: str = "", decoding_only: bool = False) -> list[str]:
    """The regimes an estimate (or a measurement) belongs to, which its error range is read from."""
    tags = []
    if not decoding_only and (output and prompt / output >= 16 or metric == "prompt_tokens_per_s"):
        tags.append("prefill-heavy")
    elif decoding_only or prompt and output / prompt >= 4:
        tags.append("decode-heavy")
    else:
        tags.append("mixed")
    tags += ["latency"] * (metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"))
    tags += ["moe"] * moe
    tags += ["fp8"] * (weights.lower() == "fp8")
    tags += ["fp4"] * (weights.lower() in ("nvfp4", "mxfp4"))
    tags += ["multi-gpu"] * (gpus > 1)
    tags += ["multi-node"] * (nodes > 1)
    tags += ["cpu"] * (hw.vendor == "cpu")
    tags += ["apple"] * (hw.vendor == "apple")
    return tags


@dataclass(frozen=True)
class Point:
    id: str
    source: str
    runtime: str
    hardware: str
    model: str
    weights: str
    kv: str
    parallel: dict
    workload: dict
    metric: str
    stat: str
    value: float
    gpus: int = 1
    nodes: int = 1
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def regimes(self) -> list[str]:
        w = self.workload
        return regimes(w.get("prompt") or 0, w.get("output") or 0, bool(resolve_model(self.model).experts),
                       self.weights, resolve_hardware(self.hardware), self.gpus, self.nodes, self.metric,
                       decoding_only=bool(w.get("handed_over")) or self.metric == "decode_tokens_per_s")

    @property
    def engine(self) -> str:
        """The runtime as the model tells it apart: its name, or its scheduler generation."""
        return generation(self.runtime, self.extra.get("version"))

    def deployment(self) -> Deployment:
        p = self.parallel
        return Deployment(self.engine, resolve_hardware(self.hardware),
                          tp=p.get("tp") or 1, pp=p.get("pp") or 1,
                          ep=p.get("ep") or 1, dp=p.get("dp") or 1, attention_dp=bool(p.get("attention_dp")),
                          weights=self.weights, kv=self.kv, version=self.extra.get("version"))

    def traffic(self) -> Traffic:
        w = self.workload
        load = {"single": "concurrency"}.get(w["load"], w["load"])
        concurrency = w.get("concurrency") or 1
        default = {"offline": 1000, "rate": 600}.get(load, max(8 * concurrency, 64))
        requests = min(w.get("requests") or default, 3000 if load == "offline" else 4000)
        if load == "concurrency":
            requests = max(requests, 4 * concurrency)
        return Traffic(prompt=w.get("prompt") or 1, output=w.get("output") or 1, load=load,
                       concurrency=concurrency, rate=w.get("rate") or 0.0, requests=requests,
                       handed_over=bool(w.get("handed_over")), spread=w.get("spread") or 0.0)

    def estimate(self, eff: Efficiency) -> float | None:
        """The model's figure in the point's own metric and statistic; None if it does not fit."""
        figures = predict(resolve_model(self.model), self.deployment(), self.traffic(), eff)
        return read(figures, self.metric, self.stat, self.gpus, self.nodes) if figures.fits else None


def generation(runtime: str, version) -> str:
    """The scheduler generation a version ran: vLLM before 0.8 is the V0 engine."""
    if runtime == "vllm" and version and str(version)[:2] == "0." and str(version).split(".")[1].isdigit() \
            and int(str(version).split(".")[1]) < 8:
        return "vllm-v0"
    return runtime


def read(f: Figures, metric: str, stat: str, gpus: int, nodes: int) -> float | None:
    """A metric as benchmarks report it."""
    if metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        name = {"itl": "tpot"}.get(metric[:-3], metric[:-3])
        if stat == "mean":
            return f.mean(name)
        return f.latency(name, {"median": 50, "p50": 50, "p90": 90, "p99": 99}[stat])
    if metric == "decode_tokens_per_s" and stat in ("per_user", "total") and f.outcome.tpot:
        per_user = 1000 / f.mean("tpot")
        if stat == "per_user":
            return per_user
    total = {"output_tokens_per_s": f.output_tokens_per_s, "decode_tokens_per_s": f.output_tokens_per_s,
             "prompt_tokens_per_s": f.prompt_tokens_per_s,
             "total_tokens_per_s": f.output_tokens_per_s + f.prompt_tokens_per_s,
             "requests_per_s": f.requests_per_s}[metric]
    if metric == "prompt_tokens_per_s" and f.outcome.ttft and f.outcome.completed <= 8:  # one prompt at a time
        total = f.outcome.prompt_tokens / sum(f.outcome.ttft)
    if stat == "per_user":
        return 1000 / f.mean("tpot") if f.outcome.tpot else total
    return total / {"per_gpu": gpus, "per_node": nodes}.get(stat, 1)


@cache
def points() -> tuple[Point, ...]:
    data = yaml.safe_load(POINTS.read_text())
    keys = set(Point.__dataclass_fields__) - {"extra"}
    return tuple(Point(**{k: v for k, v in p.items() if k in keys},
                       extra={k: v for k, v in p.items() if k not in keys})
                 for p in data["points"] if not p.get("held_out"))


def sources() -> dict:
    return yaml.safe_load(POINTS.read_text())["sources"]


def held_out() -> list[dict]:
    return [p for p in yaml.safe_load(POINTS.read_text())["points"] if p.get("held_out")]


def error(estimate: float | None, measured: float) -> float:
    """|log(estimate / measured)|: a factor's distance from 1 either way (infinite when no estimate)."""
    return abs(math.log(estimate / measured)) if estimate else math.inf


def as_percent(log_error: float) -> float:
    """A log error as the percentage a reader expects: 0.223 -> 25% (a factor of 1.25)."""
    return (math.exp(log_error) - 1) * 100


@dataclass
class Row:
    point: Point
    estimate: float | None
    held_out_estimate: float | None = None

    @property
    def ratio(self) -> float | None:
        return self.estimate / self.point.value if self.estimate else None


def evaluate(eff: Efficiency, chosen: tuple[Point, ...] | None = None) -> list[Row]:
    return [Row(p, p.estimate(eff)) for p in (chosen or points())]


def median_error(rows: list[Row], held_out: bool = False) -> float:
    errors = [error(r.held_out_estimate if held_out else r.estimate, r.point.value) for r in rows]
    return as_percent(statistics.median(errors)) if errors else 0.0


@dataclass
class CalibrationReport:
    rows: list[Row]
    regimes: dict[str, dict]
    sources: dict[str, dict]
    pairs: list[dict]
    held_out: list[dict]

    @property
    def median(self) -> float:
        return median_error(self.rows)

    @property
    def worst(self) -> float:
        """The largest factor off, either way."""
        return math.exp(max(error(r.estimate, r.point.value) for r in self.rows))

    @property
    def median_left_out(self) -> float:
        return median_error(self.rows, held_out=True)

    def to_dict(self) -> dict:
        return {"median_error_pct": self.median, "worst_factor": self.worst,
                "median_error_left_out_pct": self.median_left_out, "regimes": self.regimes,
                "sources": self.sources, "pairs": self.pairs,
                "points": [{"id": r.point.id, "source": r.point.source, "runtime": r.point.runtime,
                            "metric": r.point.metric, "stat": r.point.stat, "measured": r.point.value,
                            "estimate": r.estimate, "estimate_source_left_out": r.held_out_estimate,
                            "regimes": r.point.regimes} for r in self.rows],
                "held_out": [{"id": p["id"], "why": p["held_out"]} for p in self.held_out]}


def calibrate(eff: Efficiency, left_out: dict[str, float | None] | None = None) -> CalibrationReport:
    """Every point's estimate by `eff`; with `left_out` (`fit.left_out`: each point's estimate by a
    fit made without its source), those beside them."""
    rows = evaluate(eff)
    leave_out = left_out is not None
    if leave_out:
        for row in rows:
            row.held_out_estimate = left_out[row.point.id]
    regimes = {}
    for regime in REGIMES:
        members = [r for r in rows if regime in r.point.regimes]
        if members:
            regimes[regime] = {"points": len(members), "median_error_pct": median_error(members),
                               "worst_factor": math.exp(max(error(r.estimate, r.point.value) for r in members)),
                               "median_error_left_out_pct": median_error(members, held_out=True) if leave_out
                               else None}
    per_source = {s: {"points": len(m), "median_error_pct": median_error(m),
                      "median_error_left_out_pct": median_error(m, held_out=True) if leave_out else None}
                  for s in sorted({r.point.source for r in rows})
                  for m in [[r for r in rows if r.point.source == s]]}
    return CalibrationReport(rows, regimes, per_source, runtime_pairs(rows), held_out())


def runtime_pairs(rows: list[Row]) -> list[dict]:
    """Points of one publisher that differ only in the runtime: does the model order the runtimes
    as the measurements do?"""
    def setup(p: Point) -> tuple:
        return (p.source, p.hardware, p.model, p.weights, p.gpus, p.metric, p.stat,
                tuple(sorted((k, v) for k, v in p.workload.items() if k != "requests")))

    pairs = []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            if a.point.runtime != b.point.runtime and setup(a.point) == setup(b.point) and a.estimate and b.estimate:
                measured = a.point.value > b.point.value
                pairs.append({"metric": a.point.metric, "setup": f"{a.point.model} on {a.point.gpus} x "
                              f"{a.point.hardware}, {a.point.workload.get('prompt')}/{a.point.workload.get('output')}",
                              "runtimes": [a.point.runtime, b.point.runtime],
                              "measured": [a.point.value, b.point.value], "estimated": [a.estimate, b.estimate],
                              "same_direction": measured == (a.estimate > b.estimate)})
    return pairs


def intervals(report: CalibrationReport, low: float = 10, high: float = 90) -> dict[str, list[float]]:
    """Per regime, the 10th-90th percentile of measured / estimated over its points, estimated with
    their source left out of the fit: the range an estimate in that regime carries."""
    from .predict import percentile

    out = {}
    for regime in (*REGIMES, "all"):
        ratios = [r.point.value / (r.held_out_estimate or r.estimate) for r in report.rows
                  if (regime == "all" or regime in r.point.regimes) and (r.held_out_estimate or r.estimate)]
        if len(ratios) >= 3:
            out[regime] = [round(percentile(ratios, low), 3), round(percentile(ratios, high), 3)]
    return out


def to_page(report: CalibrationReport) -> str:
    """The report as the Markdown page docs/advisor-calibration.md holds."""
    return ("# The performance model against published measurements\n\n"
            "`servegate advise --calibration --output docs/advisor-calibration.md`: every point of "
            "`policies/catalog/calibration.yaml` estimated in its own metric with the committed fit "
            "(`policies/catalog/perf-fit.yaml`), then with its source left out of the fit; ratio = estimate / "
            "measured. CI recomputes it (`tests/test_perf_calibration.py`).\n\n```\n" + to_text(report) + "```\n")


def to_text(report: CalibrationReport) -> str:
    lines = [f"{'point':50} {'source':22} {'metric':28} {'measured':>11} {'estimate':>11} {'ratio':>6} "
             f"{'left out':>8}  regimes"]
    for r in report.rows:
        p = r.point
        left = f"{r.held_out_estimate / p.value:8.2f}" if r.held_out_estimate else "       -"
        lines.append(f"{p.id[:50]:50} {p.source[:22]:22} {(p.metric + ' ' + p.stat)[:28]:28} {p.value:11,.1f} "
                     f"{r.estimate or 0:11,.1f} {(r.ratio or 0):6.2f} {left}  {','.join(p.regimes)}")
    lines += ["", f"all {len(report.rows)} points: median error {report.median:.1f}%, worst off by "
              f"{report.worst:.2f}x; each source left out of the fit in turn: median {report.median_left_out:.1f}%",
              "", f"{'regime':14} {'points':>6} {'median %':>9} {'worst x':>8} {'left out %':>10}"]
    for name, r in report.regimes.items():
        left = f"{r['median_error_left_out_pct']:10.1f}" if r["median_error_left_out_pct"] is not None else "         -"
        lines.append(f"{name:14} {r['points']:6} {r['median_error_pct']:9.1f} {r['worst_factor']:8.2f} {left}")
    lines += ["", f"{'source':22} {'points':>6} {'median %':>9} {'left out %':>10}"]
    for name, r in report.sources.items():
        left = f"{r['median_error_left_out_pct']:10.1f}" if r["median_error_left_out_pct"] is not None else "         -"
        lines.append(f"{name:22} {r['points']:6} {r['median_error_pct']:9.1f} {left}")
    lines += ["", "runtime pairs (same publisher, hardware, model, workload):"]
    for pair in report.pairs:
        a, b = pair["runtimes"]
        lines.append(f"  {pair['setup']}, {pair['metric']}: {a} {pair['measured'][0]:,.1f} vs {b} "
                     f"{pair['measured'][1]:,.1f} measured, {pair['estimated'][0]:,.1f} vs {pair['estimated'][1]:,.1f} "
                     f"estimated: {'same direction' if pair['same_direction'] else 'OPPOSITE'}")
    lines += ["", "points held out of the fit and the error (each with its reason):"]
    lines += [f"  {p['id']}: {p['held_out']}" for p in report.held_out]
    return "\n".join(lines) + "\n"
