"""`servegate advise`: exclude the runtimes the model, hardware and requirements rule out (rules
over the support matrices), then compare the rest by estimated SLO goodput (capacity model and
roofline), and say what to measure next.

Ranking: excluded candidates last; the others by the sum of their soft scores, plus up to 3 points
for estimated goodput relative to the best candidate, plus 0.1 per verified production feature
(the tie-breaker when estimates agree). Estimates are a starting point: `--measure`
replaces them with `servegate bench` figures."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from backends.launch import LaunchError, lora_modules
from backends.runtimes import serving
from policies import rules
from policies.matrix import Cell, Matrix, matrices
from policies.rules import RuleSet

from .capacity import (
    GGUF_BITS,
    KV_DTYPE_BYTES,
    Derates,
    Roofline,
    bits_per_weight,
    kv_bytes_per_token,
    memory_plan,
    reserved_bytes,
    tensor_parallel_seconds,
)
from .hardware import Hardware
from .model_facts import ModelSpec
from .perf.deployment import NETWORK_GBS

GIB = 2**30
# Requested KV dtypes -> the matrices' keys.
KV_ALIASES = {"fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3", "nvfp4": "fp4", "fp4_e2m1": "fp4", "f16": "auto",
              "fp16": "auto", "bf16": "auto", "auto": "auto"}
# Weight formats -> the matrices' keys, one vocabulary for framework dtypes and GGUF's type names:
# GGUF's float types (F32, F16, BF16) and its MXFP4/NVFP4 are those formats; its quantized types
# (Q8_0, Q4_K_M, IQ2_XS, ...) are `gguf`.
WEIGHT_KEYS = {"fp32": "bf16", "f32": "bf16", "fp16": "bf16", "f16": "bf16", "bf16": "bf16", "fp8": "fp8",
               "awq": "awq", "gptq": "gptq", "int8": "int8_w8a8", "int8_w8a8": "int8_w8a8",
               "bitsandbytes": "bitsandbytes", "nvfp4": "nvfp4", "mxfp4": "mxfp4", "exl2": "exl2", "gguf": "gguf"}
REQUIREMENTS = ("structured_output", "multi_lora", "speculative_decoding")  # Workload flags = matrix features
VERDICT_ORDER = {"recommended": 0, "viable": 1, "excluded": 2}
# Scores closer than this tie: goodput adds up to 3 points, so 0.3 is 10% of the best estimated
# goodput, finer than a roofline estimate resolves.
SCORE_TIE = 0.3
CURVE_SHARES = (0.1, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5)  # offered rates for the goodput curve, of the roofline's capacity


class ImpossibleRequest(ValueError):
    """Constraints that no input could satisfy (e.g. a prefix reuse above 1)."""


@dataclass
class Workload:
    kind: str = "chat"  # chat | agent | batch | rag
    prompt_tokens: int = 1024
    output_tokens: int = 256
    prefix_reuse: float = 0.0  # share of each prompt already seen in an earlier one
    concurrency: int = 16
    request_rate: float | None = None  # requests/s; turned into a concurrency by Little's law
    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 50.0
    kv_cache_dtype: str | None = None
    weight_quant: str | None = None
    new_deployment: bool = True
    existing_tgi: bool = False
    offline: bool = False
    expert_parallel: bool = False  # serve the experts expert-parallel: runtimes without it are excluded
    structured_output: bool = False  # requirements: runtimes without the feature are excluded
    multi_lora: bool = False
    speculative_decoding: bool = False
    draft_tokens: int = 0  # speculative tokens verified per step (EAGLE, MTP, a draft model); 0: none
    acceptance: float = 0.0  # the chance each draft token is accepted, as the runtime's metrics report it
    lora_adapters: int = 0  # LoRA adapters served beside the base model (implies multi_lora)
    lora_rank: int = 16  # the largest adapter's rank
    lora_paths: list[str] = field(default_factory=list)  # NAME=PATH of the adapters, for the launch lines
    max_context: int | None = None  # the longest request (prompt + output); None: the model's context
    gpus_per_node: int = 8  # tensor parallelism past a node runs over the network

    def __post_init__(self) -> None:
        if self.lora_paths:
            self.lora_adapters = max(self.lora_adapters, len(self.lora_paths))
        self.multi_lora = self.multi_lora or self.lora_adapters > 0

    @property
    def lora_slots(self) -> int:
        """Adapters one batch may mix, each held on the device: every adapter, up to the requests
        in flight."""
        return min(self.lora_adapters, max(self.concurrency, 1))

    @property
    def accepted_per_step(self) -> float:
        """Tokens a decode step yields: 1 + the expected accepted drafts, (1 - a^(k+1)) / (1 - a) for k
        drafts each accepted with chance a until the first rejection (Leviathan et al., 2023)."""
        a, k = self.acceptance, self.draft_tokens
        return (1 - a ** (k + 1)) / (1 - a) if k else 1.0

    def check(self) -> None:
        numbers = {"--prefix-reuse": self.prefix_reuse, "--request-rate": self.request_rate,
                   "--slo-ttft-ms": self.slo_ttft_ms, "--slo-tpot-ms": self.slo_tpot_ms,
                   "--acceptance": self.acceptance}
        infinite = [f"{flag} {value}: must be a finite number" for flag, value in numbers.items()
                    if value is not None and not math.isfinite(value)]
        if infinite:
            raise ImpossibleRequest("; ".join(infinite))
        problems = [message for bad, message in (
            (not 0.0 <= self.prefix_reuse < 1.0, f"--prefix-reuse {self.prefix_reuse} must lie in [0, 1)"),
            (self.prompt_tokens < 1, "--prompt-tokens must be at least 1"),
            (self.output_tokens < 1, "--output-tokens must be at least 1"),
            (self.concurrency < 1, "--concurrency must be at least 1"),
            (self.request_rate is not None and self.request_rate <= 0, "--request-rate must be positive"),
            (self.slo_ttft_ms <= 0 or self.slo_tpot_ms <= 0, "SLOs must be positive"),
            (self.draft_tokens < 0 or self.draft_tokens > 16, "--draft-tokens must lie in [0, 16]"),
            (not 0.0 <= self.acceptance < 1.0, f"--acceptance {self.acceptance} must lie in [0, 1)"),
            (self.acceptance > 0 and not self.draft_tokens, "--acceptance needs --draft-tokens"),
            (self.lora_adapters < 0, "--lora-adapters must be at least 0"),
            (self.gpus_per_node < 1, "--gpus-per-node must be at least 1"),
            (not 1 <= self.lora_rank <= 512, f"--lora-rank {self.lora_rank} must lie in [1, 512]"),
            (self.max_context is not None and self.max_context < self.prompt_tokens + self.output_tokens,
             f"--max-context {self.max_context} is below --prompt-tokens + --output-tokens "
             f"({self.prompt_tokens + self.output_tokens})"),
            (self.kind not in ("chat", "agent", "batch", "rag"),
             f"--workload {self.kind!r}: chat, agent, batch or rag"),
        ) if bad]
        if self.kv_cache_dtype and self.kv_cache_dtype.lower() not in {*KV_DTYPE_BYTES, *KV_ALIASES}:
            problems.append(f"--kv-cache-dtype {self.kv_cache_dtype!r}: one of {', '.join(sorted(KV_DTYPE_BYTES))}")
        if self.weight_quant:
            try:
                bits_per_weight(self.weight_quant)
            except ValueError as exc:
                problems.append(f"--weight-quant: {exc}")
        try:
            lora_modules(self.lora_paths)
        except LaunchError as exc:
            problems.append(f"--lora: {exc}")
        if problems:
            raise ImpossibleRequest("; ".join(problems))


def _check_fits(model: ModelSpec, gpus: int, workload: Workload, derates: Derates) -> list[str]:
    """What no runtime could serve, said with the nearest valid choice; notes on what only a
    non-default setting serves."""
    notes = []
    total = workload.max_context or workload.prompt_tokens + workload.output_tokens
    longest = model.scaled_context or model.max_context
    if model.max_context and workload.max_context and total > longest:
        raise ImpossibleRequest(f"--max-context {total} exceeds {model.id}'s context of {longest} tokens"
                                + (f" (with {model.scaling_note})" if model.scaled_context else ""))
    if model.max_context and total > longest:
        room = longest - workload.output_tokens
        raise ImpossibleRequest(
            f"--prompt-tokens {workload.prompt_tokens} + --output-tokens {workload.output_tokens} = {total} exceed "
            f"{model.id}'s context of {longest} tokens" + (f" (with {model.scaling_note})" if model.scaled_context
                                                             else "")
            + (f"; with {workload.output_tokens} output tokens, at most {room} prompt tokens" if room > 0 else ""))
    if model.max_context and total > model.max_context:
        notes.append(f"{total} tokens exceed {model.id}'s default context of {model.max_context}: it needs "
                     f"{model.scaling_note}. Turn it on only for long-context traffic.")
    if gpus > workload.gpus_per_node:
        nodes = -(-gpus // workload.gpus_per_node)
        notes.append(f"{gpus} devices span {nodes} nodes of {workload.gpus_per_node}: tensor parallelism across them "
                     f"runs over the network ({NETWORK_GBS:g} GB/s a direction), not the devices' own link; "
                     f"--gpus-per-node sets the node size")
    if workload.expert_parallel and not model.experts:
        raise ImpossibleRequest(f"--expert-parallel: {model.id} is dense, it has no experts to split")
    if workload.expert_parallel and gpus > 1 and model.experts.routed % gpus:
        valid = [n for n in range(1, model.experts.routed + 1) if model.experts.routed % n == 0]
        raise ImpossibleRequest(f"--gpus {gpus} --expert-parallel: {model.id}'s {model.experts.routed} routed experts "
                                f"do not split evenly over {gpus} devices (divisors: {', '.join(map(str, valid))})")
    heads = model.attention_dim // model.arch.head_dim if model.arch.head_dim else 0
    if gpus > 1 and heads and heads % gpus:
        valid = [n for n in range(1, heads + 1) if heads % n == 0]
        nearest = sorted(valid, key=lambda n: (abs(n - gpus), n))[:2]
        raise ImpossibleRequest(f"--gpus {gpus}: tensor parallelism splits {model.id}'s {heads} attention heads "
                                f"evenly across the devices; use {' or '.join(map(str, sorted(nearest)))} "
                                f"(divisors of {heads}: {', '.join(map(str, valid))})")
    kv = model.arch.kv_heads
    if gpus > 1 and kv and (gpus % kv if gpus > kv else kv % gpus):
        raise ImpossibleRequest(f"--gpus {gpus}: tensor parallelism shards {model.id}'s {kv} KV heads, or replicates "
                                f"them when the devices are a multiple of {kv}; {gpus} is neither a divisor nor a "
                                f"multiple")
    if gpus > 1 and model.mlp_width and not model.experts and model.mlp_width % gpus:
        raise ImpossibleRequest(f"--gpus {gpus}: tensor parallelism splits {model.id}'s MLP width "
                                f"({model.mlp_width}) evenly across the devices, which {gpus} does not divide")
    for name, value in (("bandwidth", derates.bandwidth), ("prefill", derates.prefill_compute),
                        ("decode", derates.decode_compute)):
        if not 0 < value <= 1:
            raise ImpossibleRequest(f"--derate-{name} {value:g}: a share of the datasheet peak, in (0, 1]")
    return notes


@dataclass
class Candidate:
    runtime: str
    name: str
    version: str
    verdict: str = "viable"
    score: float = 0.0
    reasons: list[dict] = field(default_factory=list)
    memory: dict = field(default_factory=dict)
    estimates: dict = field(default_factory=dict)
    launch: dict = field(default_factory=dict)
    measured: dict | None = None


@dataclass
class Report:
    model: dict
    hardware: dict
    workload: dict
    assumptions: dict
    candidates: list[Candidate]
    summary: str
    notes: list[str] = field(default_factory=list)  # ties, and leads that rest on unverified cells
    alternatives: list[dict] = field(default_factory=list)  # when no runtime meets the SLO: what would, estimated

    def to_dict(self) -> dict:
        return asdict(self)


def advise(model: ModelSpec, hardware: Hardware, gpus: int, workload: Workload, derates: Derates | None = None,
           runtimes: list[str] | None = None, explore: bool = True) -> Report:
    """The report; `explore` also estimates the alternatives when no runtime meets the SLO."""
    workload.check()
    derates = derates or default_derates(hardware)
    if gpus < 1:
        raise ImpossibleRequest("--gpus must be at least 1")
    if not hardware.gpu and gpus > 1:
        raise ImpossibleRequest(f"{hardware.id} is one machine: --gpus applies to accelerators only")
    context_notes = _check_fits(model, gpus, workload, derates)
    ruleset = rules.named("advisor")
    chosen = matrices()
    unknown = set(runtimes or ()) - set(chosen)
    if unknown:
        raise ImpossibleRequest(f"unknown runtimes {sorted(unknown)}: choose from {', '.join(chosen)}")
    candidates = [_candidate(m, model, hardware, gpus, workload, derates, ruleset)
                  for runtime, m in chosen.items() if not runtimes or runtime in runtimes]
    notes = context_notes + _rank(candidates)
    summary = _summary(candidates, workload)
    viable = [c for c in candidates if c.verdict != "excluded"]
    if workload.request_rate and viable and (short := _beyond_capacity(viable, hardware, gpus, workload)):
        # Every runtime queues without bound at this rate: what each serves within the SLO on
        # these devices orders them, not the little the overload leaves.
        candidates.sort(key=lambda c: (VERDICT_ORDER[c.verdict], -_capacity(c)))
        summary, explore = short, False
        notes = [*notes, "Ranked by the most one deployment serves within the SLO (the peak of its simulated goodput "
                         "curve): at this rate every runtime queues without bound, and the simulated figures show "
                         "that overload."]
    if not viable and any(r["rule"] == "does-not-fit" for c in candidates for r in c.reasons):
        summary += " " + _what_would_fit(chosen, model, hardware, gpus, workload)
    alternatives = []
    if explore and viable and not any(c.verdict == "recommended" for c in viable):
        alternatives = _alternatives(model, hardware, gpus, workload, derates, runtimes, viable)
        summary += " " + "; ".join(
            f"{a['change']}: {a['runtime']} at {a['goodput_requests_per_s']:.2f} req/s" if a["meets_slo"] else
            f"{a['change']}: still none" for a in alternatives) + "."
    return Report(model=_model_facts(model), hardware=asdict(hardware) | {"gpus": gpus},
                  workload=asdict(workload), assumptions=asdict(derates) | _memory_assumptions(hardware),
                  candidates=candidates, summary=summary, notes=notes, alternatives=alternatives)


def _alternatives(model: ModelSpec, hw: Hardware, gpus: int, workload: Workload, derates: Derates,
                  runtimes: list[str] | None, viable: list[Candidate]) -> list[dict]:
    """What would meet the SLO, each estimated by the same model: lighter weights (in formats this
    kind of device runs), more devices of this kind, or the SLO the fastest candidate reaches at
    this load."""
    tries = []
    fmt = (workload.weight_quant or model.checkpoint_format).lower()
    # A GPU's runtimes load FP8 and AWQ checkpoints; on a CPU or a Mac it is GGUF's types llama.cpp runs.
    for lighter in ("fp8", "awq") if hw.gpu else ("Q8_0", "Q4_K_M"):
        if bits_per_weight(lighter) < bits_per_weight(fmt):
            tries.append((f"--weight-quant {lighter}", gpus, replace(workload, weight_quant=lighter)))
    if hw.gpu:
        tries += [(f"--gpus {more}", more, workload) for more in (2 * gpus, 4 * gpus)]
    fastest = min(viable, key=lambda c: c.estimates["tpot_ms"])
    ttft, tpot = fastest.estimates["ttft_ms"], fastest.estimates["tpot_ms"]
    if ttft is not None:
        looser = replace(workload, slo_ttft_ms=max(workload.slo_ttft_ms, _round_up(ttft * 1.1)),
                         slo_tpot_ms=max(workload.slo_tpot_ms, _round_up(tpot * 1.1)))
        tries.append((f"--slo-ttft-ms {looser.slo_ttft_ms:g} --slo-tpot-ms {looser.slo_tpot_ms:g}", gpus, looser))
    found = []
    for change, devices, changed in tries:
        try:
            report = advise(model, hw, devices, changed, derates, runtimes, explore=False)
        except ImpossibleRequest:  # e.g. a device count the attention heads do not divide
            continue
        best = max((c for c in report.candidates if c.verdict != "excluded"),
                   key=lambda c: c.estimates.get("goodput_requests_per_s") or 0.0, default=None)
        goodput = (best.estimates.get("goodput_requests_per_s") or 0.0) if best else 0.0
        found.append({"change": change, "runtime": best.name if best else None, "goodput_requests_per_s": goodput,
                      "meets_slo": goodput > 0, "ttft_ms": best.estimates.get("ttft_ms") if best else None,
                      "tpot_ms": best.estimates.get("tpot_ms") if best else None})
    return found


def _round_up(value: float) -> float:
    """Up to two significant figures: an SLO a person would write."""
    scale = 10 ** max(0, math.floor(math.log10(value)) - 1)
    return math.ceil(value / scale) * scale


def calibrated(derates: Derates, estimates: dict, measured: dict) -> tuple[Derates, str]:
    """Derates learned from one measured candidate: the decode term that bound the estimate
    (bandwidth or compute) scaled by estimated / measured TPOT, the prefill compute by estimated /
    measured TTFT, each kept within (0, 1]; and a sentence saying so."""
    changes, said = {}, []
    tpot, ttft = measured.get("median_tpot_ms"), measured.get("median_ttft_ms")
    if tpot and estimates.get("tpot_ms"):
        name = "bandwidth" if estimates["decode_bound"] == "memory" else "decode_compute"
        learned = getattr(derates, name) * estimates["tpot_ms"] / tpot
        changes[name] = min(1.0, learned)
        said.append(f"TPOT {tpot:.1f} ms measured against {estimates['tpot_ms']:.1f} estimated: {name} "
                    f"{getattr(derates, name):g} -> {changes[name]:.3g}" + _capped(learned))
    if ttft and estimates.get("ttft_ms"):
        learned = derates.prefill_compute * estimates["ttft_ms"] / ttft
        changes["prefill_compute"] = min(1.0, learned)
        said.append(f"TTFT {ttft:.0f} ms measured against {estimates['ttft_ms']:.0f} estimated: prefill_compute "
                    f"{derates.prefill_compute:g} -> {changes['prefill_compute']:.3g}" + _capped(learned))
    return replace(derates, **changes), "; ".join(said)


def _capped(learned: float) -> str:
    return (f" (capped at 1 from {learned:.2f}: the runtime beat the device figure, so the figure or the "
            "weight format assumed is off)") if learned > 1 else ""


def default_derates(hardware: Hardware) -> Derates:
    """The published derates turn datasheet peaks into what kernels reach; a measured machine's
    bandwidth (`local`) is already what a kernel reached, so it is not derated again."""
    return Derates(bandwidth=1.0) if hardware.measured else Derates()


def _what_would_fit(chosen: dict[str, Matrix], model: ModelSpec, hw: Hardware, gpus: int,
                    workload: Workload) -> str:
    """The nearest changes that fit: more devices of this kind, and fewer bits per weight in a
    format some runtime loads on this hardware."""
    m = chosen["vllm"]
    fmt = (workload.weight_quant or model.checkpoint_format).lower()
    fixes = []
    if hw.gpu:
        more = next((n for n in (2, 4, 8, 16, 32, 64)
                     if n > gpus and _memory(m, model, hw, n, workload, fmt, m.memory.kv_dtype).fits), None)
        if more:
            fixes.append(f"it fits from {more} x {hw.id} (or on devices with more memory, e.g. h200 or b200)")
    for smaller in ("fp8", "awq", "Q4_K_M"):
        loaders = [x.name for x in chosen.values() if _weight_cell(x, smaller.lower(), hw).status == "yes"]
        if loaders and bits_per_weight(smaller) < bits_per_weight(fmt) and _memory(
                m, model, hw, gpus, workload, smaller, m.memory.kv_dtype).fits:
            fixes.append(f"with {smaller} weights (--weight-quant {smaller}; {', '.join(loaders)} load them here) it "
                         f"fits on {gpus} x {hw.id}")
            break
    return ("Nearest fixes: " + "; ".join(fixes) + ".") if fixes else "Nothing nearby fits: choose larger hardware."


def _candidate(m: Matrix, model: ModelSpec, hw: Hardware, gpus: int, workload: Workload, derates: Derates,
               ruleset: RuleSet) -> Candidate:
    kv_key, kv_cell = _kv_cell(m, workload, hw)
    weight_format = (workload.weight_quant or model.checkpoint_format).lower()
    weight_cell = _weight_cell(m, weight_format, hw)
    plan = _memory(m, model, hw, gpus, workload, weight_format, kv_key)
    context = {
        "runtime": {
            "id": m.runtime, "name": m.name, "maintained": m.maintained.status == "yes",
            "nvidia_only": all(c.status == "no" for f, c in m.hardware.items() if not f.startswith("nvidia")),
            "hardware": m.hardware[hw.family].status, "hardware_note": m.hardware[hw.family].note,
            "runs_on_cpu": m.hardware[hw.family].runs_on == "cpu" and not hw.family.startswith("cpu"),
            "architecture": m.architectures[model.architecture].status if model.architecture in m.architectures
            else "unverified",
            "kv_cache": kv_cell.status if kv_cell else "-", "kv_cache_note": kv_cell.note if kv_cell else "",
            "kv_requires": list(kv_cell.requires) if kv_cell else [],
            "weight_quant": weight_cell.status, "weight_quant_note": weight_cell.note,
            "moe": m.moe["support"].on(hw.family), "expert_parallel": m.moe["expert_parallel"].on(hw.family),
            "prefix_caching": m.features["prefix_caching"].on(hw.family),
            "prefix_caching_default": bool(m.features["prefix_caching"].default),
            "continuous_batching": m.features["continuous_batching"].on(hw.family),
            "tensor_parallel": m.features["tensor_parallel"].on(hw.family),
            **{need: m.features[need].on(hw.family) for need in REQUIREMENTS},
        },
        "model": {"id": model.id, "architecture": model.architecture or "unknown", "moe": model.moe,
                  "params_b": model.params_total / 1e9},
        "hardware": {"id": hw.id, "family": hw.family, "vendor": hw.vendor, "gpus": gpus},
        "workload": {**asdict(workload), "kv_cache_dtype": workload.kv_cache_dtype or "-",
                     "weight_quant": WEIGHT_KEYS.get(weight_format, "gguf") if workload.weight_quant else "-",
                     "request_rate": workload.request_rate or 0.0},
        "memory": {"fits": plan.fits, "max_sequences": plan.max_sequences,
                   "weights_gib": round(plan.weights / GIB, 1), "capacity_gib": round(plan.capacity / GIB, 1)},
    }
    candidate = Candidate(m.runtime, m.name, m.version)
    cells = {"kv_cache": (kv_cell, f"kv_cache.{kv_key}"),
             "weight_quant": (weight_cell, f"weight_quant.{_weight_key(weight_format)}"),
             "hardware": (m.hardware[hw.family], f"hardware.{hw.family}"),
             "architectures": (m.architectures.get(model.architecture), f"architectures.{model.architecture}")}
    for fired in ruleset.evaluate(context):
        rule = fired.rule
        cell, path = cells[rule.cite] if rule.cite in cells else (_cell_at(m, rule.cite), rule.cite)
        candidate.reasons.append({"rule": rule.id, "kind": rule.kind, "reason": fired.reason, "score": rule.score,
                                  "cell": _describe(m, cell) | {"path": path} if cell else None})
        candidate.score += rule.score
        if rule.kind == "exclude":
            candidate.verdict = "excluded"
    candidate.memory = {
        "capacity_gib": plan.capacity / GIB, "weights_gib": plan.weights / GIB, "reserved_gib": plan.reserved / GIB,
        "kv_budget_gib": plan.kv_budget / GIB, "kv_bytes_per_token": plan.kv_bytes_per_token * gpus,
        "kv_bytes_per_token_per_device": plan.kv_bytes_per_token, "kv_tokens": plan.kv_tokens,
        "max_sequences": plan.max_sequences, "context": plan.context, "weight_format": weight_format,
        "kv_dtype": kv_key, "fraction_of": m.memory.fraction_of, "fraction": m.memory.fraction_for(hw.memory_gib, gpus),
        "fraction_status": m.memory.status,
        "features": sum(c.status == "yes" for k, c in m.features.items() if k != "needs_engine_build"),
    }
    if candidate.verdict != "excluded":
        candidate.estimates = _estimates(m, model, hw, gpus, workload, derates, plan, weight_format)
        candidate.estimates["simulated"] = _simulated(m, model, hw, gpus, workload, weight_format, kv_key,
                                                      candidate.estimates.get("goodput_requests_per_s") or 0.0)
        candidate.launch = _launch(m, model, gpus, workload, kv_cell, plan)
    return candidate


def _kv_cell(m: Matrix, workload: Workload, hw: Hardware) -> tuple[str, Cell | None]:
    """The KV dtype asked for and the matrix's cell for it on this hardware (None: the default)."""
    asked = (workload.kv_cache_dtype or "auto").lower()
    key = KV_ALIASES.get(asked, asked)
    if key == "auto":
        return m.memory.kv_dtype, None
    return key, _cell_on(m, m.kv_cache.get(key), hw,
                         f"not among its KV cache types ({', '.join(m.kv_cache) or 'none'})")


def _weight_key(fmt: str) -> str:
    quantized = fmt.upper() in GGUF_BITS or fmt.upper().startswith(("Q", "IQ"))
    return WEIGHT_KEYS.get(fmt.lower(), "gguf" if quantized else fmt)


def _weight_cell(m: Matrix, fmt: str, hw: Hardware) -> Cell:
    return _cell_on(m, m.weight_quant.get(_weight_key(fmt)), hw, f"{fmt} is not in its list")


def _cell_on(m: Matrix, cell: Cell | None, hw: Hardware, missing: str) -> Cell:
    """A cell as it reads on this hardware: `no` where the matrix has none (saying `missing`) or
    where its source says so, `unknown` where its source covers other families only."""
    if cell is None:
        return Cell(status="no", source=m.memory.source, checked=m.memory.checked, note=missing)
    status = cell.on(hw.family)
    if status == cell.status:
        return cell
    where = f"holds on {', '.join(cell.hardware)}"
    note = (f"not on {hw.family}; {where}" if status == "no" else
            f"its source does not cover {hw.family} ({where})")
    return cell.model_copy(update={"status": status, "note": f"{note}: {cell.note}" if cell.note else note})


def _memory(m: Matrix, model: ModelSpec, hw: Hardware, gpus: int, workload: Workload, fmt: str, kv_key: str):
    capacity = hw.memory_gib * GIB
    held = m.memory.compute_dtype or fmt
    exact = model.weights_bytes if model.weights_bytes and held == model.checkpoint_format.lower() else None
    adapters = workload.lora_slots * model.lora_params(workload.lora_rank) * 2  # bf16, on every device's share
    weights = ((exact or model.weight_bytes(held)) + adapters) / gpus
    reserved = reserved_bytes(hw.gpu, gpus, weights, m.memory.reserve_gib if hw.gpu else None)
    if m.memory.fraction_covers == "weights_and_kv":  # activations and graphs are already outside the fraction
        reserved = 0.0
    if m.memory.fraction_of == "none":
        capacity_used, fraction = capacity * hw.usable_share, None
    else:
        capacity_used, fraction = capacity, m.memory.fraction_for(hw.memory_gib, gpus)
    context = workload.prompt_tokens + workload.output_tokens
    per_token = kv_bytes_per_token(model.arch, kv_key if kv_key in KV_DTYPE_BYTES else "bf16", tp=gpus,
                                   context=context)
    return memory_plan(capacity_used, weights, per_token, context, m.memory.fraction_of, fraction, reserved)


def _estimates(m: Matrix, model: ModelSpec, hw: Hardware, gpus: int, workload: Workload, derates: Derates, plan,
               fmt: str) -> dict:
    held = m.memory.compute_dtype or fmt
    fp8 = held == "fp8" and hw.fp8_tflops
    tflops = hw.fp8_tflops if fp8 else hw.bf16_tflops
    # Tensor parallelism reads every device's share at once; a layer split (llama.cpp's -sm layer)
    # passes each token through the devices one after another, at one device's speed.
    parallel = gpus if m.features["tensor_parallel"].on(hw.family) == "yes" else 1
    roof = Roofline(hw.bandwidth_gbs * 1e9 * parallel, tflops * 1e12 * parallel if tflops else None, derates)
    caches = m.features["prefix_caching"].on(hw.family) == "yes"
    prompt = max(1, round(workload.prompt_tokens * (1 - workload.prefix_reuse))) if caches else workload.prompt_tokens

    link = hw.link_gbs if parallel <= workload.gpus_per_node else NETWORK_GBS  # a group across nodes

    def collectives(tokens: int) -> float:
        return tensor_parallel_seconds(tokens, model.hidden_size, model.arch.layers, parallel, link)

    ttft = roof.prefill(model.params_active, prompt, model.arch.layers, model.attention_dim,
                        model.weight_bytes(held, tokens=prompt))
    if ttft is not None:
        ttft += collectives(prompt)
    mean_context = workload.prompt_tokens + workload.output_tokens / 2
    kv_total = plan.kv_bytes_per_token * gpus

    def terms(batch: int) -> tuple[float, float]:
        lora = model.lora_params(workload.lora_rank) if workload.lora_slots else 0.0
        adapters = min(workload.lora_slots, batch) * lora * 2  # each adapter the batch mixes, read once
        return roof.decode_terms(model.weight_bytes(held, tokens=batch) + adapters, batch * mean_context * kv_total,
                                 model.params_active + lora, batch)

    def tpot(batch: int) -> float:
        """A decode step: the weights its batch reads (a MoE layer's union of experts), the KV,
        and the tensor-parallel collectives, which the step waits for."""
        return max(terms(batch)) + collectives(batch)

    concurrency = workload.concurrency
    # What one deployment finishes per second at its largest batch: a rate beyond it queues
    # without bound, so it needs more replicas rather than a Little's-law fixed point.
    most = max(1, plan.max_sequences)
    capacity = most / ((ttft or 0) + workload.output_tokens * tpot(most))
    replicas = math.ceil(workload.request_rate / capacity) if workload.request_rate else 1
    if workload.request_rate and replicas == 1:  # Little's law: requests in flight = rate x time each spends
        for _ in range(20):
            e2e = (ttft or 0) + workload.output_tokens * tpot(max(1, concurrency))
            concurrency = min(most, max(1, round(workload.request_rate * e2e)))
    elif workload.request_rate:
        concurrency = most
    batch = max(1, min(concurrency, plan.max_sequences))
    slo_batch = _largest(lambda b: tpot(b) * 1000 <= workload.slo_tpot_ms, plan.max_sequences)
    meets_ttft = ttft is not None and ttft * 1000 <= workload.slo_ttft_ms
    goodput = None if ttft is None else 0.0  # unknown without a FLOPS figure for the prefill
    if slo_batch and meets_ttft:
        goodput = slo_batch / (ttft + workload.output_tokens * tpot(slo_batch))
    memory_s, compute_s = terms(batch)
    return {
        "ttft_ms": ttft * 1000 if ttft is not None else None, "tpot_ms": tpot(batch) * 1000,
        "batch": batch, "queued": max(0, concurrency - plan.max_sequences) if replicas == 1 else None,
        "capacity_requests_per_s": capacity, "replicas_needed": replicas,
        "decode_tokens_per_s_single": 1 / tpot(1), "throughput_tokens_per_s": batch / tpot(batch),
        "max_batch_within_tpot_slo": slo_batch, "goodput_requests_per_s": goodput,
        "meets_slo": None if ttft is None else bool(replicas == 1 and meets_ttft
                                                    and tpot(batch) * 1000 <= workload.slo_tpot_ms),
        "prefilled_prompt_tokens": prompt, "flops_known": tflops is not None,
        "decode_weight_gb_per_step": model.weight_bytes(held, tokens=batch) / 1e9,
        "experts_read_per_layer": model.experts.touched(batch) if model.experts else None,
        "collectives_ms_per_step": collectives(batch) * 1000,
        "decode_bound": "memory" if memory_s >= compute_s else "compute",
    }


def _simulated(m: Matrix, model: ModelSpec, hw: Hardware, gpus: int, workload: Workload, fmt: str,
               kv_key: str, anchor: float) -> dict:
    """The runtime's own scheduler run over this workload (advisor.perf): p50/p90/p99 TTFT, TPOT
    and end-to-end, throughput, goodput at the SLO, and the range the calibration gives estimates
    in these regimes. Empty where the model does not fit the runtime's memory."""
    from .perf.calibration import regimes
    from .perf.deployment import Deployment
    from .perf.efficiency import fitted
    from .perf.predict import predict
    from .perf.simulate import TRAFFIC_SPREAD, Traffic

    split = m.features["tensor_parallel"].on(hw.family) == "yes"
    held = m.memory.compute_dtype or fmt
    kv = kv_key if kv_key in KV_DTYPE_BYTES else "bf16"
    d = Deployment(m.runtime, hw, tp=gpus if split else 1, pp=1 if split else gpus, weights=held, kv=kv,
                   gpus_per_node=workload.gpus_per_node, lora_slots=workload.lora_slots, lora_rank=workload.lora_rank)
    caches = m.features["prefix_caching"].on(hw.family) == "yes" and bool(m.features["prefix_caching"].default)
    rate = workload.request_rate
    traffic = Traffic(workload.prompt_tokens, workload.output_tokens, load="rate" if rate else "concurrency",
                      concurrency=workload.concurrency, rate=rate or 0.0,
                      requests=400 if rate else max(8 * workload.concurrency, 64),
                      prefix_reuse=workload.prefix_reuse if caches else 0.0, spread=TRAFFIC_SPREAD)
    figures = predict(model, d, traffic, accepted=workload.accepted_per_step, drafts=workload.draft_tokens)
    if not figures.fits:
        return {}
    tags = regimes(workload.prompt_tokens, workload.output_tokens, model.moe, held, hw, gpus)
    low, high = fitted().range_for(tags)
    # Goodput as the offered rate grows to past what the roofline says one deployment serves.
    top = max(anchor, 0.1)
    curve = []
    for share in CURVE_SHARES:
        offered = replace(traffic, load="rate", rate=top * share, requests=300)
        at = predict(model, d, offered, accepted=workload.accepted_per_step, drafts=workload.draft_tokens)
        curve.append([top * share, at.goodput(workload.slo_ttft_ms, workload.slo_tpot_ms)])
    return {**figures.summary(), "goodput_requests_per_s": figures.goodput(workload.slo_ttft_ms, workload.slo_tpot_ms),
            "range": [low, high], "regimes": tags, "deployment": d.describe(), "goodput_curve": curve}


def _largest(ok, limit: int) -> int:
    """The largest b in [1, limit] with ok(b), for ok true up to some point; 0 if none."""
    low, high = 0, limit
    while low < high:
        mid = (low + high + 1) // 2
        if ok(mid):
            low = mid
        else:
            high = mid - 1
    return low


def _launch(m: Matrix, model: ModelSpec, gpus: int, workload: Workload, kv_cell: Cell | None, plan) -> dict:
    """Ready commands: `servegate launch` and the runtime's own line (built by backends.launch,
    the one flag-translation table), or the matrix's template; and the gateway backend entry.
    Each request may run to the longest context asked for (the model's own by default) as far as
    the KV cache holds one; LoRA adapters are loaded at start."""
    from backends.launch import LaunchError, LaunchSpec, servegate_line, shell_line

    out: dict = {}
    longest = workload.max_context or model.max_context or workload.prompt_tokens + workload.output_tokens
    context = min(longest, plan.kv_tokens)
    if context < longest:
        out["context_note"] = (f"the KV cache holds {plan.kv_tokens:,} tokens here: requests are capped at {context:,} "
                               f"of the {longest:,} asked for")
    slots = max(1, min(workload.concurrency, plan.max_sequences))
    kv = (workload.kv_cache_dtype or "").lower() or None
    adapters = _adapters(workload)
    if m.launch.servegate:
        spec = LaunchSpec(runtime=m.launch.servegate, model=model.id, port=8001, context_length=context,
                          tensor_parallel=gpus, expert_parallel=workload.expert_parallel,
                          kv_cache_dtype=kv if kv and kv_cell else None, max_running_requests=slots,
                          kv_tokens=min(plan.kv_tokens, slots * context) if m.memory.fraction_of == "none" else None,
                          lora_modules=adapters, max_loras=workload.lora_slots or None,
                          max_lora_rank=workload.lora_rank if adapters else None)
        try:
            out["runtime_command"] = shell_line(spec, portable=True)
        except LaunchError as exc:
            out["note"] = str(exc)
        else:
            out["servegate_command"] = servegate_line(spec)
    else:
        lora = m.features["multi_lora"]
        pairs = " ".join(f"{name}={path}" for name, path in adapters.items())
        text = m.launch.command.format(model=model.id, tp=gpus, context=context, slots=slots,
                                       kv=kv_cell.flag if kv_cell and kv_cell.flag else "",
                                       lora=f"{lora.flag} {pairs}" if adapters and lora.flag else "")
        expert = m.moe["expert_parallel"]
        if workload.expert_parallel and expert.flag:  # LMDeploy's --ep N, TensorRT-LLM's --ep_size N
            text += f" {expert.flag} {gpus}"
        out["runtime_command"] = " ".join(text.split())
        if adapters and not lora.flag:
            out["note"] = f"{m.name} takes LoRA adapters otherwise than by a launch flag: {lora.note}"
    if m.runtime in ("llama-cpp", "ollama") and not model.id.endswith(".gguf"):
        out["note"] = ("llama.cpp serves GGUF files: convert the checkpoint (convert_hf_to_gguf.py) or pass a .gguf"
                       + (", and the adapters (convert_lora_to_gguf.py)" if adapters else ""))
    if adapters and not workload.lora_paths:
        out["lora_note"] = (f"the adapter paths are placeholders for the {workload.lora_adapters} adapters asked for: "
                            "give them with --lora NAME=PATH")
    kind = serving(m.runtime)
    out["gateway_backend"] = ({"name": "local", "kind": kind.id} if kind is not None and not kind.remote else
                              {"name": m.runtime, "kind": kind.id if kind else "openai", "url": "http://127.0.0.1:8001",
                               "model": model.id})
    return out


def _adapters(workload: Workload) -> dict[str, str]:
    """The LoRA adapters to load at start: those given, else placeholders for the count asked for."""
    if workload.lora_paths:
        return lora_modules(workload.lora_paths)
    return {f"adapter-{i}": f"./adapters/adapter-{i}" for i in range(1, workload.lora_adapters + 1)}


def _rank(candidates: list[Candidate]) -> list[str]:
    """Order the candidates and say what decided. Where both carry the simulation's goodput and its
    calibrated range, they are indistinguishable when the ranges overlap (and the rules do not
    separate them); otherwise scores within SCORE_TIE of the best are a tie. A lead that rests
    only on unverified cells is a tie too: every such candidate is recommended, and the notes say
    why and what would separate them. Never a tie-break by name. When no candidate meets the SLO,
    none is recommended."""
    def goodput(c: Candidate) -> float:
        return (c.estimates.get("simulated") or c.estimates).get("goodput_requests_per_s") or 0.0

    best = max(map(goodput, candidates), default=0.0) or 1.0
    estimated = {}
    for c in candidates:
        if c.verdict != "excluded":
            estimated[c.runtime] = 3 * goodput(c) / best
            c.score += estimated[c.runtime] + 0.1 * c.memory["features"]
    candidates.sort(key=lambda c: (VERDICT_ORDER[c.verdict], -c.score))
    viable = [c for c in candidates if c.verdict != "excluded"]
    if not viable or all(goodput(c) == 0 for c in viable):
        return []
    top, notes = viable[0], []
    top.verdict = "recommended"
    for other in viable[1:]:
        lead = top.score - other.score
        unverified, cells = _unverified_lead(top, other, estimated)
        ranges = _goodput_ranges(top, other)
        if ranges is not None:
            (low, high), (other_low, other_high) = ranges
            by_rules = lead - (estimated[top.runtime] - estimated[other.runtime])
            if other_high >= low and by_rules <= SCORE_TIE:
                other.verdict = "recommended"
                notes.append(f"{top.name} and {other.name} are indistinguishable: their goodput ranges "
                             f"({low:.2f}-{high:.2f} and {other_low:.2f}-{other_high:.2f} req/s, from the "
                             f"calibration's error in these regimes) overlap; measure both (--measure "
                             f"{top.runtime}=URL --measure {other.runtime}=URL).")
                continue
            if other_high < low and by_rules <= SCORE_TIE:
                continue
        if lead <= SCORE_TIE:
            other.verdict = "recommended"
            notes.append(f"{top.name} and {other.name} tie (scores {top.score:.2f} and {other.score:.2f}): the "
                         f"estimates cannot separate them; measure both (--measure {top.runtime}=URL "
                         f"--measure {other.runtime}=URL).")
        elif lead - unverified <= SCORE_TIE:
            other.verdict = "recommended"
            notes.append(f"{top.name} leads {other.name} by {lead:.2f} only through unverified cells "
                         f"({'; '.join(cells)}): treated as a tie; measure both (--measure {top.runtime}=URL "
                         f"--measure {other.runtime}=URL).")
    return notes


def _goodput_ranges(a: Candidate, b: Candidate) -> tuple[tuple[float, float], tuple[float, float]] | None:
    """Each candidate's simulated goodput times the low and high factors of its calibrated range."""
    out = []
    for c in (a, b):
        sim = c.estimates.get("simulated") or {}
        if "range" not in sim:
            return None
        g = sim["goodput_requests_per_s"]
        out.append((g * sim["range"][0], g * sim["range"][1]))
    return out[0], out[1]


def _unverified_lead(a: Candidate, b: Candidate, estimated: dict[str, float]) -> tuple[float, list[str]]:
    """How much of a's lead over b comes from unverified cells: soft rules citing one, and the
    goodput estimate where either memory fraction (which sets how many sequences fit) is unverified."""
    amount, cells = 0.0, []
    for sign, c in ((1, a), (-1, b)):
        for r in c.reasons:
            if r["kind"] == "score" and r["cell"] and r["cell"]["status"] == "unverified":
                amount += sign * r["score"]
                cells.append(f"{c.name} {r['cell']['path']}")
    loose = [c for c in (a, b) if c.memory["fraction_status"] != "yes"]
    if loose:
        amount += estimated[a.runtime] - estimated[b.runtime]
        cells += [f"{c.name}'s memory fraction {c.memory['fraction']}" for c in loose]
    return amount, cells


def _capacity(c: Candidate) -> float:
    """The most requests/s one deployment serves within the SLO: the peak of its simulated goodput
    curve, else the roofline's."""
    curve = (c.estimates.get("simulated") or {}).get("goodput_curve")
    return max(y for _, y in curve) if curve else c.estimates.get("goodput_requests_per_s") or 0.0


def _beyond_capacity(viable: list[Candidate], hw: Hardware, gpus: int, workload: Workload) -> str | None:
    """Where the asked rate is beyond what every viable runtime serves within the SLO on these
    devices: none is recommended, and the answer is how many devices the best one would need."""
    best = max(viable, key=_capacity)
    most = _capacity(best)
    if most >= workload.request_rate:
        return None
    for c in viable:
        c.verdict = "viable"
    if not most:
        return None  # none meets the SLO at any rate: the summary already says so
    replicas = math.ceil(workload.request_rate / most)
    return (f"Not servable on {gpus} x {hw.id}: {workload.request_rate:g} req/s is beyond what any runtime serves "
            f"there within the SLO (best: {best.name} at {most:.2f} req/s); it needs at least "
            f"{replicas * gpus:,} x {hw.id} ({replicas:,} replicas of {gpus}).")


def _summary(candidates: list[Candidate], workload: Workload) -> str:
    viable = [c for c in candidates if c.verdict != "excluded"]
    if not viable:
        return "no runtime fits: " + "; ".join(
            f"{c.name}: {next(r['reason'] for r in c.reasons if r['kind'] == 'exclude')}" for c in candidates)
    top = [c.name for c in viable if c.verdict == "recommended"]
    if not top:
        return (f"No runtime meets this SLO (TTFT <= {workload.slo_ttft_ms:g} ms, TPOT <= {workload.slo_tpot_ms:g} "
                f"ms): {len(viable)} can serve the model, none within it.")
    lead = f"{top[0]} is recommended" if len(top) == 1 else f"{', '.join(top[:-1])} and {top[-1]} are recommended"
    return (f"{lead}; {len(viable) - len(top)} other runtime(s) viable, {len(candidates) - len(viable)} excluded. "
            f"Confirm with `servegate advise ... --measure`.")


def _cell_at(m: Matrix, path: str | None) -> Cell | None:
    if not path:
        return None
    node: object = m
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else getattr(node, part, None)
    return node if isinstance(node, Cell) else None


def _describe(m: Matrix, cell: Cell) -> dict:
    return {"status": cell.status, "note": cell.note, "source": m.sources[cell.source].ref if cell.source in m.sources
            else cell.source, "checked": cell.checked, "line": cell.line}


def _model_facts(model: ModelSpec) -> dict:
    return {"id": model.id, "architecture": model.architecture, "params_total": model.params_total,
            "params_active": model.params_active, "moe": model.moe, "max_context": model.max_context,
            "checkpoint_format": model.checkpoint_format, "kv_layout": "MLA" if model.arch.mla else "GQA/MHA",
            "source": model.source}


def _memory_assumptions(hw: Hardware) -> dict:
    own = ", ".join(f"{m.name} {m.memory.reserve_gib:g} GiB" for m in matrices().values() if m.memory.reserve_gib)
    return {"reserved": f"3.5 GB other (+0.4 GB NCCL with tensor parallelism) per GPU, after AIConfigurator; "
                        f"runtimes that keep their own: {own}"
                        if hw.gpu else "0.8 GB + 5% of the weights, after tools.metakraftlabs.com",
            "usable_share_without_fraction": hw.usable_share}
