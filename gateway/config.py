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
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from backends import runtimes
from backends.base import Backend
from backends.runtimes import RUNTIMES


class BackendSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    kind: str  # a runtime id (backends/runtimes.py)
    url: str | None = None
    model: str = ""
    served_name: str | None = None
    api_key: str | None = None
    options: dict[str, Any] = {}

    @field_validator("kind")
    @classmethod
    def _known(cls, kind: str) -> str:
        kinds = [k for k in RUNTIMES if k != "litellm"]  # litellm providers are not declared in servegate.yaml
        if kind not in kinds:
            raise ValueError(f"unknown kind {kind!r}: one of {', '.join(kinds)}")
        return kind

    def build(self) -> Backend:
        return runtimes.build(self.kind, self.name, url=self.url, model=self.model, served_name=self.served_name,
                              api_key=self.api_key, options=self.options)


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
    names = [spec.name for spec in config.backends]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"{path}: two backends are named {name!r}")
    served: dict[str, Backend] = {}
    for spec in config.backends:
        backend = spec.build()
        name = spec.served_name or getattr(backend, "model_id", None) or spec.model
        if name in served:
            raise ValueError(f"{path}: two backends serve the model {name!r}")
        served[name] = backend
    return served
