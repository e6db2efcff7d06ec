"""The deployment search: every way to split a model over a pool of GPUs, per runtime, each
simulated at a sweep of loads; the Pareto frontier of tokens/s per GPU against tokens/s per
user, what meets percentile SLOs, the fewest GPUs that serve a target rate, and $ per million
output tokens.

Enumerated per runtime: TP x PP x data-parallel replicas (attention-DP with EP for a mixture of
experts), weights and KV in bf16 or fp8 (and FP4 where the device has FP4 arithmetic), aggregated
or disaggregated prefill/decode with 1-3 prefill engines per decode engine. Pruned: what does not
divide (heads, KV heads, experts, layers) or does not fit the memory."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

from ..hardware import Hardware
from ..model_facts import ModelSpec
from .deployment import Deployment, divides
from .efficiency import Efficiency, fitted
from .predict import Figures, predict
from .simulate import TRAFFIC_SPREAD, Traffic

DISAGGREGATING = ("vllm", "sglang", "tensorrt-llm")  # runtimes with a documented prefill/decode split
GGUF_RUNTIMES = ("llama-cpp", "ollama")
SLO_PATTERN = re.compile(r"^(ttft|tpot|e2e):(p\d{1,2}|mean|median)<(\d+(?:\.\d+)?)(ms|s)$")


class BadSLO(ValueError):
    """An SLO clause that does not parse; the message names it and the form."""


def parse_slos(text: str) -> list[tuple[str, str, float]]:
    """`ttft:p90<300ms;tpot:p99<50ms` -> [(metric, statistic, ms)]."""
    out = []
    for clause in filter(None, (c.strip() for c in text.split(";"))):
        match = SLO_PATTERN.match(clause.replace(" ", ""))
        if not match:
            raise BadSLO(f"SLO {clause!r}: write METRIC:STAT<VALUE, e.g. ttft:p90<300ms;tpot:p99<50ms "
                         "(metrics ttft, tpot, e2e; statistics p1-p99, mean, median; units ms or s)")
        metric, stat, value, unit = match.groups()
        out.append((metric, "p50" if stat == "median" else stat, float(value) * (1000 if unit == "s" else 1)))
    return out


@dataclass(frozen=True)
class Pool:
    hardware: Hardware
    gpus_per_node: int = 8
    nodes: int = 1
    price_per_gpu_hour: float | None = None

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass
class Option:
    """One deployment at one load."""
    deployment: Deployment
    concurrency: int
    figures: dict
    meets_slo: bool
    gpus: int
    tokens_per_s_per_gpu: float
    tokens_per_s_per_user: float
    requests_per_s: float
    dollars_per_million_tokens: float | None = None
    pareto: bool = False
    launch: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"runtime": self.deployment.runtime, "deployment": self.deployment.describe(), "gpus": self.gpus,
                "concurrency": self.concurrency, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
                "tokens_per_s_per_user": self.tokens_per_s_per_user, "requests_per_s": self.requests_per_s,
                "meets_slo": self.meets_slo, "pareto": self.pareto,
                "dollars_per_million_tokens": self.dollars_per_million_tokens, "figures": self.figures,
                "launch": self.launch}


def shapes(model: ModelSpec, pool: Pool, runtime: str) -> list[Deployment]:
    """Every split of the model over at most the pool's GPUs that divides."""
    hw, out = pool.hardware, []
    precisions = [("bf16", "bf16"), ("fp8", "fp8")] if hw.fp8_tflops else [("bf16", "bf16")]
    if hw.fp4_tflops:
        precisions.append(("nvfp4", "fp8"))
    powers = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= pool.gpus]
    splits, stages = powers, (1, 2, 4)
    if runtime in GGUF_RUNTIMES:  # GGUF weights, one process per device (its layer split is not modelled)
        precisions, splits, stages = [("Q4_K_M", "bf16"), ("Q8_0", "bf16")], (1,), (1,)
    for tp in splits:
        for pp in stages:
            for dp in powers:
                gpus = tp * pp * dp
                if gpus > pool.gpus or (pp > 1 and tp < min(pool.gpus_per_node, 8) // 2):
                    continue
                for attention_dp in ((False, True) if model.experts and dp > 1 else (False,)):
                    ep = tp * dp if attention_dp else 1
                    for weights, kv in precisions:
                        d = Deployment(runtime, hw, tp=tp, pp=pp, ep=ep, dp=dp, attention_dp=attention_dp,
                                       weights=weights, kv=kv, gpus_per_node=pool.gpus_per_node)
                        if divides(model, d) is None:
                            out.append(d)
    return out


def search(model: ModelSpec, pool: Pool, prompt: int, output: int, slos: list[tuple[str, str, float]],
           runtimes: list[str], target_rate: float | None = None, eff: Efficiency | None = None,
           loads: tuple[int, ...] = (1, 4, 16, 64, 256)) -> dict:
    """The options, the frontier, the cheapest within the SLOs and the fewest GPUs for the rate."""
    eff = eff or fitted()
    options: list[Option] = []
    for runtime in runtimes:
        for d in shapes(model, pool, runtime):
            for concurrency in loads:
                option = _option(model, d, prompt, output, concurrency, slos, pool, eff)
                if option is None:
                    break  # does not fit: no load will
                options.append(option)
            if runtime in DISAGGREGATING and d.pp == 1:
                for prefill in (1, 2, 3):
                    split = replace(d, prefill_workers=prefill * d.replicas)
                    if split.gpus <= pool.gpus:
                        for concurrency in [c for c in loads if c >= 16] or loads[-1:]:  # a split pays at load
                            option = _option(model, split, prompt, output, concurrency, slos, pool, eff)
                            if option:
                                options.append(option)
    _mark_pareto(options)
    good = [o for o in options if o.meets_slo]
    cheapest = min(good, key=lambda o: (o.dollars_per_million_tokens or 1 / max(o.tokens_per_s_per_gpu, 1e-9)),
                   default=None)
    fewest = None
    if target_rate and good:
        def needed(o: Option) -> int:
            return math.ceil(target_rate / o.requests_per_s) * o.gpus if o.requests_per_s else 10**9
        best = min(good, key=needed)
        fewest = {"option": best.to_dict(), "gpus": needed(best),
                  "copies": math.ceil(target_rate / best.requests_per_s)}
    return {"options": [o.to_dict() for o in options], "frontier": [o.to_dict() for o in options if o.pareto],
            "cheapest": cheapest.to_dict() if cheapest else None, "fewest_gpus": fewest,
            "searched": len(options)}


def _option(model: ModelSpec, d: Deployment, prompt: int, output: int, concurrency: int,
            slos: list[tuple[str, str, float]], pool: Pool, eff: Efficiency) -> Option | None:
    total = concurrency * d.dp  # per rank, data-parallel or attention-DP alike
    traffic = Traffic(prompt, output, load="concurrency", concurrency=total, requests=max(4 * total, 64),
                      spread=TRAFFIC_SPREAD)
    if d.prefill_workers:
        figures = _disaggregated(model, d, traffic, eff)
    else:
        figures = predict(model, d, traffic, eff)
    if not figures or not figures.fits:
        return None
    summary = figures.summary()
    meets = all(_value(figures, metric, stat) is not None and _value(figures, metric, stat) <= limit
                for metric, stat, limit in slos)
    gpus = d.gpus
    per_gpu = figures.output_tokens_per_s / gpus
    tpot = figures.mean("tpot") or 0.0
    option = Option(d, total, summary, meets, gpus, per_gpu, 1000 / tpot if tpot else 0.0, figures.requests_per_s)
    if pool.price_per_gpu_hour and figures.output_tokens_per_s:
        option.dollars_per_million_tokens = pool.price_per_gpu_hour * gpus / 3600 / figures.output_tokens_per_s * 1e6
    option.launch = launch_lines(model, d, pool)
    return option


def _disaggregated(model: ModelSpec, d: Deployment, traffic: Traffic, eff: Efficiency) -> Figures | None:
    """Decode engines run the handed-over prompts; the prefill engines must keep up with the
    requests the decode side finishes, and each request's TTFT is its prefill plus the KV handoff."""
    from .steps import StepCost

    decode = predict(model, replace(d, prefill_workers=0), replace(traffic, handed_over=True), eff)
    if not decode.fits or not decode.requests_per_s:
        return None
    prefill_engine = replace(d, prefill_workers=0, dp=d.dp if d.attention_dp else 1)
    rate = decode.requests_per_s / d.prefill_workers
    capacity = predict(model, prefill_engine, Traffic(traffic.prompt, 1, load="offline", requests=64), eff)
    if not capacity.fits or capacity.requests_per_s < rate:
        return None  # the prefill side cannot keep up at this load
    prefill = predict(model, prefill_engine, Traffic(traffic.prompt, 1, load="rate", rate=rate,
                                                     requests=max(64, traffic.requests // d.prefill_workers)), eff)
    handoff = StepCost(model, prefill_engine, eff).kv_transfer(traffic.prompt)
    decode.outcome.ttft = [t + p + handoff for t, p in zip(decode.outcome.ttft, _cycle(prefill.outcome.ttft,
                                                                                      len(decode.outcome.ttft)))]
    decode.deployment = d
    return decode


def _cycle(values: list[float], n: int) -> list[float]:
    return [values[i % len(values)] for i in range(n)] if values else [0.0] * n


def _value(f: Figures, metric: str, stat: str) -> float | None:
    return f.mean(metric) if stat == "mean" else f.latency(metric, float(stat[1:]))


def _mark_pareto(options: list[Option]) -> None:
    """Non-dominated in (tokens/s/GPU, tokens/s/user): none is better in both."""
    ordered = sorted(options, key=lambda o: (-o.tokens_per_s_per_user, -o.tokens_per_s_per_gpu))
    best_per_gpu = -1.0
    for o in ordered:
        if o.tokens_per_s_per_gpu > best_per_gpu:
            o.pareto, best_per_gpu = True, o.tokens_per_s_per_gpu


def launch_lines(model: ModelSpec, d: Deployment, pool: Pool) -> list[str]:
    """The runtime's own command line(s) for the deployment, one per node where it spans nodes."""
    quant = {"fp8": " --quantization fp8", "nvfp4": " --quantization modelopt_fp4"}.get(d.weights, "")
    kv = " --kv-cache-dtype fp8" if d.kv == "fp8" else ""
    nodes = d.nodes
    if d.runtime == "vllm":
        line = f"vllm serve {model.id} --tensor-parallel-size {d.tp}"
        line += f" --pipeline-parallel-size {d.pp}" * (d.pp > 1) + f" --data-parallel-size {d.dp}" * (d.dp > 1)
        line += " --enable-expert-parallel" * (d.ep > 1) + quant + kv
        if d.prefill_workers:  # each engine its own server, however many nodes they fill
            return [line + " --kv-transfer-config '{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_both\"}'"
                    + f"  # x{kind}" for kind in (f"{d.prefill_workers} prefill", f"{d.replicas} decode")]
        if nodes > 1:
            per_node = max(1, d.dp // nodes)
            return [line + f" --data-parallel-size-local {per_node} --data-parallel-address NODE0_IP"
                    + (" --headless --data-parallel-start-rank " + str(n * per_node) if n else "")
                    for n in range(nodes)]
        return [line]
    if d.runtime == "sglang":
        tp = d.tp * (d.dp if d.attention_dp else 1)
        line = f"python -m sglang.launch_server --model-path {model.id} --tp {tp}"
        line += f" --dp {d.dp} --enable-dp-attention" * d.attention_dp + f" --ep {d.ep}" * (d.ep > 1)
        line += f" --pp-size {d.pp}" * (d.pp > 1) + (" --quantization fp8" if d.weights == "fp8" else "")
        line += " --kv-cache-dtype fp8_e4m3" * (d.kv == "fp8")
        if d.prefill_workers:
            return [line + " --disaggregation-mode prefill", line + " --disaggregation-mode decode"]
        if nodes > 1:
            return [line + f" --nnodes {nodes} --node-rank {n} --dist-init-addr NODE0_IP:5000" for n in range(nodes)]
        return [line]
    if d.runtime == "tensorrt-llm":
        line = (f"trtllm-serve {model.id} --tp_size {d.tp * (d.dp if d.attention_dp else 1)} --pp_size {d.pp}"
                + f" --ep_size {d.ep}" * (d.ep > 1)
                + (" --extra_llm_api_options enable_attention_dp.yaml" if d.attention_dp else ""))
        if d.prefill_workers:  # context and generation servers behind `trtllm-serve disaggregated -c disagg.yaml`
            return [f"{line}  # x{d.prefill_workers} context servers", f"{line}  # x{d.replicas} generation servers",
                    "trtllm-serve disaggregated -c disagg.yaml  # lists the context and generation servers' URLs"]
        return [line]
    if d.runtime == "lmdeploy":
        return [f"lmdeploy serve api_server {model.id} --tp {d.tp}" + f" --dp {d.dp}" * (d.dp > 1)
                + " --quant-policy 8" * (d.kv == "fp8")]
    return [f"servegate launch {d.runtime} --model {model.id} --tp {d.tp}"]
