"""The advisor's performance model: the step simulator against its own step costs, prefill and
queueing charged where they happen, runtimes told apart, the deployment search, and the
calibration set's integrity."""

from __future__ import annotations

import math
import time
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from advisor.hardware import resolve as hardware
from advisor.model_facts import resolve as model
from advisor.perf.calibration import points, sources
from advisor.perf.deployment import Deployment, divides
from advisor.perf.efficiency import Efficiency, fitted
from advisor.perf.predict import percentile, predict
from advisor.perf.schedulers import scheduler
from advisor.perf.search import BadSLO, Pool, parse_slos, search
from advisor.perf.simulate import Traffic, simulate
from advisor.perf.steps import Step, StepCost
from gateway.cli import app

LLAMA8 = "meta-llama/Llama-3.1-8B-Instruct"


def test_one_request_costs_one_prefill_then_its_decode_steps():
    m, d = model(LLAMA8), Deployment("vllm", hardware("h100-sxm"), weights="fp8", kv="fp8")
    cost = StepCost(m, d, fitted())
    out = simulate(cost, scheduler("vllm", d.hardware), 100_000, Traffic(1000, 101, load="concurrency", requests=1))
    prefill = cost.seconds(Step(prefill=1000, prefill_context=1000 * 500))
    assert out.ttft[0] == pytest.approx(cost.frontend + prefill, rel=1e-6)  # the server's own time, then the step
    decode_mid = cost.seconds(Step(decodes=1, decode_context=1050))
    assert out.tpot[0] == pytest.approx(decode_mid, rel=0.02)


def test_prefill_is_charged_to_the_batch_that_waits_for_it():
    """2,048-token prompts with 128 output tokens cannot finish faster than the device prefills
    them: the closed-form capacity seqs / (TTFT + OSL x TPOT) overstated this 5-9x."""
    m, d = model(LLAMA8), Deployment("vllm", hardware("h100-sxm"), weights="fp8", kv="fp8")
    heavy = predict(m, d, Traffic(2048, 128, load="offline", requests=2000))
    cost = StepCost(m, d, fitted())
    prefill_limit = 8192 / cost.seconds(Step(prefill=8192, prefill_context=8192 * 1024)) / 2048  # req/s
    assert heavy.requests_per_s <= prefill_limit
    light = predict(m, d, Traffic(128, 128, load="offline", requests=2000))
    assert light.requests_per_s > 2 * heavy.requests_per_s


def test_queueing_grows_latency_as_the_rate_nears_capacity():
    """vLLM admits up to 1,024 sequences, so an overload shows in the whole request's time (the
    steps grow); a server with 4 slots makes the rest wait for their first token."""
    m, d = model(LLAMA8), Deployment("vllm", hardware("h100-sxm"), weights="fp8", kv="fp8")
    capacity = predict(m, d, Traffic(1024, 256, load="offline", requests=1500)).requests_per_s
    calm = predict(m, d, Traffic(1024, 256, load="rate", rate=0.2 * capacity, requests=600))
    busy = predict(m, d, Traffic(1024, 256, load="rate", rate=1.3 * capacity, requests=600))
    assert busy.latency("e2e", 99) > 3 * calm.latency("e2e", 99)
    assert busy.latency("ttft", 50) <= busy.latency("ttft", 90) <= busy.latency("ttft", 99)
    slots = replace(d, runtime="llama-cpp")
    few = predict(m, slots, Traffic(1024, 256, load="rate", rate=2.0, requests=200))
    many = predict(m, slots, Traffic(1024, 256, load="rate", rate=8.0, requests=200))
    assert many.latency("ttft", 90) > 10 * few.latency("ttft", 90)


def test_a_full_cache_preempts_and_still_finishes_everything():
    m, d = model(LLAMA8), Deployment("vllm", hardware("h100-sxm"), weights="fp8", kv="fp8")
    cost = StepCost(m, d, fitted())
    out = simulate(cost, scheduler("vllm", d.hardware), 40_000, Traffic(500, 1500, load="offline", requests=200))
    assert out.completed == 200 and out.preemptions > 0
    no_evict = simulate(cost, scheduler("tensorrt-llm", d.hardware), 40_000,
                        Traffic(500, 1500, load="offline", requests=200))
    assert no_evict.completed == 200 and no_evict.preemptions == 0


def test_runtimes_are_told_apart_by_their_schedulers():
    """Same kernels (the priors, no per-runtime speeds), different schedulers: SGLang's prefill
    batches pause every decode, so its worst TPOT is worse than vLLM's, whose prompt chunks ride
    with the decodes; a 4-slot llama.cpp server queues a 64-client load for its first token."""
    m, same = model(LLAMA8), Efficiency()
    figures = {r: predict(m, Deployment(r, hardware("h100-sxm"), weights="fp8", kv="fp8"),
                          Traffic(4096, 256, load="concurrency", concurrency=64, requests=400, spread=0.5), same)
               for r in ("vllm", "sglang", "tensorrt-llm", "llama-cpp")}
    ttft = {r: f.latency("ttft", 50) for r, f in figures.items()}
    assert len({round(v, 1) for v in ttft.values()}) == 4
    assert figures["sglang"].latency("tpot", 99) > figures["vllm"].latency("tpot", 99)
    assert ttft["llama-cpp"] > 5 * ttft["vllm"]  # 60 of 64 clients wait for a slot
    # and the fitted runtimes differ in speed where the published pairs say they do
    fitted_tpot = {r: predict(m, Deployment(r, hardware("h100-sxm"), weights="fp8", kv="fp8"),
                              Traffic(1024, 256, load="concurrency", concurrency=16, requests=200)).latency("tpot", 50)
                   for r in ("vllm", "sglang", "tensorrt-llm")}
    assert len({round(v, 2) for v in fitted_tpot.values()}) == 3


def test_fp4_arithmetic_and_apple_flops_are_modelled():
    m = model("meta-llama/Llama-3.1-70B-Instruct")
    b200 = hardware("b200")
    fp8 = predict(m, Deployment("tensorrt-llm", b200, weights="fp8", kv="fp8"), Traffic(2048, 128, load="offline"))
    fp4 = predict(m, Deployment("tensorrt-llm", b200, weights="nvfp4", kv="fp8"), Traffic(2048, 128, load="offline"))
    assert fp4.output_tokens_per_s > 1.3 * fp8.output_tokens_per_s
    mac = Deployment("llama-cpp", hardware("m3-max"), weights="Q4_K_M")
    one = predict(model(LLAMA8), mac, Traffic(512, 128, load="concurrency", concurrency=1, requests=4))
    many = predict(model(LLAMA8), mac, Traffic(512, 128, load="concurrency", concurrency=4, requests=16))
    assert many.output_tokens_per_s < 3.5 * one.output_tokens_per_s  # batching on an M3 Max is not free


def test_percentile_is_linear_between_order_statistics():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) is None


def test_splits_that_do_not_divide_are_named():
    llama = model("meta-llama/Llama-3.1-70B-Instruct")
    assert "attention heads" in divides(llama, Deployment("vllm", hardware("h100-sxm"), tp=3))
    ds = model("deepseek-ai/DeepSeek-V3")
    assert "routed experts" in divides(ds, Deployment("vllm", hardware("h200"), ep=3, dp=3, attention_dp=True))
    assert divides(ds, Deployment("vllm", hardware("h200"), ep=16, dp=16, attention_dp=True)) is None


def test_slos_parse_or_say_how_to_write_them():
    assert parse_slos("ttft:p90<300ms; tpot:p99<0.05s") == [("ttft", "p90", 300.0), ("tpot", "p99", 50.0)]
    for bad in ("ttft<300", "tpot:p99<fast", "latency:p50<3ms"):
        with pytest.raises(BadSLO, match="METRIC:STAT<VALUE"):
            parse_slos(bad)


@pytest.mark.slow
def test_search_70b_on_two_h100_nodes_is_fast_and_its_frontier_is_not_dominated():
    started = time.perf_counter()
    result = search(model("meta-llama/Llama-3.1-70B-Instruct"), Pool(hardware("h100-sxm"), 8, 2, 2.5), 2048, 256,
                    parse_slos("ttft:p90<2000ms;tpot:p90<50ms"), ["vllm", "sglang", "tensorrt-llm", "lmdeploy"],
                    target_rate=20)
    assert time.perf_counter() - started < 30
    frontier = result["frontier"]
    assert frontier and result["searched"] > 100
    for a in frontier:
        assert not any(b["tokens_per_s_per_gpu"] > a["tokens_per_s_per_gpu"]
                       and b["tokens_per_s_per_user"] > a["tokens_per_s_per_user"] for b in result["options"])
    assert {o["deployment"].split()[0] for o in result["options"]} >= {"TP8", "TP4xDP2", "TP8xPP2"}
    assert any(o["gpus"] == 16 and len(o["launch"]) == 2 for o in result["options"])  # one line per node
    cheapest = result["cheapest"]
    assert cheapest["meets_slo"] and cheapest["dollars_per_million_tokens"] > 0
    fewest = result["fewest_gpus"]
    assert fewest["copies"] * fewest["option"]["requests_per_s"] >= 20


def test_search_deepseek_on_two_h200_nodes_tries_expert_parallelism_and_disaggregation():
    result = search(model("deepseek-ai/DeepSeek-V3"), Pool(hardware("h200"), 8, 2), 2048, 512,
                    parse_slos("ttft:p90<3000ms;tpot:p90<80ms"), ["sglang"], loads=(16, 64))
    shapes = {o["deployment"] for o in result["options"]}
    assert any("EP16" in s and "attention-DP16" in s for s in shapes)
    assert any(s.count("P(") and "D(" in s for s in shapes)  # prefill/decode split


def test_calibration_set_is_sourced_and_spread():
    chosen = points()
    assert len(chosen) >= 40
    assert len({p.source for p in chosen}) >= 5 and set(p.source for p in chosen) <= set(sources())
    for p in chosen:
        assert p.extra.get("url", "").startswith(("http", "docs/")), p.id
        assert p.extra.get("date") and p.extra.get("quote"), p.id
        assert p.value > 0 and math.isfinite(p.value)
    regimes = {r for p in chosen for r in p.regimes}
    assert regimes >= {"prefill-heavy", "decode-heavy", "moe", "fp8", "fp4", "multi-node", "apple", "latency"}


@pytest.mark.slow
def test_search_command_writes_the_frontier_as_html(tmp_path):
    out = tmp_path / "search.html"
    result = CliRunner().invoke(app, ["advise", "--search", "--model", LLAMA8, "--hardware", "l4", "--slo",
                                      "tpot:p90<60ms", "--runtimes", "vllm,lmdeploy", "--price-per-gpu-hour", "0.8",
                                      "--format", "html", "--output", str(out)])
    assert result.exit_code == 0, result.output
    page = out.read_text()
    assert "<polyline" in page and "Pareto frontier" in page and "Cheapest within the SLOs" in page
    assert "vllm serve" in page or "lmdeploy serve" in page


@pytest.mark.parametrize("args, says", [
    (["--slo", "ttft<300"], "METRIC:STAT<VALUE"),
    (["--price-per-gpu-hour", "-1"], "must be a positive number"),
    (["--target-rate", "nan"], "must be a positive number"),
    (["--runtimes", "vllm,warp9"], "unknown runtimes"),
    (["--hardware", "h1000"], "unknown hardware"),
])
def test_search_command_refuses_bad_input_naming_it(args, says):
    result = CliRunner().invoke(app, ["advise", "--search", "--model", LLAMA8, "--hardware", "l4", *args])
    output = " ".join(result.output.split())
    assert result.exit_code == 2 and says in output, output
    assert "Traceback" not in output


@pytest.mark.slow
def test_the_search_document_is_what_the_search_says_today():
    """docs/advisor-search.md and its HTML reports are generated (`python -m advisor.perf.cases`): a
    change to the model, its fit or a catalogue that moves a case's answer shows up here."""
    from advisor.perf.cases import DOCS, render

    text, pages = render()
    assert (DOCS / "advisor-search.md").read_text() == text
    for name, page in pages.items():
        assert (DOCS / name).read_text() == page, name


def test_speculative_decoding_is_an_acceptance_rate_input():
    """k drafts each accepted with chance a yield (1 - a^(k+1)) / (1 - a) tokens a step; the
    verification of k + 1 tokens per sequence is what the step costs."""
    from advisor.advise import ImpossibleRequest, Workload

    assert Workload(draft_tokens=3, acceptance=0.7).accepted_per_step == pytest.approx(2.533, abs=1e-3)
    assert Workload().accepted_per_step == 1.0
    for bad in (Workload(acceptance=0.5), Workload(draft_tokens=2, acceptance=1.0), Workload(draft_tokens=-1)):
        with pytest.raises(ImpossibleRequest):
            bad.check()
    m, d = model(LLAMA8), Deployment("vllm", hardware("h100-sxm"), weights="fp8", kv="fp8")
    traffic = Traffic(1024, 256, load="concurrency", concurrency=8, requests=64)
    plain = predict(m, d, traffic)
    spec = predict(m, d, traffic, accepted=Workload(draft_tokens=3, acceptance=0.7).accepted_per_step, drafts=3)
    assert plain.latency("tpot", 50) / 2.6 < spec.latency("tpot", 50) < plain.latency("tpot", 50) / 1.5
