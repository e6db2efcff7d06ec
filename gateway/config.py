"""`servegate.yaml`: the backends an operator declares, each served under its model name.

```yaml
backends:
  - name: local                 # the built-in engine
    kind: builtin
    model: /models/model.gguf   # optional: the default model
    options: {kv_cache_tokens: 32768}
  - name: vllm-a                # vLLM (or kind: sglang, tgi, llama-server, openai for any other)
    kind: vllm
    url: http://10.0.0.5:8000
    model: meta-llama/Llama-3.1-8B-Instruct
    served_name: llama-3.1-8b   # what clients ask for (default: model)
  - name: edge                  # llama.cpp in process, a pool of slots
    kind: llama-cpp
    options: {slots: 4, n_ctx: 4096}
```
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from backends.base import Backend


class BackendSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    kind: Literal["builtin", "llama-cpp", "openai", "vllm", "sglang", "tgi", "llama-server", "llama-cpp-server",
                  "trtllm", "lmdeploy", "ollama", "xinference"]
    url: str | None = None
    model: str = ""
    served_name: str | None = None
    api_key: str | None = None
    options: dict[str, Any] = {}

    def build(self) -> Backend:
        if self.kind == "builtin":
            from backends.builtin import BuiltinBackend, EngineConfig

            return BuiltinBackend(EngineConfig(model=self.model, served_name=self.served_name or "", **self.options),
                                  name=self.name)
        if self.kind == "llama-cpp":
            from backends.llamacpp import LlamaCppBackend, LlamaCppConfig

            return LlamaCppBackend(LlamaCppConfig(model=self.model, served_name=self.served_name or "",
                                                  **self.options), name=self.name)
        if not self.url or not self.model:
            raise ValueError(f"backend {self.name!r}: kind {self.kind} needs `url` and `model`")
        from backends import llamacpp, openai_compat, profiles, sglang, tgi, vllm

        if self.kind in ("llama-server", "llama-cpp-server"):
            config = llamacpp.llama_server_config(self.url, self.model, python_server=self.kind == "llama-cpp-server",
                                                  api_key=self.api_key, **self.options)
            return llamacpp.LlamaCppServerBackend(config, name=self.name)
        config = openai_compat.OpenAICompatConfig(base_url=self.url, model=self.model, api_key=self.api_key,
                                                  **self.options)
        if self.kind in profiles.PROFILES:
            return profiles.ProfileBackend(config, self.kind, name=self.name)
        adapter = {"openai": openai_compat.OpenAICompatBackend, "vllm": vllm.VLLMBackend,
                   "sglang": sglang.SGLangBackend, "tgi": tgi.TGIBackend}[self.kind]
        return adapter(config, name=self.name)


class GatewayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    backends: list[BackendSpec]


def load_backends(path: Path) -> dict[str, Backend]:
    """served model name -> backend, from a `servegate.yaml`; errors name the file and field."""
    try:
        config = GatewayConfig.model_validate(yaml.safe_load(Path(path).read_text()) or {})
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ValueError(f"{path}: {'.'.join(map(str, first['loc']))}: {first['msg']}") from exc
    served: dict[str, Backend] = {}
    for spec in config.backends:
        backend = spec.build()
        name = spec.served_name or getattr(backend, "model_id", None) or spec.model
        if name in served:
            raise ValueError(f"{path}: two backends serve the model {name!r}")
        served[name] = backend
    return served
