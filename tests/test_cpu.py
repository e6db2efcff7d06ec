"""llama.cpp runs on every CPU kind of this project: where the CPU reports AMX that the hypervisor
does not grant, llama.cpp's AMX kernels die with SIGILL (exit 132 of the whole test run); where
it grants it, llama.cpp's AMX path has died with SIGSEGV (exit 139). So the loading path skips
llama.cpp's extra buffer types wherever a child shows its AMX path failing. Each check runs
llama.cpp in a child process, so a crash is an exit status the test reads, not the end of the
test run."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from backends import cpu

GENERATE = """
import asyncio
from backends.base import Delta, GenerateRequest
from backends.llamacpp import LlamaCppBackend, LlamaCppConfig

async def main():
    backend = LlamaCppBackend(LlamaCppConfig(slots=1, n_ctx=256))
    await backend.start()
    request = GenerateRequest(request_id="cpu", model="m", prompt="The three primary colors are", max_tokens=4)
    text = "".join([e.text async for e in backend.generate(request) if isinstance(e, Delta)])
    await backend.close()
    assert text, "no text"
    import llama_cpp.llama_cpp as native
    print("use_extra_bufts", native.llama_model_default_params().use_extra_bufts)

asyncio.run(main())
"""


def child(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_llama_cpp_loads_and_generates_on_this_cpu():
    """The in-process backend's own loading path, as the gateway runs it: exit 0, never SIGILL."""
    done = child(GENERATE)
    assert done.returncode == 0, f"llama.cpp exited with {done.returncode}: {done.stderr[-2000:]}"
    expected = not cpu.llama_cpp_amx_fails()
    assert f"use_extra_bufts {expected}" in done.stdout


@pytest.mark.slow
def test_where_amx_is_refused_llama_cpp_runs_without_extra_buffer_types():
    """The guard's own path, forced on any machine: the model still loads and generates."""
    forced = "import backends.cpu as cpu\ncpu.llama_cpp_amx_fails = lambda: True\n" + GENERATE
    done = child(forced)
    assert done.returncode == 0, f"llama.cpp exited with {done.returncode}: {done.stderr[-2000:]}"
    assert "use_extra_bufts False" in done.stdout


@pytest.mark.slow
def test_the_probe_never_claims_amx_the_cpu_does_not_report():
    status = cpu.amx_probe()
    if "amx_tile" not in cpu.cpu_flags():
        assert status != 0 and not cpu.amx_reported_but_unusable()
    else:  # reported: usable exactly when the probe ran every instruction
        assert cpu.amx_reported_but_unusable() == (status != 0)


@pytest.mark.slow
def test_the_llama_cpp_verdict_is_what_llama_cpp_does_here():
    """Where the CPU reports AMX, the verdict is the probe child's fate; a failing child is a
    signal (the crash it stands in for), never a silent pass."""
    if "amx_tile" not in cpu.cpu_flags():
        assert not cpu.llama_cpp_amx_fails()
        return
    status = cpu.llama_amx_probe()
    assert cpu.llama_cpp_amx_fails() == (cpu.amx_reported_but_unusable() or status != 0)
    assert status in (0, -11, -4), f"the llama.cpp probe failed without a crash: {status}"


@pytest.mark.parametrize("refused", [True, False])
def test_server_command_lines_follow_the_verdict(monkeypatch, refused):
    monkeypatch.setattr(cpu, "llama_cpp_amx_fails", lambda: refused)
    python = [sys.executable, "-m", "llama_cpp.server", "--model", "m.gguf"]
    server = ["/opt/llama/bin/llama-server", "-m", "m.gguf"]
    other = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    if refused:
        assert cpu.for_this_cpu(python) == [sys.executable, "-m", "backends.cpu", "llama_cpp.server", "--model",
                                            "m.gguf"]
        assert cpu.for_this_cpu(server) == [*server, "--no-repack"]
    else:
        assert cpu.for_this_cpu(python) == python and cpu.for_this_cpu(server) == server
    assert cpu.for_this_cpu(other) == other


@pytest.mark.slow
def test_llama_cpp_python_server_runs_under_the_guard():
    """`python -m backends.cpu llama_cpp.server` is llama-cpp-python's own server, guarded."""
    done = subprocess.run([sys.executable, "-m", "backends.cpu", "llama_cpp.server", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "--n_ctx" in done.stdout


def test_dtype_auto_takes_bf16_only_where_the_cpu_multiplies_it_natively(monkeypatch):
    import torch

    from backends.builtin.worker.model_runner import pick_dtype

    cpu_device = torch.device("cpu")
    for flags, expected in [({"avx2", "fma"}, None), ({"avx512f", "avx512_bf16"}, "AVX512-BF16")]:
        monkeypatch.setattr(cpu, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert cpu.bf16_native() == expected
        dtype, why = pick_dtype("auto", cpu_device)
        assert dtype == (torch.bfloat16 if expected else torch.float32) and (expected or "no native bf16") in why
    assert pick_dtype("float32", cpu_device) == (torch.float32, "asked")  # asked for, it is what runs
