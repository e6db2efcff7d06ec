"""OpenAI-compatible runtimes that differ from the generic adapter only in their side routes:
where health and version are. Each profile names the source its routes were checked against."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .base import Capabilities
from .openai_compat import OpenAICompatBackend, OpenAICompatConfig


@dataclass(frozen=True)
class Profile:
    health_path: str
    version_path: str | None
    source: str


PROFILES = {
    "trtllm": Profile("/health", "/version",
                      "NVIDIA/TensorRT-LLM docs/source/commands/trtllm-serve.rst: /v1/models, /v1/completions, "
                      "/v1/chat/completions, /health, /version; /metrics holds JSON iteration statistics (beta), "
                      "not Prometheus text"),
    "lmdeploy": Profile("/health", None,
                        "InternLM/lmdeploy lmdeploy/serve/openai/api_server.py (commit 002e7cf): GET /health answers "
                        "200; Prometheus /metrics only with --enable-metrics (docs: production metrics)"),
    "ollama": Profile("/api/version", "/api/version",
                      "ollama docs/api.md: GET /api/version -> {\"version\"}; OpenAI routes under /v1"),
    "mlx": Profile("/health", None,
                   "ml-explore/mlx-lm mlx_lm/server.py (release 0.32.2): GET /health answers 200, GET /v1/models; "
                   "OpenAI routes /v1/completions and /v1/chat/completions; no version route"),
    "xinference": Profile("/status", "/v1/cluster/version",
                          "xorbitsai/inference xinference/api/restful_api.py: GET /status (internal, no auth), "
                          "GET /v1/cluster/version (admin scope when auth is on), OpenAI routes under /v1"),
}


class ProfileBackend(OpenAICompatBackend):
    def __init__(self, config: OpenAICompatConfig, profile: str, name: str | None = None) -> None:
        self.profile = PROFILES[profile]
        config.runtime, config.health_path = profile, self.profile.health_path
        super().__init__(config, name or profile)
        self.version = ""

    async def start(self) -> None:
        await super().start()
        if self.profile.version_path:
            self.version = str((await self.get_json(self.profile.version_path)).get("version", ""))

    async def capabilities(self) -> Capabilities:
        return dataclasses.replace(await super().capabilities(), version=self.version)
