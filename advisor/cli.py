"""`servegate advise`: a runtime selection report for a model, hardware and workload."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from backends.runtimes import RUNTIMES

from .advise import ImpossibleRequest, Report, Workload, advise, calibrated, default_derates
from .capacity import Derates, MissingArchitectureField
from .hardware import UnknownHardware, catalogue
from .hardware import resolve as resolve_hardware
from .model_facts import UnknownModel
from .model_facts import resolve as resolve_model
from .report import to_html, to_json, to_markdown

console = Console(stderr=True)


def advise_command(
    model: Annotated[str | None, typer.Option(help="Catalogue id (e.g. meta-llama/Llama-3.1-70B-Instruct), or a local "
                                                   "config.json, model directory or .gguf file.")] = None,
    hardware: Annotated[str, typer.Option(help="Catalogue id (h100-sxm, h200, a100-80gb, l4, mi300x, m3-max, "
                                               "cpu-x86, ...) or `local` to measure this machine.")] = "local",
    gpus: Annotated[int, typer.Option(help="Devices, split by tensor parallelism.", min=1)] = 1,
    workload: Annotated[str, typer.Option(help="chat | agent | batch | rag")] = "chat",
    prompt_tokens: Annotated[int, typer.Option()] = 1024,
    output_tokens: Annotated[int, typer.Option()] = 256,
    trace: Annotated[Path | None, typer.Option(help="JSONL trace or bench dataset: prompt and output sizes are "
                                                    "taken from its mean (input_length/prompt_tokens, "
                                                    "output_length/max_tokens).")] = None,
    prefix_reuse: Annotated[float, typer.Option(help="Share of each prompt seen before (0-1).")] = 0.0,
    concurrency: Annotated[int, typer.Option(help="Requests in flight.")] = 16,
    request_rate: Annotated[float | None, typer.Option(help="Requests/s instead of a concurrency.")] = None,
    slo_ttft_ms: Annotated[float, typer.Option()] = 2000.0,
    slo_tpot_ms: Annotated[float, typer.Option()] = 50.0,
    kv_cache_dtype: Annotated[str | None, typer.Option(help="fp8_e4m3, fp8_e5m2, int8, q8_0, q4_0, ...")] = None,
    weight_quant: Annotated[str | None, typer.Option(help="bf16, fp8, awq, gptq, mxfp4, nvfp4, or a GGUF type "
                                                          "(Q4_K_M, Q8_0, ...).")] = None,
    new_deployment: Annotated[bool, typer.Option("--new-deployment/--existing-tgi",
                                                 help="A new deployment, or an existing TGI fleet.")] = True,
    offline: Annotated[bool, typer.Option(help="An edge or offline box.")] = False,
    expert_parallel: Annotated[bool, typer.Option(
        "--expert-parallel", help="Serve a MoE model's experts expert-parallel: runtimes without it are excluded "
                                  "and the launch lines carry their flag (default: tensor parallelism only).")] = False,
    structured_output: Annotated[bool, typer.Option(
        "--structured-output", help="Require JSON-schema or grammar-constrained output.")] = False,
    multi_lora: Annotated[bool, typer.Option("--multi-lora", help="Require serving several LoRA adapters.")] = False,
    lora_adapters: Annotated[int, typer.Option(help="LoRA adapters served beside the model: their memory and compute "
                                                    "count in the estimate, and the launch lines load them.")] = 0,
    lora_rank: Annotated[int, typer.Option(help="The largest adapter's rank.")] = 16,
    lora: Annotated[list[str] | None, typer.Option(help="NAME=PATH of an adapter for the launch lines; "
                                                        "repeatable.")] = None,
    max_context: Annotated[int | None, typer.Option(help="The longest request, prompt + output (default: the model's "
                                                         "context): the launch lines' --max-model-len.")] = None,
    speculative_decoding: Annotated[bool, typer.Option(
        "--speculative-decoding", help="Require speculative decoding.")] = False,
    draft_tokens: Annotated[int, typer.Option(help="Speculative tokens verified per decode step (EAGLE, MTP, a "
                                                   "draft model); the simulation costs their verification.")] = 0,
    acceptance: Annotated[float, typer.Option(help="With --draft-tokens: the chance each draft token is accepted "
                                                   "(the runtime's spec-decode metrics report it).")] = 0.0,
    runtimes: Annotated[str | None, typer.Option(help="Only these runtimes, comma-separated.")] = None,
    tflops: Annotated[float | None, typer.Option(help="Dense TFLOPS per device, where the catalogue has none "
                                                      "(Apple GPUs) or to correct it.")] = None,
    bandwidth_gbs: Annotated[float | None, typer.Option(help="Memory bandwidth per device, GB/s.")] = None,
    derate_bandwidth: Annotated[float | None, typer.Option(
        help=f"Share of peak bandwidth reached (default {Derates.bandwidth}; 1 for `local`, measured).")] = None,
    derate_prefill: Annotated[float | None, typer.Option(help=f"Share of peak FLOPS in prefill (default "
                                                             f"{Derates.prefill_compute}).")] = None,
    derate_decode: Annotated[float | None, typer.Option(help=f"Share of peak FLOPS in decode (default "
                                                            f"{Derates.decode_compute}).")] = None,
    measure: Annotated[list[str] | None, typer.Option(
        help="RUNTIME=URL[@MODEL] of a running candidate: benchmark it with `servegate bench` on this workload; "
             "repeatable.")] = None,
    measure_config: Annotated[Path | None, typer.Option(
        "--measure-config", help="servegate.yaml: measure each of its remote backends as the candidate of its "
                                 "runtime, like --measure.", exists=True)] = None,
    num_prompts: Annotated[int, typer.Option(help="Requests per --measure run.")] = 64,
    calibrate: Annotated[bool, typer.Option(
        "--calibrate", help="Learn the derates from the first --measure run and estimate again with them.")] = False,
    output_format: Annotated[str, typer.Option("--format", help="md | html | json")] = "md",
    output: Annotated[Path | None, typer.Option(help="Write the report here (default: stdout).")] = None,
    list_hardware: Annotated[bool, typer.Option("--list-hardware", help="List the hardware catalogue.")] = False,
    calibration: Annotated[bool, typer.Option(
        "--calibration", help="Print the performance model's error against every published measurement of "
                              "policies/catalog/calibration.yaml: per point, per regime, per runtime pair, and with "
                              "each source left out of the fit in turn.")] = False,
    search: Annotated[bool, typer.Option(
        "--search", help="Search deployments of --model over a pool (--hardware x --gpus-per-node x --nodes): "
                         "TP x PP x data/attention-DP x EP, precisions, aggregated or disaggregated, per runtime; "
                         "report the Pareto frontier, the cheapest within --slo and the fewest GPUs for "
                         "--target-rate.")] = False,
    nodes: Annotated[int, typer.Option(help="With --search: nodes in the pool.", min=1)] = 1,
    gpus_per_node: Annotated[int, typer.Option(help="GPUs per node: with --search, of the pool; otherwise tensor "
                                                    "parallelism past a node is priced at the network.",
                                               min=1)] = 8,
    price_per_gpu_hour: Annotated[float | None, typer.Option(help="With --search: $ per GPU-hour.")] = None,
    slo: Annotated[str | None, typer.Option(help="With --search: percentile SLOs, e.g. "
                                                 "'ttft:p90<300ms;tpot:p99<50ms'.")] = None,
    target_rate: Annotated[float | None, typer.Option(help="With --search: requests/s to serve.")] = None,
    refit: Annotated[bool, typer.Option(
        "--refit", help="With --calibration: fit the efficiencies to the points first and write "
                        "policies/catalog/perf-fit.yaml (with each regime's error range).")] = False,
) -> None:
    """Recommend a serving runtime: exclude what the support matrices rule out, rank the rest by
    estimated SLO goodput, and give the commands to start and measure them."""
    if list_hardware:
        _list_hardware()
        return
    if calibration or refit:
        _calibration(refit, output_format, output)
        return
    if search:
        _search(model, hardware, nodes, gpus_per_node, price_per_gpu_hour, slo, target_rate, prompt_tokens,
                output_tokens, runtimes, output_format, output)
        return
    if output_format not in ("md", "html", "json"):
        raise typer.BadParameter(f"{output_format!r}: md, html or json", param_hint="--format")
    if model is None:
        raise typer.BadParameter("a model is required (a catalogue id or a local path)", param_hint="--model")
    for flag, value in (("--tflops", tflops), ("--bandwidth-gbs", bandwidth_gbs)):
        if value is not None and not (0 < value < float("inf")):  # NaN fails both comparisons
            raise typer.BadParameter(f"{value:g}: a device's figure must be a positive, finite number",
                                     param_hint=flag)
    if trace is not None:
        prompt_tokens, output_tokens = _trace_sizes(trace)
    try:
        spec = resolve_model(model)
        device = resolve_hardware(hardware, row_width=spec.hidden_size)
        device = replace(device, bf16_tflops=tflops or device.bf16_tflops,
                         bandwidth_gbs=bandwidth_gbs or device.bandwidth_gbs)
        load = Workload(kind=workload, prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                        prefix_reuse=prefix_reuse, concurrency=concurrency, request_rate=request_rate,
                        slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms, kv_cache_dtype=kv_cache_dtype,
                        weight_quant=weight_quant, new_deployment=new_deployment,
                        existing_tgi=not new_deployment, offline=offline, expert_parallel=expert_parallel,
                        structured_output=structured_output, multi_lora=multi_lora,
                        speculative_decoding=speculative_decoding, draft_tokens=draft_tokens, acceptance=acceptance,
                        lora_adapters=lora_adapters, lora_rank=lora_rank, lora_paths=list(lora or []),
                        max_context=max_context, gpus_per_node=gpus_per_node)
        overrides = {"bandwidth": derate_bandwidth, "prefill_compute": derate_prefill, "decode_compute": derate_decode}
        derates = replace(default_derates(device), **{k: v for k, v in overrides.items() if v is not None})
        report = advise(spec, device, gpus, load, derates,
                        runtimes.split(",") if runtimes else None)
    except (UnknownModel, UnknownHardware, MissingArchitectureField, ImpossibleRequest, FileNotFoundError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    entries = [*(measure or ()), *(_config_entries(measure_config) if measure_config else ())]
    if calibrate and not entries:
        raise typer.BadParameter("learns from a measurement: give --measure or --measure-config",
                                 param_hint="--calibrate")
    measured = {entry: _measure(report, entry, load, num_prompts) for entry in entries}
    first = next((c for c in report.candidates if c.measured and c.estimates), None)
    if calibrate and first is not None:
        learned, how = calibrated(derates, first.estimates, first.measured)
        report = advise(spec, device, gpus, load, learned, runtimes.split(",") if runtimes else None)
        report.assumptions["calibration"] = f"learned from {first.name}: {how}"
        for entry, figures in measured.items():
            _attach(report, entry, figures)
    text = {"md": to_markdown, "html": to_html, "json": to_json}[output_format](report)
    if output:
        output.write_text(text)
        console.print(f"{report.summary}\nreport written to {output}")
    else:
        typer.echo(text)


def _search(model: str | None, hardware: str, nodes: int, gpus_per_node: int, price: float | None, slo: str | None,
            target_rate: float | None, prompt_tokens: int, output_tokens: int, runtimes: str | None,
            output_format: str, output: Path | None) -> None:
    from .perf import frontier
    from .perf.search import BadSLO, Pool, parse_slos
    from .perf.search import search as run_search

    if model is None:
        raise typer.BadParameter("a model is required (a catalogue id or a local path)", param_hint="--model")
    for flag, value in (("--price-per-gpu-hour", price), ("--target-rate", target_rate)):
        if value is not None and not (value > 0 and value != float("inf")):
            raise typer.BadParameter(f"{value:g}: must be a positive number", param_hint=flag)
    if prompt_tokens < 1 or output_tokens < 1:
        raise typer.BadParameter("--prompt-tokens and --output-tokens must be at least 1")
    try:
        spec = resolve_model(model)
        device = resolve_hardware(hardware, row_width=spec.hidden_size)
        slos = parse_slos(slo or "ttft:p90<2000ms;tpot:p90<50ms")
    except (UnknownModel, UnknownHardware, MissingArchitectureField, BadSLO, FileNotFoundError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    chosen = runtimes.split(",") if runtimes else ["vllm", "sglang", "tensorrt-llm", "lmdeploy"] if device.gpu \
        else ["builtin", "vllm", "llama-cpp"]
    unknown = [r for r in chosen if r not in KNOWN_RUNTIMES]
    if unknown:
        raise typer.BadParameter(f"unknown runtimes {unknown}: choose from {', '.join(KNOWN_RUNTIMES)}",
                                 param_hint="--runtimes")
    result = run_search(spec, Pool(device, gpus_per_node, nodes, price), prompt_tokens, output_tokens, slos, chosen,
                        target_rate)
    title = (f"{spec.id} on {nodes} x {gpus_per_node} x {device.id}, {prompt_tokens} prompt + {output_tokens} "
             f"output tokens, {slo or 'ttft:p90<2000ms;tpot:p90<50ms'}")
    text = {"md": frontier.to_markdown, "html": frontier.to_html}.get(output_format, lambda r, _: frontier.to_json(r))(
        result, title) if output_format != "json" else frontier.to_json(result)
    if output:
        output.write_text(text)
        console.print(f"{result['searched']} options; report written to {output}")
    else:
        typer.echo(text)


KNOWN_RUNTIMES = ("vllm", "sglang", "tensorrt-llm", "lmdeploy", "llama-cpp", "tgi", "builtin", "ollama")


def _calibration(refit: bool, output_format: str, output: Path | None) -> None:
    from .perf.calibration import calibrate, intervals, points, to_page
    from .perf.efficiency import FIT, fitted
    from .perf.fit import fit, left_out

    eff = fit(points(), fitted(), rounds=4) if refit else fitted()
    report = calibrate(eff, left_out(points(), eff))
    if refit:
        import yaml

        FIT.write_text(FIT_HEADER + yaml.safe_dump({**eff.to_dict(), "residuals": intervals(report)},
                                                   sort_keys=False))
        console.print(f"fitted on {len(points())} points, written to {FIT}")
    text = json.dumps(report.to_dict(), indent=2) if output_format == "json" else to_page(report)
    if output:
        output.write_text(text)
    else:
        typer.echo(text)


FIT_HEADER = ("# Written by `servegate advise --calibration --refit`: the performance model's efficiencies fitted to\n"
              "# policies/catalog/calibration.yaml, and per regime the 10th-90th percentile of measured / estimated\n"
              "# with each point's source left out of the fit (the range every estimate carries).\n")


def _list_hardware() -> None:
    table = Table("id", "device", "family", "memory GiB", "GB/s", "BF16 TFLOPS", "FP8 TFLOPS")
    for h in catalogue().values():
        table.add_row(h.id, h.name, h.family, f"{h.memory_gib:g}", f"{h.bandwidth_gbs:g}",
                      f"{h.bf16_tflops:g}" if h.bf16_tflops else "-", f"{h.fp8_tflops:g}" if h.fp8_tflops else "-")
    table.add_row("local", "this machine, measured when asked", "cpu-x86 / cpu-arm", "", "", "", "")
    Console().print(table)


def _trace_sizes(path: Path) -> tuple[int, int]:
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        raise typer.BadParameter(f"{path}: no such file", param_hint="--trace") from None
    except (json.JSONDecodeError, UnicodeDecodeError, IsADirectoryError) as exc:
        raise typer.BadParameter(f"{path}: not a JSONL trace ({exc})", param_hint="--trace") from None
    if not rows:
        raise typer.BadParameter(f"{path} holds no requests", param_hint="--trace")
    try:
        prompts = [int(r.get("input_length", r.get("prompt_tokens"))) for r in rows]
        outputs = [int(r.get("output_length", r.get("max_tokens"))) for r in rows]
        if min(prompts) < 1 or min(outputs) < 1:
            raise ValueError
    except (TypeError, ValueError, AttributeError, OverflowError):
        raise typer.BadParameter(f"{path}: every line needs input_length (or prompt_tokens) and output_length "
                                 "(or max_tokens), positive integers", param_hint="--trace") from None
    return round(sum(prompts) / len(prompts)), round(sum(outputs) / len(outputs))


# servegate.yaml backend kinds -> the runtime (support matrix) they run, for the remote ones.
KIND_RUNTIME = {r.id: r.matrix for r in RUNTIMES.values() if r.remote and r.matrix}


def _config_entries(path: Path) -> list[str]:
    """RUNTIME=URL@MODEL for each backend of a servegate.yaml that runs a runtime the advisor ranks."""
    import yaml

    backends = (yaml.safe_load(path.read_text()) or {}).get("backends") or []
    entries = [f"{KIND_RUNTIME[b['kind']]}={b['url']}@{b.get('model', '')}"
               for b in backends if isinstance(b, dict) and b.get("kind") in KIND_RUNTIME and b.get("url")]
    if not entries:
        raise typer.BadParameter(f"{path} has no remote backend of a ranked runtime ({', '.join(KIND_RUNTIME)})",
                                 param_hint="--measure-config")
    return entries


def _measure(report: Report, entry: str, load: Workload, num_prompts: int) -> dict:
    """Benchmark one running candidate with `servegate bench`'s machinery on this workload (fixed
    concurrency, the report's SLO) and put the figures beside the estimate."""
    import asyncio
    import math

    from .measure.cli import build_dataset, load_tokenizer, make_target, run_once

    runtime, _, url = entry.partition("=")
    url, _, served = url.partition("@")
    if not any(c.runtime == runtime for c in report.candidates) or not url:
        raise typer.BadParameter(f"{entry!r}: RUNTIME=URL[@MODEL] with RUNTIME one of "
                                 f"{', '.join(c.runtime for c in report.candidates)}", param_hint="--measure")
    opts = {"random_input_len": load.prompt_tokens, "random_output_len": load.output_tokens,
            "random_range_ratio": 0.0}
    conversations = build_dataset("random", load_tokenizer(None), num_prompts, 0, opts)
    slo = {"ttft": load.slo_ttft_ms, "tpot": load.slo_tpot_ms}

    async def run() -> dict:
        target = make_target(url, "openai", None, served or None, os.environ.get("OPENAI_API_KEY"))
        await target.prepare()
        try:
            return await run_once(target, conversations, math.inf, 1.0, 0, load.concurrency, 1, slo, False)
        finally:
            await target.close()

    figures = asyncio.run(run())
    _attach(report, entry, figures)
    return figures


def _attach(report: Report, entry: str, figures: dict) -> None:
    """A measurement beside its candidate's estimate, with how far off the estimate was."""
    candidate = next(c for c in report.candidates if c.runtime == entry.partition("=")[0])
    estimate = candidate.estimates.get("goodput_requests_per_s")
    measured = figures.get("request_goodput") or 0.0
    candidate.measured = {key: figures.get(key) for key in (
        "request_goodput", "request_throughput", "output_throughput", "median_ttft_ms", "median_tpot_ms",
        "completed", "failed")}
    candidate.measured["off_by"] = (estimate - measured) / measured if estimate is not None and measured else None
