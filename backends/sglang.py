"""SGLang's server through its OpenAI-compatible routes. Facts for sglang 0.5.23 (the project's
reference notes, from `entrypoints/http_server.py`, `entrypoints/openai/protocol.py` and the
metrics collector): errors on the OpenAI routes are a *flat* `{"object": "error", "message",
"type", "param", "code"}` (wrapped as `{"error": {...}}` inside streams); `/health` runs a
one-token generation and is 503 while starting;
`/flush_cache` empties the radix cache; `/server_info` carries the server arguments
(`context_length`, `disable_radix_cache`) and `version`; `/metrics` (`sglang:*`) exists only with
`--enable-metrics`. The radix (prefix) cache is on unless `--disable-radix-cache`."""

from __future__ import annotations

from .base import Capabilities, Load
from .openai_compat import OpenAICompatBackend, OpenAICompatConfig, pick


class SGLangBackend(OpenAICompatBackend):
    def __init__(self, config: OpenAICompatConfig, name: str = "sglang") -> None:
        config.runtime = "sglang"
        super().__init__(config, name)
        self.server_info: dict = {}

    async def start(self) -> None:
        await super().start()
        self.server_info = await self.get_json("/server_info")
        if not self._max_context:  # `context_length` is a server argument; null when the model's own applies
            self._max_context = int(self.server_info.get("context_length") or 0)

    async def capabilities(self) -> Capabilities:
        return Capabilities(runtime="sglang", version=str(self.server_info.get("version", "")), model=self.config.model,
                            max_context=self._max_context,
                            prefix_caching=not self.server_info.get("disable_radix_cache", False))

    async def load(self) -> Load:
        m = await self.scrape()  # empty unless the server runs with --enable-metrics
        return Load(
            running=int(m.get("sglang:num_running_reqs", 0)), waiting=int(m.get("sglang:num_queue_reqs", 0)),
            kv_usage=m.get("sglang:token_usage", 0.0), prefix_hit_rate=m.get("sglang:cache_hit_rate"),
            details=pick(m, prompt_tokens_total="sglang:prompt_tokens_total",
                         cached_tokens_total="sglang:cached_tokens_total",
                         generation_tokens_total="sglang:generation_tokens_total"),
        )

    async def flush_cache(self) -> bool:
        async with self.client.post("/flush_cache") as response:
            return response.status == 200
