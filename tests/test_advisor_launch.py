"""The advisor's launch lines against the runtimes themselves: every vLLM and llama-server line of its
example scenarios parsed by that runtime's own argument parser (vLLM's CPU build in the peers'
environment, the peers' llama-server), and a LoRA scenario's vLLM line started and served through
its adapter."""

from __future__ import annotations

import json
import shlex
import subprocess

import pytest

from advisor.advise import Workload, advise
from advisor.examples import SCENARIOS
from advisor.hardware import resolve as hardware
from advisor.models import resolve
from backends import peers
from backends.launch import free_port, supervised
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


def _lines(runtime: str) -> list[tuple[str, str]]:
    cases = [(title, m, h, g, w) for title, _, m, h, g, w in SCENARIOS]
    cases += [(f"{m} on {g} x {h}", m, h, g, w) for m, h, g, w in EXTRA]
    found = []
    for title, model_id, device, gpus, workload in cases:
        for c in advise(resolve(model_id), hardware(device), gpus, workload).candidates:
            if c.runtime == runtime and "runtime_command" in c.launch:
                found.append((title, c.launch["runtime_command"]))
    return found


@pytest.mark.slow
def test_every_vllm_line_of_the_examples_parses_with_vllms_own_parser():
    python = provisioned_or_skip(peers.vllm_python)
    lines = _lines("vllm")
    assert len(lines) >= 8 and any("--enable-lora" in line for _, line in lines)
    argvs = []
    for _, line in lines:
        argv = shlex.split(line)
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
        assert result["max_model_len"] and str(result["max_model_len"]) in line
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
    argv = shlex.split(line)
    port = free_port()
    argv[argv.index("--port") + 1] = str(port)
    # `vllm serve MODEL ...` as the module the peers' environment runs (its `vllm` script reads a
    # distribution's version that the CPU build's install does not record).
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", argv[2], *argv[3:]]
    url = f"http://127.0.0.1:{port}"
    with supervised(command, url, "/health", peers.vllm_env(), 900):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        assert "support" in {m.id for m in client.models.list()}
        done = client.completions.create(model="support", prompt="Hello", max_tokens=8, temperature=0)
        assert done.model == "support" and done.choices[0].text and done.usage.completion_tokens > 0
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="no-such-adapter", prompt="Hello", max_tokens=4)
