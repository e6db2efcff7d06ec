"""`servegate.yaml`: the backends an operator declares, each served under its model name.

```yaml
backends:
  - name: local                 # the built-in engine
    kind: builtin
    model: /models/model.gguf   # optional: the default model
    options: {kv_cache_tokens: 32768}
  - name: vllm-a                # any OpenAI-compatible server
    kind: openai
    url: http://10.0.0.5:8000
    model: meta-llama/Llama-3.1-8B-Instruct
    served_name: llama-3.1-8b   # what clients ask for (default: model)
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
    kind: Literal["builtin", "openai"]
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
        from backends.openai_compat import OpenAICompatBackend, OpenAICompatConfig

        if not self.url or not self.model:
            raise ValueError(f"backend {self.name!r}: kind openai needs `url` and `model`")
        return OpenAICompatBackend(OpenAICompatConfig(base_url=self.url, model=self.model, api_key=self.api_key,
                                                      **self.options), name=self.name)


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
