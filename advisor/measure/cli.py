"""`servegate bench`: flags follow `vllm bench serve` where it has one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from typer.core import TyperCommand

from backends.launch import ServerNotReady

from .arrivals import arrival_times
from .baselines import SYSTEMS, system_flags, system_of, system_target
from .datasets import (
    DATASETS,
    Conversation,
    multi_turn_dataset,
    random_dataset,
    shared_prefix_dataset,
    spread_models,
    trace_dataset,
)
from .metrics import knee, kv_summary, parse_goodput, summarize
from .plot import plot_sweep
from .runner import measure, peak_memory, run_workload, sample_engine

console = Console(stderr=True)
SHOWN = (  # the summary keys printed after a run (the JSON holds them all)
    "completed", "failed", "duration", "request_throughput", "request_goodput", "output_throughput",
    "total_token_throughput", "total_cached_tokens", "kv_peak_blocks_used", "kv_live_token_fraction",
    "preemptions", "mean_queue_delay_ms", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
    "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms", "peak_memory_mib",
)


def load_tokenizer(path: str | None):
    from transformers import AutoTokenizer

    from backends.builtin.worker.loader import default_model_path, gguf_to_hf_dir

    source = Path(path) if path else default_model_path()
    return AutoTokenizer.from_pretrained(gguf_to_hf_dir(source) if source.suffix == ".gguf" else source)


def _builtin(model: str):
    from backends.builtin import BuiltinBackend, EngineConfig

    return BuiltinBackend(EngineConfig(model=model))


def _llama_cpp(model: str):
    """One `Llama` on every core, as llama-cpp-python's server runs it."""
    from backends.llamacpp import LlamaCppBackend, LlamaCppConfig

    return LlamaCppBackend(LlamaCppConfig(model=model, slots=1))


IN_PROCESS = {"builtin": _builtin, "llama-cpp": _llama_cpp}


def make_target(target: str | None, protocol: str, backend: str | None, model: str | None, api_key: str | None):
    from .targets import BackendTarget, OpenAITarget, TGITarget

    if backend:
        if backend not in IN_PROCESS:
            raise typer.BadParameter(f"unknown backend {backend!r} (available: {', '.join(IN_PROCESS)})",
                                     param_hint="--backend")
        return BackendTarget(IN_PROCESS[backend](model or ""))
    if not target:
        raise typer.BadParameter("give --target URL or --backend NAME", param_hint="--target")
    if protocol == "tgi":
        return TGITarget(target, api_key)
    if protocol != "openai":
        raise typer.BadParameter(f"unknown protocol {protocol!r} (openai, tgi)", param_hint="--protocol")
    return OpenAITarget(target, model, api_key)


def build_dataset(name: str, tokenizer, num_prompts: int, seed: int, opts: dict) -> list[Conversation]:
    if name == "random":
        return random_dataset(tokenizer, num_prompts, opts["random_input_len"], opts["random_output_len"],
                              opts["random_range_ratio"], seed)
    if name == "shared-prefix":
        groups = opts["gsp_num_groups"]
        return shared_prefix_dataset(tokenizer, groups, max(1, num_prompts // groups), opts["gsp_system_prompt_len"],
                                     opts["gsp_question_len"], opts["gsp_output_len"], seed)
    if name == "multi-turn":
        return multi_turn_dataset(tokenizer, num_prompts, opts["multi_turn_turns"], opts["random_input_len"],
                                  opts["random_output_len"], seed)
    if name == "trace":
        if not opts["trace"]:
            raise typer.BadParameter("--dataset trace needs --trace FILE", param_hint="--trace")
        return trace_dataset(opts["trace"], tokenizer, seed)
    raise typer.BadParameter(f"unknown dataset {name!r} (choose from {', '.join(DATASETS)})", param_hint="--dataset")


async def run_once(target, conversations: list[Conversation], rate: float, burstiness: float, seed: int,
                   max_concurrency: int | None, warmups: int, slo: dict, trace: bool) -> dict:
    for conversation in conversations[:warmups]:
        await measure(target, conversation.prompt(0), conversation.turns[0].max_tokens, 0.0, conversation.model)
    total = sum(len(c.turns) for c in conversations)
    arrivals = None if trace else arrival_times(len(conversations), rate, burstiness, seed)
    columns = (TextColumn(f"rate {rate:g}/s"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("bench", total=total)
        async with sample_engine(target) as samples, peak_memory(target.server_pid) as memory:
            results, duration = await run_workload(target, conversations, arrivals, max_concurrency,
                                                   on_result=lambda _: progress.advance(task))
    summary = summarize(results, duration, slo or None) | kv_summary(samples) | memory
    summary.update(request_rate=rate, burstiness=burstiness, max_concurrency=max_concurrency,
                   ttfts=[r.ttft for r in results], itls=[r.itl for r in results],
                   input_lens=[r.prompt_tokens for r in results], output_lens=[r.output_tokens for r in results],
                   cached_lens=[r.cached_tokens for r in results], errors=[r.error for r in results])
    return summary


def print_summary(summary: dict) -> None:
    table = Table(title=f"request rate {summary['request_rate']:g}/s")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in SHOWN:
        value = summary.get(key)
        table.add_row(key, "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value))
    console.print(table)


COMPARED = ("output_throughput", "request_goodput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
            "median_itl_ms", "median_e2el_ms", "peak_memory_mib", "completed", "failed")


def print_comparison(results: dict[str, dict], names: list[str]) -> None:
    """One table, systems side by side, with the first system's ratio to each other one."""
    first, others = names[0], names[1:]
    table = Table(title="comparison")
    table.add_column("metric")
    for name in names:
        table.add_column(name, justify="right")
    for name in others:
        table.add_column(f"{first} / {name}", justify="right")
    for key in COMPARED:
        values = [results[n].get(key) for n in names]
        cells = ["-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v) for v in values]
        ratios = [f"{values[0] / v:.2f}x" if values[0] is not None and v else "-" for v in values[1:]]
        table.add_row(key, *cells, *ratios)
    console.print(table)


class BenchCommand(TyperCommand):
    """Takes `--goodput ttft:500 tpot:50` as `vllm bench serve` does (one option, several values;
    click options take one value each), besides repeated or quoted."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        spread: list[str] = []
        for arg in args:
            if len(spread) >= 2 and spread[-2] == "--goodput" and ":" in arg and not arg.startswith("-"):
                spread.append("--goodput")
            spread.append(arg)
        return super().parse_args(ctx, spread)


def bench(
    target: Annotated[str | None, typer.Option("--target", "--base-url",
                                               help="Base URL of the server to measure (vLLM: --base-url).")] = None,
    protocol: Annotated[str, typer.Option(help="openai (/v1/completions) | tgi (/generate_stream)")] = "openai",
    backend: Annotated[str | None, typer.Option(
        help="Measure a backend in process instead: builtin, llama-cpp (--model: its weights).")] = None,
    model: Annotated[str | None, typer.Option(help="Model id to ask for (default: the server's first).")] = None,
    api_key: Annotated[str | None, typer.Option(help="Bearer key for the target.", envvar="OPENAI_API_KEY",
                                                show_envvar=True)] = None,
    tokenizer: Annotated[str | None, typer.Option(help="Tokenizer for generated prompts (HF dir or GGUF).")] = None,
    dataset: Annotated[str, typer.Option(help="random | shared-prefix | multi-turn | trace")] = "random",
    num_prompts: Annotated[int, typer.Option(help="Requests (conversations for multi-turn).")] = 100,
    random_input_len: Annotated[int, typer.Option()] = 256,
    random_output_len: Annotated[int, typer.Option()] = 64,
    random_range_ratio: Annotated[float, typer.Option()] = 0.0,
    gsp_num_groups: Annotated[int, typer.Option()] = 8,
    gsp_system_prompt_len: Annotated[int, typer.Option()] = 512,
    gsp_question_len: Annotated[int, typer.Option()] = 64,
    gsp_output_len: Annotated[int, typer.Option()] = 128,
    multi_turn_turns: Annotated[int, typer.Option()] = 3,
    trace: Annotated[str | None, typer.Option(help="JSONL trace for --dataset trace.")] = None,
    lora_modules: Annotated[str | None, typer.Option(
        help="LoRA adapters the target serves, comma-separated: the base model and each adapter take the "
             "conversations (a shared-prefix group each) in turn.")] = None,
    request_rate: Annotated[float, typer.Option(help="Requests/s (inf: all at once).")] = math.inf,
    burstiness: Annotated[float, typer.Option(help="Gamma shape of arrivals; 1 is Poisson.")] = 1.0,
    max_concurrency: Annotated[int | None, typer.Option(help="Requests in flight at most.")] = None,
    num_warmups: Annotated[int, typer.Option(help="Unmeasured requests first.")] = 1,
    goodput: Annotated[list[str] | None, typer.Option(
        help="SLO as KEY:MS (ttft, tpot, e2el); several after one --goodput as vLLM writes them "
             "(--goodput ttft:500 tpot:50), or repeated.")] = None,
    seed: Annotated[int, typer.Option()] = 0,
    sweep: Annotated[str | None, typer.Option(help="Comma-separated request rates to run in turn.")] = None,
    slo_attainment: Annotated[float, typer.Option(help="Share of requests meeting --goodput for a rate to count "
                                                        "as meeting the SLO in a sweep.")] = 0.9,
    compare: Annotated[str | None, typer.Option(help="Systems to run the same workload against in turn, e.g. "
                                                      "builtin,hf-static,llama-cpp (they are started and stopped "
                                                      "here); SYSTEM@LABEL runs one again, e.g. with other "
                                                      "--system-args.")] = None,
    system_args: Annotated[list[str] | None, typer.Option(
        help="Extra server flags for a system of --compare, as NAME=FLAGS (e.g. 'vllm=--block-size 32'); "
             "repeatable.")] = None,
    output: Annotated[Path | None, typer.Option(help="Write the results as JSON here.")] = None,
    plot: Annotated[Path | None, typer.Option(help="With --sweep: plot goodput and p99 latency against rate "
                                                   "(PNG or SVG).")] = None,
) -> None:
    """Measure a serving target: TTFT, ITL, TPOT, end-to-end latency, throughput and SLO goodput."""
    try:
        slo = parse_goodput([spec for value in goodput or [] for spec in value.split()])  # also 'ttft:1 tpot:2'
        rates = [float(r) for r in sweep.split(",")] if sweep else [request_rate]
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    opts = dict(random_input_len=random_input_len, random_output_len=random_output_len,
                random_range_ratio=random_range_ratio, gsp_num_groups=gsp_num_groups,
                gsp_system_prompt_len=gsp_system_prompt_len, gsp_question_len=gsp_question_len,
                gsp_output_len=gsp_output_len, multi_turn_turns=multi_turn_turns, trace=trace)
    tok = load_tokenizer(tokenizer) if dataset != "trace" or trace else None
    names = compare.split(",") if compare else [None]
    for name in names if compare else ():
        if system_of(name) not in SYSTEMS:
            raise typer.BadParameter(f"unknown system {system_of(name)!r} (choose from {', '.join(SYSTEMS)}; "
                                     "SYSTEM@LABEL runs one again under a label)", param_hint="--compare")
        if name.endswith("@"):
            raise typer.BadParameter(f"{name!r} has no label after @ (SYSTEM@LABEL)", param_hint="--compare")
    if twice := sorted({name for name in names if names.count(name) > 1}):
        raise typer.BadParameter(f"{', '.join(twice)} listed twice: label a second run, as {twice[0]}@LABEL",
                                 param_hint="--compare")
    try:
        flags = dict(system_flags(spec) for spec in system_args or [])
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--system-args") from None
    if stray := set(flags) - set(names):
        raise typer.BadParameter(f"{', '.join(sorted(stray))} not in --compare", param_hint="--system-args")

    async def measure_all(the_target) -> list[dict]:
        conversations = build_dataset(dataset, tok, num_prompts, seed, opts)  # replies reset on every run
        if lora_modules:
            spread_models(conversations, [None, *lora_modules.split(",")])
        await the_target.prepare()
        try:
            runs = []
            for rate in rates:
                runs.append(await run_once(the_target, conversations, rate, burstiness, seed, max_concurrency,
                                           num_warmups, slo, dataset == "trace"))
                print_summary(runs[-1])
            return runs
        finally:
            await the_target.close()

    results: dict[str, list[dict]] = {}
    not_started: dict[str, str] = {}  # a system that does not start leaves the others' figures standing
    for name in names:
        try:
            with system_target(system_of(name), model, flags.get(name, ())) if name else contextlib.nullcontext(
                    make_target(target, protocol, backend, model, api_key)) as the_target:
                console.print(f"measuring {name or the_target.name}")
                results[name or the_target.name] = asyncio.run(measure_all(the_target))
        except ServerNotReady as exc:
            console.print(f"error: {name} did not start: {exc}", style="red", markup=False, highlight=False)
            not_started[name] = str(exc)
    if not results:
        raise typer.Exit(1)
    result = {"dataset": dataset, "num_prompts": num_prompts, "seed": seed, "goodput_slo_ms": slo}
    if flags:
        result["system_args"] = flags
    if not_started:
        result["not_started"] = not_started
    for name, runs in results.items():
        if len(rates) > 1:
            runs_knee = knee(runs, slo_attainment)
            console.print(f"{name}: highest rate meeting the SLO: {runs_knee if runs_knee is not None else 'none'}")
            results[name] = {"runs": runs, "knee_request_rate": runs_knee}
        else:
            results[name] = runs[0]
    if compare:
        result["compare"] = results
        if len(rates) == 1:  # a sweep's figures are per rate: see the JSON and the plot
            print_comparison(results, list(results))  # in --compare's order, those measured
    else:
        name, body = next(iter(results.items()))
        result.update(target=name, **body)
    if output:
        output.write_text(json.dumps(result, indent=1))
        console.print(f"results written to {output}")
    if plot:
        plot_sweep(results, plot)
        console.print(f"plot written to {plot}")
    if not_started:
        raise typer.Exit(1)
