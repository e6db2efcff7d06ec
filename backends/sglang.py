"""SGLang's server, through its OpenAI-compatible routes or (`native=True`, for prompts) its own
`/generate`, whose stream carries the cumulative text by default (`--incremental-streaming-output`
makes it incremental: say so with `incremental=True`) and the usage in `meta_info`.

Facts for sglang 0.5.23 (the project's reference notes, from `entrypoints/http_server.py`,
`entrypoints/openai/protocol.py`, `managers/tokenizer_manager.py` and the metrics collector):
errors on the OpenAI routes are a *flat* `{"object": "error", "message", "type", "param",
"code"}` (wrapped as `{"error": {...}}` inside streams); native `/generate` stream errors are
`{"error": {"message"}}` with no code, typed by their message (`error_from_body`);
`/v1/models` carries `max_model_len`; `/health` runs a one-token generation
and is 503 while starting; `/flush_cache` empties the radix cache; `/server_info` carries the
server arguments (`context_length`, `disable_radix_cache`) and `version`; `/metrics`
(`sglang:*`) exists only with `--enable-metrics`. The radix (prefix) cache is on unless
`--disable-radix-cache`; a request's `cache_salt` (OpenAI routes and `/generate`) namespaces it."""

from __future__ import annotations

from collections.abc import AsyncIterator

from . import fields
from .base import Capabilities, Delta, Event, Finish, GenerateRequest, Load, UpstreamError, Usage, reported_count
from .openai_compat import OpenAICompatBackend, OpenAICompatConfig, error_from_body


class SGLangBackend(OpenAICompatBackend):
    EXTRA_FIELDS = fields.SGLANG
    TAKES_CACHE_SALT = True  # its radix tree keys every child on it (`mem_cache/radix_cache.py`, `RadixKey`)
    # `/health` runs a one-token generation and waits up to SGLANG_HEALTH_CHECK_TIMEOUT (20 s) for
    # it (`http_server.py`): under load that is no sign of a dead server.
    HEALTH_TIMEOUT_S = 25.0

    def __init__(self, config: OpenAICompatConfig, name: str = "sglang", native: bool = False,
                 incremental: bool = False) -> None:
        config.runtime = "sglang"
        super().__init__(config, name)
        self.native, self.incremental = native, incremental
        self.server_info: dict = {}

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        if not self.native or request.messages is not None or request.n != 1:
            async for event in super().generate(request):
                yield event
            return
        params = {"max_new_tokens": request.max_tokens, "temperature": request.temperature, "top_p": request.top_p,
                  "top_k": request.top_k or None, "stop": list(request.stop) or None,
                  "stop_token_ids": list(request.stop_token_ids) or None, "ignore_eos": request.ignore_eos or None,
                  "sampling_seed": request.seed, **request.extra}
        body = {"sampling_params": {k: v for k, v in params.items() if v is not None}, "stream": True}
        prompt = request.prompt
        body |= {"text": prompt} if prompt is not None else {"input_ids": list(request.prompt_token_ids)}
        if request.cache_salt:
            body["cache_salt"] = request.cache_salt
        sent, meta = "", {}
        async for chunk in self.stream_events("/generate", body, request.trace_headers):
            if "error" in chunk:
                raise error_from_body(chunk)
            text, meta = chunk.get("text", ""), chunk.get("meta_info") or {}
            piece = text if self.incremental else text[len(sent):]
            sent = sent + piece if self.incremental else text
            reason = (meta.get("finish_reason") or {}).get("type")
            if reason == "abort":
                raise UpstreamError(f"SGLang aborted the request: {meta['finish_reason'].get('message', '')}")
            if piece or reason:
                yield Delta(0, piece, (), reason)
        if not (meta.get("finish_reason") or {}).get("type"):
            raise UpstreamError("SGLang ended the stream before the request finished")
        counts = (meta.get(k) or 0 for k in ("prompt_tokens", "completion_tokens", "cached_tokens"))
        yield Finish((meta["finish_reason"]["type"],), Usage(*counts))

    async def start(self) -> None:
        await super().start()
        self.server_info = await self.get_json("/server_info")
        if not self._max_context:  # `context_length` is a server argument; null when the model's own applies
            self._max_context = reported_count(self.server_info.get("context_length"))

    async def capabilities(self) -> Capabilities:
        return Capabilities(runtime="sglang", version=str(self.server_info.get("version", "")), model=self.config.model,
                            max_context=self._max_context,
                            prefix_caching=not self.server_info.get("disable_radix_cache", False))

    async def load(self) -> Load:
        m = await self.scrape()  # empty unless the server runs with --enable-metrics
        return Load(
            running=reported_count(m.total("sglang:num_running_reqs")),
            waiting=reported_count(m.total("sglang:num_queue_reqs")),
            kv_usage=m.mean("sglang:token_usage") or 0.0, prefix_hit_rate=m.mean("sglang:cache_hit_rate"),
            details=m.pick(prompt_tokens_total="sglang:prompt_tokens_total",
                           cached_tokens_total="sglang:cached_tokens_total",
                           generation_tokens_total="sglang:generation_tokens_total"),
        )

    async def flush_cache(self) -> bool:
        async with self.client.post("/flush_cache") as response:
            return response.status == 200
