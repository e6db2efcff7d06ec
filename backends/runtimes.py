"""Every runtime servegate reaches, defined once: its id (a `servegate.yaml` backend's `kind`,
and what its adapter reports as `Capabilities.runtime`), its name for people, the support matrix
that describes it (`policies/matrices/<matrix>.yaml`), the `servegate launch` name when
servegate can start it (`backends.launch` renders the command), and how its adapter is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .base import Backend


@dataclass(frozen=True)
class Runtime:
    id: str
    name: str
    matrix: str | None = None  # its support matrix id, where one exists
    launch: str | None = None  # its `servegate launch` name, where servegate starts it
    remote: bool = True  # reached over HTTP: a backend of this kind needs `url` and `model`


RUNTIMES: dict[str, Runtime] = {r.id: r for r in (
    Runtime("builtin", "servegate's built-in engine", matrix="builtin", remote=False),
    Runtime("llama-cpp", "llama.cpp in process (llama-cpp-python)", matrix="llama-cpp", remote=False),
    Runtime("openai", "an OpenAI-compatible server"),
    Runtime("vllm", "vLLM", matrix="vllm", launch="vllm"),
    Runtime("sglang", "SGLang", matrix="sglang", launch="sglang"),
    Runtime("tgi", "Text Generation Inference", matrix="tgi", launch="tgi"),
    Runtime("llama-server", "llama.cpp's llama-server", matrix="llama-cpp", launch="llama-server"),
    Runtime("llama-cpp-server", "llama-cpp-python's server", matrix="llama-cpp", launch="llama-cpp-python"),
    Runtime("trtllm", "TensorRT-LLM (trtllm-serve)", matrix="tensorrt-llm"),
    Runtime("lmdeploy", "LMDeploy", matrix="lmdeploy"),
    Runtime("ollama", "Ollama", matrix="ollama"),
    Runtime("mlx", "MLX (mlx-lm server)", matrix="mlx"),
    Runtime("xinference", "Xinference"),
    Runtime("litellm", "a cloud provider through litellm"),
)}


def matrix_of(runtime: str) -> str | None:
    """The support matrix of a runtime id (None: unknown runtime, or none describes it)."""
    known = RUNTIMES.get(runtime)
    return known.matrix if known else None


def serving(matrix: str) -> Runtime | None:
    """The runtime a gateway backend uses to reach a server of this support matrix's runtime."""
    return next((r for r in RUNTIMES.values() if r.matrix == matrix and (r.remote or matrix == "builtin")), None)


def build(kind: str, name: str, *, url: str | None = None, model: str = "", served_name: str | None = None,
          api_key: str | None = None, options: dict[str, Any] | None = None) -> Backend:
    """The adapter of a backend of this kind (heavy runtimes are imported only when used)."""
    options = options or {}
    if kind not in RUNTIMES or kind == "litellm":
        raise ValueError(f"backend {name!r}: unknown kind {kind!r}")
    if kind == "builtin":
        from .builtin import BuiltinBackend, EngineConfig

        return BuiltinBackend(EngineConfig(model=model, served_name=served_name or "", **options), name=name)
    if kind == "llama-cpp":
        from .llamacpp import LlamaCppBackend, LlamaCppConfig

        return LlamaCppBackend(LlamaCppConfig(model=model, served_name=served_name or "", **options), name=name)
    if not url or not model:
        raise ValueError(f"backend {name!r}: kind {kind} needs `url` and `model`")
    from . import llamacpp, openai_compat, profiles, sglang, tgi, vllm

    if kind in ("llama-server", "llama-cpp-server"):
        config = llamacpp.llama_server_config(url, model, python_server=kind == "llama-cpp-server", api_key=api_key,
                                              **options)
        return llamacpp.LlamaCppServerBackend(config, name=name)
    config = openai_compat.OpenAICompatConfig(base_url=url, model=model, api_key=api_key, **options)
    if kind in profiles.PROFILES:
        return profiles.ProfileBackend(config, kind, name=name)
    adapter = {"openai": openai_compat.OpenAICompatBackend, "vllm": vllm.VLLMBackend,
               "sglang": sglang.SGLangBackend, "tgi": tgi.TGIBackend}[kind]
    return adapter(config, name=name)
