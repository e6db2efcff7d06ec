"""The advisor's launch lines against the runtimes themselves: every vLLM and llama-server line of its
example scenarios parsed by that runtime's own argument parser (vLLM's CPU build in the peers'
environment, the peers' llama-server), and a LoRA scenario's vLLM line started and served through
its adapter."""

from __future__ import annotations

import itertools
import json
import shlex
import subprocess

import pytest

from advisor.advise import Workload, _capacity, advise
from advisor.examples import SCENARIOS
from advisor.hardware import resolve as hardware
from advisor.model_facts import resolve
from backends import peers
from backends.launch import VLLM_RUNTIME_LORA_ENV, free_port, supervised
from tests.conftest import provisioned_or_skip

# Beyond the examples: the flags only some scenarios ask for.
EXTRA = [("deepseek-ai/DeepSeek-V3", "h200", 8, Workload(expert_parallel=True, kv_cache_dtype="fp8")),
         ("meta-llama/Llama-3.1-8B-Instruct", "h100-sxm", 1, Workload(kv_cache_dtype="fp8_e5m2", max_context=8192)),
         ("meta-llama/Llama-3.1-8B-Instruct", "rtx-4090", 1, Workload(kv_cache_dtype="q8_0", lora_adapters=3,
                                                                       lora_rank=64))]

# Parses each `vllm serve` line with vLLM's own serve parser and validation; prints, per line, the
# error or the few settings the test checks.
VLLM_PARSE = """
import contextlib, io, json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
out = []
for argv in json.load(sys.stdin):
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
            validate_parsed_serve_args(args)
    except SystemExit:
        out.append({"error": errors.getvalue()[-500:]})
        continue
    out.append({"model": args.model_tag, "max_model_len": args.max_model_len, "enable_lora": args.enable_lora,
                "lora": sorted(m.name for m in args.lora_modules or ()), "max_lora_rank": args.max_lora_rank})
print(json.dumps(out))
"""


def _command(line: str) -> tuple[list[str], dict[str, str]]:
    """A shell line's argv and the environment assignments before it."""
    argv = shlex.split(line, comments=True)
    env = dict(word.split("=", 1) for word in itertools.takewhile(lambda word: "=" in word, argv))
    return argv[len(env):], env


def _lines(runtime: str) -> list[tuple[str, str]]:
    cases = [(title, m, h, g, w) for title, _, m, h, g, w in SCENARIOS]
    cases += [(f"{m} on {g} x {h}", m, h, g, w) for m, h, g, w in EXTRA]
    found = []
    for title, model_id, device, gpus, workload in cases:
        for c in advise(resolve(model_id), hardware(device), gpus, workload).candidates:
            if c.runtime == runtime and "runtime_command" in c.launch:
                found.append((title, c.launch["runtime_command"]))
    return found


def _search_lines() -> list[tuple[str, str]]:
    """`--search`'s vLLM lines for splits across nodes, pipelines and disaggregated prefill."""
    from advisor.perf.deployment import Deployment
    from advisor.perf.search import Pool, launch_lines

    model, h200 = resolve("deepseek-ai/DeepSeek-V3"), hardware("h200")
    splits = [Deployment("vllm", h200, tp=8, ep=8, dp=2, weights="fp8", kv="fp8"),
              Deployment("vllm", h200, tp=4, pp=2, weights="fp8"),
              Deployment("vllm", h200, tp=8, dp=1, prefill_workers=1, weights="fp8")]
    return [(d.describe(), line) for d in splits for line in launch_lines(model, d, Pool(h200, nodes=2))]


@pytest.mark.slow
def test_every_vllm_line_of_the_examples_parses_with_vllms_own_parser():
    python = provisioned_or_skip(peers.vllm_python)
    lines = _lines("vllm") + _search_lines()
    assert len(lines) >= 8 and any("--enable-lora" in line for _, line in lines)
    assert any("--kv-transfer-config" in line for _, line in lines) and any("--headless" in line for _, line in lines)
    argvs = []
    for _, line in lines:
        argv, _ = _command(line)
        assert argv[:2] == ["vllm", "serve"], line
        argvs.append(argv[2:])
    argvs.append(["m", "--enable-lora", "--max-lora-rank", "17"])  # the check can fail: 17 is no rank of vLLM's
    done = subprocess.run([str(python), "-c", VLLM_PARSE], input=json.dumps(argvs), capture_output=True, text=True,
                          timeout=300, env=peers.vllm_env())
    assert done.returncode == 0, done.stderr[-2000:]
    *parsed, refused = json.loads(done.stdout.strip().splitlines()[-1])
    assert "invalid choice: 17" in refused["error"]
    for (title, line), result in zip(lines, parsed, strict=True):
        assert "error" not in result, (title, line, result)
        assert "--max-model-len" not in line or str(result["max_model_len"]) in line
        if "--enable-lora" in line:
            assert result["enable_lora"] and result["lora"] and result["max_lora_rank"] in (8, 16, 32, 64), result


@pytest.mark.slow
def test_every_llama_server_line_of_the_examples_parses_with_llama_servers_own_parser():
    binary = provisioned_or_skip(peers.llama_server)
    lines = _lines("llama-cpp")
    assert len(lines) >= 6 and any("--lora" in line for _, line in lines) and any("-ctk" in line for _, line in lines)
    for title, line in lines:
        argv = shlex.split(line)
        assert argv[0] == "llama-server", line
        # --help makes it parse every argument, then print its usage instead of loading the model.
        done = subprocess.run([str(binary), *argv[1:], "--help"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "error" not in done.stderr.lower(), (title, line, done.stderr[-500:])
    bad = subprocess.run([str(binary), "-m", "x.gguf", "--kv-unified-per-slot", "many", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0  # the check can fail


@pytest.mark.slow
def test_a_lora_scenarios_vllm_line_serves_a_request_through_its_adapter(tmp_path, default_model_dir):
    """A peft adapter on the default model; the advisor's vLLM line for it, as written, started on
    vLLM's CPU build; a request naming the adapter is served by it, one naming none is refused."""
    import openai
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    python = provisioned_or_skip(peers.vllm_python)
    adapter = tmp_path / "support"
    base = AutoModelForCausalLM.from_pretrained(default_model_dir)
    get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                    init_lora_weights=False)).save_pretrained(adapter)
    workload = Workload(prompt_tokens=64, output_tokens=16, concurrency=2, max_context=2048, lora_rank=8,
                        lora_paths=[f"support={adapter}"])
    report = advise(resolve(str(default_model_dir)), hardware("cpu-x86"), 1, workload)
    vllm = next(c for c in report.candidates if c.runtime == "vllm")
    assert vllm.verdict != "excluded", vllm.reasons
    line = vllm.launch["runtime_command"]
    assert f"--lora-modules support={adapter}" in line and "--max-model-len 2048" in line
    argv, env = _command(line)
    assert env == VLLM_RUNTIME_LORA_ENV  # adapters may be loaded at run time too
    port = free_port()
    argv[argv.index("--port") + 1] = str(port)
    # `vllm serve MODEL ...` as the module the peers' environment runs (its `vllm` script reads a
    # distribution's version that the CPU build's install does not record).
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", argv[2], *argv[3:]]
    url = f"http://127.0.0.1:{port}"
    with supervised(command, url, "/health", peers.vllm_env() | env, 900):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        assert "support" in {m.id for m in client.models.list()}
        done = client.completions.create(model="support", prompt="Hello", max_tokens=8, temperature=0)
        assert done.model == "support" and done.choices[0].text and done.usage.completion_tokens > 0
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="no-such-adapter", prompt="Hello", max_tokens=4)


# -- what the lines carry, and what adapters cost (fast) ------------------------------------------
def _candidates(model_id: str, device: str, gpus: int, workload: Workload) -> dict:
    return {c.runtime: c for c in advise(resolve(model_id), hardware(device), gpus, workload).candidates}


def test_lora_adapters_cost_memory_and_decode_time_and_every_line_loads_them():
    llama, adapters = "meta-llama/Llama-3.1-8B-Instruct", ["a=./lora/a", "b=./lora/b", "c=./lora/c"]
    plain = _candidates(llama, "l40s", 1, Workload(concurrency=8))
    lora = _candidates(llama, "l40s", 1, Workload(concurrency=8, lora_paths=adapters, lora_rank=64))
    for runtime in ("vllm", "sglang"):
        # 3 adapters x rank 64 x 32 layers x 69,632 (in + out over q, k, v, o, gate, up, down) x 2 bytes
        added = lora[runtime].memory["weights_gib"] - plain[runtime].memory["weights_gib"]
        assert added == pytest.approx(3 * 64 * 32 * 69_632 * 2 / 2**30, rel=0.02)
        assert lora[runtime].estimates["tpot_ms"] > plain[runtime].estimates["tpot_ms"]
    assert "--enable-lora --max-loras 3 --max-lora-rank 64 --lora-modules a=./lora/a b=./lora/b c=./lora/c" \
        in lora["vllm"].launch["runtime_command"]
    assert "--enable-lora --max-loras-per-batch 3 --max-lora-rank 64 --lora-paths a=./lora/a" \
        in lora["sglang"].launch["runtime_command"]
    assert "--lora ./lora/a --lora ./lora/b --lora ./lora/c --lora-init-without-apply" \
        in lora["llama-cpp"].launch["runtime_command"]
    assert "--backend pytorch --adapters a=./lora/a" in lora["lmdeploy"].launch["runtime_command"]
    assert "--lora a=./lora/a" in lora["vllm"].launch["servegate_command"]
    assert lora["ollama"].verdict == "excluded"  # one ADAPTER per Modelfile
    rank = _candidates(llama, "l40s", 1, Workload(lora_adapters=2, lora_rank=20))["vllm"]
    assert "--max-lora-rank 32" in rank.launch["runtime_command"]  # vLLM takes 1, 8, 16, 32, ... 512
    assert "placeholders" in rank.launch["lora_note"]


@pytest.mark.slow
def test_each_request_may_run_to_the_models_context_as_far_as_the_kv_cache_holds_one():
    qwen = "Qwen/Qwen2.5-7B-Instruct"  # 32,768 tokens
    roomy = _candidates(qwen, "h100-sxm", 1, Workload())["vllm"]
    assert "--max-model-len 32768" in roomy.launch["runtime_command"]  # not the mean prompt + output
    asked = _candidates(qwen, "h100-sxm", 1, Workload(max_context=8192))["vllm"]
    assert "--max-model-len 8192" in asked.launch["runtime_command"]
    tight = _candidates("meta-llama/Llama-3.1-8B-Instruct", "l4", 1, Workload())["vllm"]
    held = tight.memory["kv_tokens"]
    assert held < 131_072 and f"--max-model-len {held}" in tight.launch["runtime_command"]
    assert f"holds {held:,} tokens" in tight.launch["context_note"]


def test_parallelism_flags_per_runtime():
    from backends.launch import LaunchError, LaunchSpec, command

    spec = LaunchSpec(runtime="vllm", model="m", port=1, tensor_parallel=4, pipeline_parallel=2, data_parallel=2)
    argv = command(spec)[0]
    assert argv[argv.index("--pipeline-parallel-size") + 1] == "2" and "--data-parallel-size" in argv
    argv = command(LaunchSpec(runtime="sglang", model="m", port=1, pipeline_parallel=2, data_parallel=4))[0]
    assert argv[argv.index("--pp-size") + 1] == "2" and argv[argv.index("--dp-size") + 1] == "4"
    with pytest.raises(LaunchError, match="no pipeline or data parallelism"):
        command(LaunchSpec(runtime="tgi", model="m", port=1, pipeline_parallel=2))
    with pytest.raises(LaunchError, match="one model and one LoRA adapter"):
        command(LaunchSpec(runtime="llama-cpp-python", model="m", port=1, lora_modules={"a": "x", "b": "y"}))


@pytest.mark.slow
def test_a_rate_no_deployment_serves_is_answered_with_the_devices_it_needs():
    report = advise(resolve("meta-llama/Llama-3.1-8B-Instruct"), hardware("h100-sxm"), 1, Workload(request_rate=1e9))
    assert report.summary.startswith("Not servable on 1 x h100-sxm: 1e+09 req/s")
    best = max(_capacity(c) for c in report.candidates if c.estimates)
    needed = int(report.summary.split("needs at least ")[1].split(" x ")[0].replace(",", ""))
    assert needed == -(-1e9 // best)
    assert not any(c.verdict == "recommended" for c in report.candidates)
    served = advise(resolve("meta-llama/Llama-3.1-8B-Instruct"), hardware("h100-sxm"), 1, Workload(request_rate=2))
    assert not served.summary.startswith("Not servable")


def test_a_gpt_oss_20b_fits_16_gb_in_the_runtimes_that_keep_their_own_small_reserve():
    found = _candidates("openai/gpt-oss-20b", "rtx-5080", 1, Workload(concurrency=4))
    assert found["llama-cpp"].verdict != "excluded" and found["ollama"].verdict != "excluded"
    assert found["vllm"].verdict == "excluded"  # its 3.5 GB activation and graph reserve leaves no KV room
    assert found["llama-cpp"].memory["reserved_gib"] == pytest.approx(1.0)
