"""The benchmark harness: metric arithmetic, goodput, arrivals, datasets, and a tiny end-to-end run."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import numpy as np
import psutil
import pytest
from typer.testing import CliRunner

from advisor.measure.arrivals import arrival_times
from advisor.measure.baselines import HFStaticBackend
from advisor.measure.datasets import Conversation, Turn, shared_prefix_dataset, trace_dataset
from advisor.measure.metrics import RequestResult, knee, kv_summary, parse_goodput, summarize
from advisor.measure.plot import plot_sweep
from advisor.measure.runner import peak_memory, process_tree, tree_peak_mib
from backends.base import GenerateRequest
from backends.builtin import BuiltinBackend, EngineConfig
from gateway.cli import app

from .conftest import ADMIN_KEY, gateway_app, serve_app, wait_ready

STATS = ("mean", "median", "std", "p50", "p95", "p99")
VLLM_KEYS = {"duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
             "request_goodput", "output_throughput", "total_token_throughput"} | {
    f"{stat}_{m}_ms" for stat in STATS for m in ("ttft", "tpot", "itl", "e2el")}


def synthetic() -> list[RequestResult]:
    # Request A: sent at 0, first text at 0.1 s, then 3 more at 0.05 s gaps -> e2e 0.25 s, 4 tokens.
    a = RequestResult(prompt_tokens=10, output_tokens=4, start=0.0, ttft=0.1, itl=[0.05, 0.05, 0.05], e2el=0.25)
    # Request B: slow first token, 2 tokens.
    b = RequestResult(prompt_tokens=20, output_tokens=2, start=0.5, ttft=0.9, itl=[0.1], e2el=1.0)
    failed = RequestResult(prompt_tokens=0, start=1.0, error="HTTP 503")
    return [a, b, failed]


def test_summary_arithmetic_on_synthetic_timestamps():
    s = summarize(synthetic(), duration=2.0, slo_ms={"ttft": 500})
    assert VLLM_KEYS <= set(s)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["total_input_tokens"] == 30 and s["total_output_tokens"] == 6
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 3.0 and s["total_token_throughput"] == 18.0
    assert s["mean_ttft_ms"] == pytest.approx(500.0) and s["median_ttft_ms"] == pytest.approx(500.0)
    assert s["p99_ttft_ms"] == pytest.approx(100 + 0.99 * 800)
    # TPOT = (e2e - ttft) / (tokens - 1): A 50 ms, B 100 ms.
    assert s["mean_tpot_ms"] == pytest.approx(75.0)
    assert s["mean_itl_ms"] == pytest.approx(np.mean([50, 50, 50, 100]))
    assert s["std_e2el_ms"] == pytest.approx(np.std([250, 1000]))
    assert s["request_goodput"] == 0.5  # only A meets TTFT <= 500 ms; the failed one never counts


def test_goodput_counts_every_slo_and_rejects_bad_specs():
    a, b, failed = synthetic()
    assert a.meets({"ttft": 100, "tpot": 50, "e2el": 250}) and not a.meets({"tpot": 49})
    assert b.meets({"e2el": 1000}) and not b.meets({"ttft": 899})
    assert not failed.meets({})
    one_token = RequestResult(prompt_tokens=1, output_tokens=1, ttft=0.2, e2el=0.2)
    assert one_token.tpot is None and one_token.meets({"tpot": 1})
    assert parse_goodput(["ttft:500", "e2el:2000"]) == {"ttft": 500.0, "e2el": 2000.0}
    for bad in (["itl:5"], ["ttft"], ["ttft:-1"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput(bad)


def test_kv_summary_takes_the_peak_sample_and_counter_deltas():
    samples = [
        {"kv_blocks_total": 100, "kv_blocks_used": 0, "kv_live_token_fraction": 1.0, "running": 0,
         "preemptions_total": 2, "admitted_requests_total": 10, "queue_delay_seconds_total": 1.0,
         "kv_slot_steps_total": 1000, "kv_live_token_steps_total": 900},
        {"kv_blocks_total": 100, "kv_blocks_used": 40, "kv_live_token_fraction": 0.95, "running": 7,
         "preemptions_total": 3, "admitted_requests_total": 14, "queue_delay_seconds_total": 1.2,
         "kv_slot_steps_total": 5000, "kv_live_token_steps_total": 4700},
        {"kv_blocks_total": 100, "kv_blocks_used": 10, "kv_live_token_fraction": 0.85, "running": 2,
         "preemptions_total": 5, "admitted_requests_total": 20, "queue_delay_seconds_total": 1.5,
         "kv_slot_steps_total": 9000, "kv_live_token_steps_total": 8100},
    ]
    s = kv_summary(samples)
    assert (s["kv_peak_blocks_used"], s["kv_live_token_fraction_at_peak"], s["peak_running"]) == (40, 0.95, 7)
    assert s["kv_live_token_fraction"] == pytest.approx(7200 / 8000)  # from the counters' deltas
    assert s["preemptions"] == 3 and s["mean_queue_delay_ms"] == pytest.approx(50.0)
    assert kv_summary([]) == {}


def test_poisson_and_gamma_arrivals_have_the_asked_rate_and_burstiness():
    times = np.array(arrival_times(20000, rate=5.0, seed=1))
    gaps = np.diff(times)
    assert times[0] > 0 and np.all(gaps >= 0)
    # the last request goes at n / rate, as in vllm bench serve, whatever the seed
    assert all(arrival_times(48, 2.0, seed=s)[-1] == pytest.approx(24.0) for s in range(5))
    assert gaps.mean() == pytest.approx(0.2, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    bursty = np.diff(arrival_times(20000, rate=5.0, burstiness=0.25, seed=1))
    assert bursty.mean() == pytest.approx(0.2, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.07)  # gamma shape k: CV 1/sqrt(k)
    assert arrival_times(3, float("inf")) == [0.0, 0.0, 0.0]
    assert arrival_times(50, 2.0, seed=7) == arrival_times(50, 2.0, seed=7)


def test_shared_prefix_and_multi_turn_prompts(default_model):
    tok = default_model.tokenizer
    data = shared_prefix_dataset(tok, num_groups=3, prompts_per_group=4, system_prompt_len=64, question_len=8,
                                 output_len=5, seed=3)
    assert len(data) == 12 and len({c.prefix for c in data}) == 3
    assert all(58 <= len(tok.encode(c.prefix, add_special_tokens=False)) <= 64 for c in data)
    assert [c.prompt(0) for c in data] == [c.prompt(0) for c in shared_prefix_dataset(tok, 3, 4, 64, 8, 5, seed=3)]
    chat = Conversation([Turn("Q1 ", 4), Turn("Q2 ", 4)], prefix="SYS ")
    chat.replies = ["A1 "]
    assert chat.prompt(1) == "SYS Q1 A1 Q2 "


def test_trace_lines_are_checked(tmp_path, default_model):
    good = tmp_path / "t.jsonl"
    good.write_text('{"timestamp": 5000, "input_length": 20, "output_length": 4}\n'
                    '{"arrival": 3.0, "prompt": "hello", "max_tokens": 2}\n')
    data = trace_dataset(good, default_model.tokenizer)
    assert [c.arrival for c in data] == [0.0, 2.0] and data[0].turns[0].text == "hello"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival": 1, "prompt": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        trace_dataset(bad, default_model.tokenizer)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    backend = BuiltinBackend(EngineConfig(model=str(tiny_model_dir), dtype="float64", served_name="tiny",
                                          engine_process=False))  # its engine is read below
    with serve_app(gateway_app({"tiny": backend}, tmp_path_factory.mktemp("gw"))) as url:
        wait_ready(url)
        yield url, backend


@pytest.mark.slow
def test_bench_end_to_end_against_servegate_serve(server, tmp_path):
    url, backend = server
    out = tmp_path / "result.json"
    result = CliRunner().invoke(app, [
        "bench", "--target", url, "--api-key", ADMIN_KEY, "--dataset", "shared-prefix", "--num-prompts", "8",
        "--gsp-num-groups", "2",
        "--gsp-system-prompt-len", "64", "--gsp-question-len", "8", "--gsp-output-len", "6",
        "--request-rate", "20", "--goodput", "ttft:60000", "--seed", "1", "--output", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert VLLM_KEYS <= set(data)
    assert data["completed"] == 8 and data["failed"] == 0
    assert data["total_output_tokens"] == 8 * 6  # ignore_eos honoured, usage read from the stream
    assert data["request_goodput"] == pytest.approx(data["request_throughput"])
    assert data["total_cached_tokens"] > 0  # the groups' shared prefixes hit the cache
    assert len(data["ttfts"]) == 8 and all(len(itl) == 5 for itl in data["itls"])
    # KV accounting, sampled from the server's /metrics during the run.
    assert data["kv_blocks_total"] == backend.engine.kv.num_blocks
    assert 0 < data["kv_live_token_fraction"] <= 1
    assert data["preemptions"] == 0 and 0 <= data["mean_queue_delay_ms"] < 1000  # 8 requests, none held long


@pytest.mark.slow
def test_bench_takes_vllm_bench_serves_spellings(server, tmp_path):
    """--base-url, the key from OPENAI_API_KEY, and several SLOs after one --goodput."""
    url, _ = server
    out = tmp_path / "result.json"
    result = CliRunner(env={"OPENAI_API_KEY": ADMIN_KEY}).invoke(app, [
        "bench", "--base-url", url, "--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "2",
        "--num-warmups", "0", "--goodput", "ttft:60000", "tpot:60000", "--output", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["completed"] == 2 and data["goodput_slo_ms"] == {"ttft": 60000.0, "tpot": 60000.0}


@pytest.mark.slow
def test_bench_reports_failures_instead_of_crashing(server, tmp_path):
    url, _ = server
    out = tmp_path / "result.json"
    result = CliRunner().invoke(app, [
        "bench", "--target", url, "--api-key", ADMIN_KEY, "--model", "no-such-model", "--num-prompts", "3",
        "--random-input-len", "8",
        "--random-output-len", "2", "--num-warmups", "0", "--output", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["completed"] == 0 and data["failed"] == 3 and "404" in data["errors"][0]


def test_knee_is_the_highest_rate_meeting_the_slo(tmp_path):
    def run(rate, good, total=10, duration=10.0):
        return {"request_rate": rate, "request_goodput": good * total / duration, "duration": duration,
                "completed": total, "failed": 0, "p99_ttft_ms": 100.0 * rate, "p99_e2el_ms": 300.0 * rate}

    runs = [run(1, 1.0), run(2, 0.95), run(4, 0.7), run(8, 0.2)]
    assert knee(runs, 0.9) == 2 and knee(runs, 0.5) == 4 and knee(runs, 0.99) == 1
    assert knee([run(1, 0.1)], 0.9) is None
    out = tmp_path / "sweep.png"
    plot_sweep({"a": {"runs": runs, "knee_request_rate": 2}}, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


async def test_hf_static_batches_and_streams(tiny_model_dir):
    backend = HFStaticBackend(tiny_model_dir, max_batch_size=4)
    await backend.start()
    try:
        async def one(i, max_tokens):
            events = [e async for e in backend.generate(GenerateRequest(
                request_id=str(i), prompt=f"request {i} " * (i + 1), max_tokens=max_tokens, ignore_eos=True))]
            return events
        results = await asyncio.gather(*(one(i, 3 + i) for i in range(3)))
    finally:
        await backend.close()
    for i, events in enumerate(results):
        deltas, finish = events[:-1], events[-1]
        assert len(deltas) == 3 + i and finish.usage.completion_tokens == 3 + i  # its own max, not the batch's
        assert finish.finish_reasons == ("length",)


@pytest.mark.slow
def test_a_servers_peak_memory_counts_its_descendants_and_a_peak_between_reads():
    """A server's memory is its process tree's: here a parent that holds little and a child, as
    vLLM's API process and its engine core, that holds 256 MiB for a moment in the middle of the
    run and gives it back before the end. Nothing reads the server while the run goes on, and the
    peak is still counted."""
    child = ("import sys; print(flush=True); sys.stdin.readline(); block = bytearray(256 * 2**20); del block; "
             "print(flush=True); sys.stdin.readline()")
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', "
                               f"{child!r}])"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert parent.stdout.readline() == b"\n"  # the child runs, holding little

        async def measured():
            async with peak_memory(parent.pid) as peak:
                parent.stdin.write(b"\n")
                parent.stdin.flush()
                assert await asyncio.to_thread(parent.stdout.readline) == b"\n"  # held, then given back
            return peak

        peak = asyncio.run(measured())["peak_memory_mib"]
        held_now = sum(p.memory_full_info().pss for p in process_tree(parent.pid)) / 2**20
        assert peak > 256 > 128 > held_now, (peak, held_now)

        async def idle():  # a later block's peak starts from what the server holds then
            async with peak_memory(parent.pid) as peak:
                await asyncio.sleep(0.05)
            return peak

        assert asyncio.run(idle())["peak_memory_mib"] < 128
        processes = process_tree(parent.pid)
    finally:
        for process in [*psutil.Process(parent.pid).children(), parent]:
            process.kill()
        parent.wait()
    # Every process of the tree gone, the child too: killed, it may outlive its parent's reaping
    # for a moment on a busy machine (then its memory is still there to read). A reaped process,
    # or a zombie, has none to report.
    psutil.wait_procs(processes, timeout=10)
    assert tree_peak_mib(processes) is None


@pytest.mark.slow
def test_compare_runs_the_same_workload_against_the_peers(tmp_path):
    out = tmp_path / "compare.json"
    result = CliRunner().invoke(app, [
        "bench", "--compare", "builtin,llama-cpp", "--dataset", "random", "--num-prompts", "3",
        "--random-input-len", "16", "--random-output-len", "4", "--max-concurrency", "2", "--num-warmups", "0",
        "--output", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())["compare"]
    assert set(data) == {"builtin", "llama-cpp"}
    assert all(d["completed"] == 3 and d["failed"] == 0 for d in data.values())
    assert data["builtin"]["total_output_tokens"] == 12  # ignore_eos honoured; llama-cpp may stop earlier
    assert "builtin / llama-cpp" in result.output
    # Each server's memory was sampled while it ran: more than the 94 MiB of the GGUF both load.
    assert all(d["peak_memory_mib"] > 100 for d in data.values()), {n: d["peak_memory_mib"] for n, d in data.items()}


@pytest.mark.slow
def test_compare_hands_each_system_its_own_server_flags(tmp_path):
    out = tmp_path / "flags.json"
    workload = ["bench", "--dataset", "random", "--num-prompts", "2", "--random-input-len", "16",
                "--random-output-len", "4", "--num-warmups", "0"]
    for spec, problem in [("vllm=--block-size 32", "vllm not in --compare"), ("builtin", "is not NAME=FLAGS"),
                          ("hf-static=--x", "takes no server flags"),
                          ('builtin=--served-name "a', """'builtin=--served-name "a': No closing quotation""")]:
        result = CliRunner().invoke(app, [*workload, "--compare", "builtin,hf-static", "--system-args", spec])
        assert result.exit_code == 2 and problem in " ".join(result.output.replace("│", " ").split()), result.output
    for compare, problem in [("builtin,builtin", "builtin listed twice: label a second run, as builtin@LABEL"),
                             ("nope@x", "unknown system 'nope'"), ("builtin@", "'builtin@' has no label after @")]:
        result = CliRunner().invoke(app, [*workload, "--compare", compare])
        assert result.exit_code == 2 and problem in " ".join(result.output.replace("│", " ").split()), result.output
    # One system twice under labels, each with its own flags: the context cap of 8 tokens reaches
    # only its own server, whose 16-token prompts are refused, not served. A flag the server
    # refuses fails that entry with the server's own words, not a traceback; the entries measured
    # before it keep their figures, written out, and the run's exit status says 1.
    result = CliRunner().invoke(app, [*workload, "--compare", "builtin@short,builtin,builtin@broken",
                                      "--system-args", "builtin@short=--max-model-len 8",
                                      "--system-args", "builtin@broken=--no-such-flag", "--output", str(out)])
    assert result.exit_code == 1 and result.exception.__class__ is SystemExit, result.output
    assert "builtin@broken did not start" in result.output and "No such option: --no-such-flag" in result.output
    data = json.loads(out.read_text())
    assert data["system_args"] == {"builtin@short": ["--max-model-len", "8"], "builtin@broken": ["--no-such-flag"]}
    assert set(data["compare"]) == {"builtin@short", "builtin"}
    assert data["compare"]["builtin@short"]["failed"] == 2 and data["compare"]["builtin@short"]["completed"] == 0
    assert data["compare"]["builtin"]["completed"] == 2 and data["compare"]["builtin"]["failed"] == 0
    assert "No such option: --no-such-flag" in data["not_started"]["builtin@broken"]
    assert "builtin@short / builtin" in result.output


@pytest.mark.slow
def test_bench_drives_a_backend_in_process(tiny_model_dir, tmp_path):
    out = tmp_path / "inproc.json"
    result = CliRunner().invoke(app, [
        "bench", "--backend", "builtin", "--model", str(tiny_model_dir), "--dataset", "multi-turn",
        "--num-prompts", "2", "--multi-turn-turns", "2", "--random-input-len", "40", "--random-output-len", "3",
        "--output", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["completed"] == 4 and data["total_output_tokens"] == 12
    assert "peak_memory_mib" not in data  # no server of its own: the engine shares the bench's process
    # The second turn of each conversation carries the first turn and its reply: longer prompts, cache hits.
    assert data["total_cached_tokens"] > 0 and data["kv_blocks_total"] > 0


@pytest.mark.slow
def test_bench_drives_llama_cpp_in_process(tmp_path):
    """llama-cpp-python in process, as its server runs it (one instance on every core)."""
    out = tmp_path / "llama.json"
    result = CliRunner().invoke(app, ["bench", "--backend", "llama-cpp", "--num-prompts", "2", "--random-input-len",
                                      "16", "--random-output-len", "4", "--output", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["target"] == "llama-cpp" and data["completed"] == 2 and data["failed"] == 0
    assert data["total_output_tokens"] > 0 and data["median_ttft_ms"] > 0
    result = CliRunner().invoke(app, ["bench", "--backend", "vllm"])
    assert result.exit_code == 2 and "unknown backend" in result.output


def test_lora_modules_spread_shared_prefix_groups_over_the_base_and_each_adapter():
    from advisor.measure.datasets import Conversation, Turn, spread_models

    conversations = [Conversation([Turn("q", 4)], prefix=f"system {i % 3}") for i in range(9)]
    spread_models(conversations, [None, "a1", "a2"])
    assert [c.model for c in conversations] == [None, "a1", "a2"] * 3  # a group's conversations ask for one model
    plain = [Conversation([Turn("q", 4)]) for _ in range(4)]
    spread_models(plain, [None, "a1"])
    assert [c.model for c in plain] == [None, "a1", None, "a1"]
