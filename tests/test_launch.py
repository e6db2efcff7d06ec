"""`servegate launch`: one spec, each runtime's own flags, and a supervised llama-cpp-python."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import pytest

from advisor.measure.baselines import free_port
from backends.default_model import default_model_path
from backends.launch import LaunchError, LaunchSpec, command
from backends.llamacpp import LlamaCppServerBackend, llama_server_config

from .conftest import AUTH, gateway_app, serve_app, wait_ready


def argv(**spec) -> tuple[list[str], dict]:
    return command(LaunchSpec(port=9000, model="m", **spec))


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_one_spec_becomes_each_runtimes_flags():
    vllm, _ = argv(runtime="vllm", context_length=8192, tensor_parallel=2, kv_cache_dtype="fp8_e4m3",
                   max_running_requests=64, prefix_caching=False)
    assert vllm[:3] == ["vllm", "serve", "m"] and flag(vllm, "--max-model-len") == "8192"
    assert flag(vllm, "--tensor-parallel-size") == "2" and flag(vllm, "--max-num-seqs") == "64"
    assert "--no-enable-prefix-caching" in vllm and flag(vllm, "--kv-cache-dtype") == "fp8_e4m3"
    assert "--enable-prompt-tokens-details" in vllm  # else its usage counts no cached tokens to bill at their price

    sglang, _ = argv(runtime="sglang", context_length=8192, tensor_parallel=2, prefix_caching=False)
    assert flag(sglang, "--context-length") == "8192" and "--max-total-tokens" not in sglang  # that is its KV pool
    assert flag(sglang, "--tp-size") == "2" and "--disable-radix-cache" in sglang
    assert "--enable-cache-report" in sglang

    tgi, env = argv(runtime="tgi", context_length=8192, tensor_parallel=2, kv_cache_dtype="fp8_e4m3",
                    max_running_requests=128, prefix_caching=False)
    assert flag(tgi, "--max-total-tokens") == "8192" and flag(tgi, "--num-shard") == "2"
    assert flag(tgi, "--kv-cache-dtype") == "fp8_e4m3fn" and env == {"PREFIX_CACHING": "0"}
    # the running batch; --max-concurrent-requests is TGI's admission limit (429), left at its default
    assert flag(tgi, "--max-batch-size") == "128" and "--max-concurrent-requests" not in tgi
    with pytest.raises(LaunchError, match="fp8_e4m3 and fp8_e5m2"):
        argv(runtime="tgi", kv_cache_dtype="q8_0")

    server, _ = argv(runtime="llama-server", context_length=4096, max_running_requests=4, kv_cache_dtype="q8_0")
    # -c is split among the slots: each of the 4 gets the whole 4096
    assert flag(server, "-c") == "16384" and flag(server, "-np") == "4" and flag(server, "-ctv") == "q8_0"
    assert flag(server, "-fa") == "on"  # a quantized V cache needs flash attention
    with pytest.raises(LaunchError, match="split-mode"):
        argv(runtime="llama-server", tensor_parallel=2)

    python_server, _ = argv(runtime="llama-cpp-python", context_length=2048, kv_cache_dtype="q8_0")
    assert flag(python_server, "--n_ctx") == "2048" and flag(python_server, "--interrupt_requests") == "False"
    assert flag(python_server, "--type_k") == "8"
    with pytest.raises(LaunchError, match="serializes requests"):
        argv(runtime="llama-cpp-python", max_running_requests=4)


@pytest.mark.slow
def test_launched_llama_cpp_python_is_served_through_the_gateway(tmp_path):
    port = free_port()
    upstream = f"http://127.0.0.1:{port}"
    supervisor = subprocess.Popen([sys.executable, "-m", "gateway", "launch", "llama-cpp-python", "--model",
                                   str(default_model_path()), "--port", str(port), "--context-length", "2048",
                                   "--", "--model_alias", "smollm2"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        backend = LlamaCppServerBackend(llama_server_config(upstream, "smollm2", python_server=True,
                                                            max_context=2048))
        wait_ready(upstream, path="/v1/models", process=supervisor)
        with serve_app(gateway_app({"smollm2": backend}, tmp_path)) as url:
            wait_ready(url)
            reply = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=60, json={
                "model": "smollm2", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 5})
            assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"]
    finally:
        supervisor.send_signal(signal.SIGTERM)
        supervisor.wait(timeout=60)
    with pytest.raises(httpx.TransportError):  # stopping the supervisor stopped the runtime
        httpx.get(f"{upstream}/v1/models", timeout=2)


@pytest.mark.slow
def test_a_runtime_that_does_not_start_is_an_error_that_quotes_it(tmp_path):
    missing = tmp_path / "missing.gguf"
    done = subprocess.run([sys.executable, "-m", "gateway", "launch", "llama-cpp-python", "--model", str(missing),
                           "--port", str(free_port())], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("error: "), done.stderr
    assert "exited with code 1" in done.stderr and f"Model path does not exist: {missing}" in done.stderr
