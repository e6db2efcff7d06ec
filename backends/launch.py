"""Start a runtime as a supervised subprocess from one normalized spec.

The flags each runtime spells differently come from the project's reference notes (TGI's
launcher.md; vLLM 0.33 `vllm/engine/arg_utils.py`; SGLang 0.5.23 `arg_groups/fields/*.py`;
llama.cpp's `tools/server/README.md`; llama-cpp-python's `server/settings.py`). The trap they
call out: SGLang's `--max-total-tokens` is the size of its KV memory pool, not a per-request
context cap (that is `--context-length`), while TGI's `--max-total-tokens` is the context cap.
"""

from __future__ import annotations

import contextlib
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx

from .cpu import for_this_cpu
from .runtimes import RUNTIMES as REGISTRY

Runtime = Literal["vllm", "sglang", "llama-server", "tgi", "llama-cpp-python"]  # `servegate launch` names
RUNTIMES: tuple[str, ...] = tuple(r.launch for r in REGISTRY.values() if r.launch)
READY_PATH = {"vllm": "/health", "sglang": "/health", "llama-server": "/health", "tgi": "/health",
              "llama-cpp-python": "/v1/models"}  # llama-cpp-python's server has no /health
# ggml type ids, as llama-cpp-python's `type_k` / `type_v` take them (ggml.h `enum ggml_type`).
GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}
# TGI spells e4m3 `fp8_e4m3fn`; vLLM and SGLang spell it `fp8_e4m3`.
TGI_KV = {"fp8_e4m3": "fp8_e4m3fn", "fp8_e5m2": "fp8_e5m2"}


class LaunchError(ValueError):
    """The spec asks for something this runtime cannot do (the message says what instead)."""


class ServerNotReady(RuntimeError):
    """A supervised server exited, or did not answer in time, before it was ready (the message
    quotes its last output)."""


@dataclass
class LaunchSpec:
    runtime: Runtime
    model: str
    port: int
    host: str = "127.0.0.1"
    context_length: int | None = None  # prompt + output, per request
    tensor_parallel: int = 1
    expert_parallel: bool = False  # the MoE experts split across the tensor-parallel devices
    kv_cache_dtype: str | None = None  # fp8_e4m3, fp8_e5m2 (GPU runtimes); q8_0, q4_0, f16... (llama.cpp)
    max_running_requests: int | None = None
    prefix_caching: bool | None = None  # None: the runtime's default (on for all of these)
    pipeline_parallel: int = 1
    data_parallel: int = 1  # engine replicas the runtime itself balances
    kv_tokens: int | None = None  # llama.cpp: one KV pool of this many tokens shared by the slots
    lora_modules: dict[str, str] = field(default_factory=dict)  # adapter name -> path or hub id
    # Adapters one batch may mix; set without `lora_modules`, LoRA is enabled for adapters loaded at
    # run time (vLLM, SGLang).
    max_loras: int | None = None
    max_lora_rank: int | None = None
    extra_args: list[str] = field(default_factory=list)

    @property
    def lora(self) -> bool:
        return bool(self.lora_modules or self.max_loras)


def lora_modules(pairs: list[str]) -> dict[str, str]:
    """NAME=PATH pairs as given on a command line, each name once."""
    modules = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not (sep and name.strip() and path.strip()) or any(c.isspace() or c in ",=" for c in name):
            raise LaunchError(f"LoRA adapter {pair!r}: NAME=PATH, the name without spaces, commas or '='")
        if name in modules:
            raise LaunchError(f"LoRA adapter {name!r} is given twice")
        modules[name] = path
    return modules


def servegate_line(spec: LaunchSpec) -> str:
    """`servegate launch` with the flags that build `spec`."""
    flags = [spec.runtime, "--model", spec.model, "--port", str(spec.port),
             *_opt("--context-length", spec.context_length),
             *_opt("--tp", spec.tensor_parallel if spec.tensor_parallel > 1 else None),
             *_opt("--pp", spec.pipeline_parallel if spec.pipeline_parallel > 1 else None),
             *_opt("--dp", spec.data_parallel if spec.data_parallel > 1 else None),
             *(["--expert-parallel"] if spec.expert_parallel else []),
             *_opt("--kv-cache-dtype", spec.kv_cache_dtype), *_opt("--max-running-requests", spec.max_running_requests),
             *_opt("--kv-tokens", spec.kv_tokens),
             *(arg for pair in _pairs(spec.lora_modules) for arg in ("--lora", pair)),
             *_opt("--max-loras", spec.max_loras), *_opt("--max-lora-rank", spec.max_lora_rank)]
    return shlex.join(["servegate", "launch", *flags])


def command(spec: LaunchSpec) -> tuple[list[str], dict[str, str]]:
    """The runtime's command line and extra environment for `spec`."""
    build = {"vllm": _vllm, "sglang": _sglang, "llama-server": _llama_server, "tgi": _tgi,
             "llama-cpp-python": _llama_cpp_python}[spec.runtime]
    argv, env = build(spec)
    return argv + spec.extra_args, env


def shell_line(spec: LaunchSpec, portable: bool = False) -> str:
    """The command of `spec` as one shell line, environment first; `portable` writes `python` for
    this machine's interpreter, for a plan to run elsewhere."""
    argv, env = command(spec)
    if portable and argv[0] == sys.executable:
        argv = ["python", *argv[1:]]
    return " ".join([*(f"{k}={v}" for k, v in env.items()), shlex.join(argv)])


def _opt(flag: str, value) -> list[str]:
    return [] if value is None else [flag, str(value)]


def _tp(s: LaunchSpec) -> int | None:
    return s.tensor_parallel if s.tensor_parallel > 1 else None


# vLLM's usage counts the prompt tokens its prefix cache served only with this flag; the ledger bills them
# at the cached price.
VLLM_CACHED_TOKENS_FLAG = "--enable-prompt-tokens-details"


# vLLM's LoRAConfig.max_lora_rank is one of these (vllm/config/lora.py, MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# vLLM serves /v1/load_lora_adapter and /v1/unload_lora_adapter only with this set to 1 or true
# (vllm/envs.py, entrypoints/serve/lora/api_router.py; 0.32).
VLLM_RUNTIME_LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def lora_rank_for_vllm(rank: int) -> int:
    """The smallest rank vLLM takes that holds adapters of `rank`."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise LaunchError(f"vLLM's largest LoRA rank is {VLLM_LORA_RANKS[-1]}, not {rank}")
    return fits[0]


def _pairs(modules: dict[str, str]) -> list[str]:
    return [f"{name}={path}" for name, path in modules.items()]


def _vllm(s: LaunchSpec):
    argv = ["vllm", "serve", s.model, "--host", s.host, "--port", str(s.port),
            *_opt("--max-model-len", s.context_length), *_opt("--tensor-parallel-size", _tp(s)),
            *_opt("--pipeline-parallel-size", s.pipeline_parallel if s.pipeline_parallel > 1 else None),
            *_opt("--data-parallel-size", s.data_parallel if s.data_parallel > 1 else None),
            *_opt("--kv-cache-dtype", s.kv_cache_dtype), *_opt("--max-num-seqs", s.max_running_requests),
            VLLM_CACHED_TOKENS_FLAG]
    if s.lora:
        argv += ["--enable-lora", "--max-loras", str(s.max_loras or len(s.lora_modules)),
                 *_opt("--max-lora-rank", s.max_lora_rank and lora_rank_for_vllm(s.max_lora_rank))]
    if s.lora_modules:
        argv += ["--lora-modules", *_pairs(s.lora_modules)]
    if s.expert_parallel:  # its EP size is the TP size (docs/serving/expert_parallel_deployment)
        argv.append("--enable-expert-parallel")
    if s.prefix_caching is not None:
        argv.append("--enable-prefix-caching" if s.prefix_caching else "--no-enable-prefix-caching")
    return argv, VLLM_RUNTIME_LORA_ENV if s.lora else {}


def _sglang(s: LaunchSpec):
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", s.model, "--host", s.host, "--port",
            str(s.port), *_opt("--context-length", s.context_length),  # never --max-total-tokens: the KV pool
            *_opt("--tp-size", _tp(s)), *_opt("--ep-size", s.tensor_parallel if s.expert_parallel else None),
            *_opt("--pp-size", s.pipeline_parallel if s.pipeline_parallel > 1 else None),
            *_opt("--dp-size", s.data_parallel if s.data_parallel > 1 else None),
            *_opt("--kv-cache-dtype", s.kv_cache_dtype), *_opt("--max-running-requests", s.max_running_requests),
            "--enable-cache-report"]  # its usage then counts the prompt tokens its radix cache served
    if s.lora:
        argv += ["--enable-lora", *_opt("--max-loras-per-batch", s.max_loras),
                 *_opt("--max-lora-rank", s.max_lora_rank)]
    if s.lora_modules:
        argv += ["--lora-paths", *_pairs(s.lora_modules)]
    elif s.lora:
        # Its LoRA memory pool is sized from the adapters at launch, or from both flags
        # (sglang 0.5.23 arg_groups/lora_hook.py `check_lora_server_args`).
        if not s.max_lora_rank:
            raise LaunchError("SGLang without adapters at launch needs the largest rank of those loaded later")
        argv += ["--lora-target-modules", "all"]
    if s.prefix_caching is False:
        argv.append("--disable-radix-cache")
    return argv, {}


def _tgi(s: LaunchSpec):
    _no_expert_parallel(s, "TGI shards experts by tensor parallelism only")
    _one_engine(s, "TGI")
    if s.kv_cache_dtype is not None and s.kv_cache_dtype not in TGI_KV:
        raise LaunchError(f"TGI's KV cache dtypes are fp8_e4m3 and fp8_e5m2, not {s.kv_cache_dtype!r}")
    argv = ["text-generation-launcher", "--model-id", s.model, "--hostname", s.host, "--port", str(s.port),
            *_opt("--max-total-tokens", s.context_length),
            *_opt("--num-shard", _tp(s)),
            *_opt("--kv-cache-dtype", TGI_KV.get(s.kv_cache_dtype or "")),
            # The running batch; TGI's --max-concurrent-requests is an admission limit (429 beyond it).
            *_opt("--max-batch-size", s.max_running_requests)]
    _adapters_at_launch(s)
    if s.lora_modules:  # adapter ids or name=path pairs, loaded at start (launcher --lora-adapters)
        argv += ["--lora-adapters", ",".join(_pairs(s.lora_modules))]
    # Prefix caching is no TGI flag: the PREFIX_CACHING environment variable (default true).
    return argv, {} if s.prefix_caching is None else {"PREFIX_CACHING": "1" if s.prefix_caching else "0"}


def _adapters_at_launch(s: LaunchSpec) -> None:
    if s.lora and not s.lora_modules:
        raise LaunchError(f"{s.runtime} loads LoRA adapters at launch only: name them")


def _no_expert_parallel(s: LaunchSpec, reason: str) -> None:
    if s.expert_parallel:
        raise LaunchError(f"{s.runtime} has no expert parallelism: {reason}")


def _one_engine(s: LaunchSpec, name: str) -> None:
    if s.pipeline_parallel > 1 or s.data_parallel > 1:
        raise LaunchError(f"{name} has no pipeline or data parallelism: run replicas behind the gateway")


def _no_tensor_parallel(s: LaunchSpec, instead: str) -> None:
    _no_expert_parallel(s, "it runs a model on one device or splits its layers")
    if s.tensor_parallel > 1:
        raise LaunchError(f"{s.runtime} has no tensor parallelism here; {instead}")


def _llama_server(s: LaunchSpec):
    _no_tensor_parallel(s, "llama-server splits layers across GPUs with --split-mode/--tensor-split")
    if s.data_parallel > 1:
        raise LaunchError("llama-server is one engine: run replicas behind the gateway")
    argv = ["llama-server", "-m", s.model, "--host", s.host, "--port", str(s.port)]
    if s.kv_tokens:
        # One pool shared by the slots (-c is then every slot's limit too), each request capped
        # at the context asked for.
        argv += ["-c", str(s.kv_tokens), "--kv-unified", *_opt("--kv-unified-per-slot", s.context_length)]
    else:
        # `-c` is the total context, split evenly among the `-np` slots: give every slot the
        # whole per-request context.
        argv += _opt("-c", s.context_length * (s.max_running_requests or 1) if s.context_length else None)
    argv += _opt("-np", s.max_running_requests)
    _adapters_at_launch(s)
    for path in s.lora_modules.values():  # GGUF files (llama.cpp's convert_lora_to_gguf.py makes them)
        argv += ["--lora", path]
    if s.lora_modules:
        # Not applied at load (common/common.cpp); a request without `lora` still gets each adapter at
        # its launch scale, 1.0 (GET /lora-adapters): servegate's say `lora` always (backends/llamacpp.py).
        argv.append("--lora-init-without-apply")
    if s.kv_cache_dtype:
        # A quantized V cache needs flash attention in llama.cpp.
        argv += ["-ctk", s.kv_cache_dtype, "-ctv", s.kv_cache_dtype, "-fa", "on"]
    if s.prefix_caching is False:
        raise LaunchError("llama-server reuses prompts per slot (cache_prompt, per request); "
                          "send cache_prompt=false instead of a launch flag")
    return argv, {}


def _llama_cpp_python(s: LaunchSpec):
    _no_tensor_parallel(s, "use llama-server for several GPUs")
    _adapters_at_launch(s)
    if len(s.lora_modules) > 1 or s.data_parallel > 1:
        raise LaunchError("llama-cpp-python's server loads one model and one LoRA adapter: use llama-server")
    if (s.max_running_requests or 1) > 1:
        raise LaunchError("llama-cpp-python's server serializes requests; for several at once use "
                          "llama-server -np N or servegate's in-process llama.cpp pool (kind: llama-cpp)")
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", s.model, "--host", s.host, "--port", str(s.port),
            *_opt("--n_ctx", s.context_length),
            "--interrupt_requests", "False"]  # its default ends a running stream whenever a new request comes
    for path in s.lora_modules.values():
        argv += ["--lora_path", path]
    if s.kv_cache_dtype:
        if s.kv_cache_dtype not in GGML_TYPES:
            raise LaunchError(f"unknown llama.cpp KV type {s.kv_cache_dtype!r}: one of {', '.join(GGML_TYPES)}")
        argv += ["--type_k", str(GGML_TYPES[s.kv_cache_dtype]), "--type_v", str(GGML_TYPES[s.kv_cache_dtype]),
                 "--flash_attn", "True"]
    return argv, {}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def supervised(argv: list[str], url: str, ready_path: str, env: dict[str, str] | None = None,
               timeout_s: float = 600.0, headers: dict[str, str] | None = None,
               cwd: Path | None = None) -> Iterator[subprocess.Popen]:
    """Run a server (in `cwd`, if given) until the block ends; yields its process once
    `url + ready_path` answers 200.
    llama.cpp servers run with the kernels this CPU can run (`cpu.for_this_cpu`). Its output
    goes to a temporary log, quoted when it fails to start. Stops it with SIGTERM, then SIGKILL
    after a grace period."""
    import os
    import tempfile

    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(for_this_cpu(argv), env={**os.environ, **(env or {})}, stdout=log,
                                   stderr=subprocess.STDOUT, cwd=cwd)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(url + ready_path, timeout=5, headers=headers).status_code == 200:
                        break
                if process.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    state = f"exited with code {process.returncode}" if process.returncode is not None else \
                        f"was not ready within {timeout_s:g} s"
                    raise ServerNotReady(f"{argv[0]} {state}; its last output:\n{log.read()[-3000:]}")
                time.sleep(0.25)
            yield process
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextlib.contextmanager
def launched(spec: LaunchSpec, timeout_s: float = 600.0) -> Iterator[str]:
    """Run the runtime of `spec` until the block ends; yields its base URL once it is ready."""
    argv, env = command(spec)
    url = f"http://{spec.host}:{spec.port}"
    with supervised(argv, url, READY_PATH[spec.runtime], env, timeout_s):
        yield url
