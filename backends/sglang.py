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
`--disable-radix-cache`; a request's `cache_salt` (OpenAI routes and `/generate`) namespaces it.

LoRA (sglang 0.5.23): an OpenAI request names an adapter as `model` "BASE:ADAPTER", which wins over its
`lora_path` (`entrypoints/openai/serving_base.py` `_parse_model_parameter`); `/generate` by
`lora_path`, the adapter's name (`managers/io_struct.py` GenerateReqInput). `/v1/models` lists the
loaded ones with `parent` the base (`http_server.py` `available_models`). `POST /load_lora_adapter`
{lora_name, lora_path} and `/unload_lora_adapter` {lora_name} answer `{"success", "error_message",
"loaded_adapters"}`, 400 when `success` is false (`http_server.py`, `managers/tokenizer_control_mixin.py`,
`lora/lora_manager.py` `validate_new_adapter`, `lora/lora_registry.py` `unregister`). `/server_info`
carries `enable_lora`, `max_loras_per_batch` (adapters a batch may mix) and `max_lora_rank` (null
where inferred from `--lora-paths`).

Embeddings (the `embeddings` option): its `/v1/embeddings` serves a model launched with `--is-embedding`
only (`entrypoints/openai/serving_embedding.py`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from . import fields
from .base import (
    Adapter,
    Capabilities,
    Delta,
    Event,
    Finish,
    GenerateRequest,
    InvalidRequest,
    Load,
    ModelNotFound,
    UpstreamError,
    Usage,
    reported_count,
)
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
        self.adapters: frozenset[str] = frozenset()

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
        if request.adapter is not None:
            body["lora_path"] = request.adapter
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
        self.adapters = frozenset(await self.served_adapters() or ())

    async def capabilities(self) -> Capabilities:
        info = self.server_info
        return Capabilities(runtime="sglang", version=str(info.get("version", "")), model=self.config.model,
                            max_context=self._max_context, prefix_caching=not info.get("disable_radix_cache", False),
                            max_loras=reported_count(info.get("max_loras_per_batch")) if info.get("enable_lora") else 0,
                            max_lora_rank=reported_count(info.get("max_lora_rank")), adapters=self.adapters,
                            embeddings=self.config.embeddings)

    def upstream_model(self, request: GenerateRequest) -> str:
        return self.config.model if request.adapter is None else f"{self.config.model}:{request.adapter}"

    async def load_adapter(self, adapter: Adapter) -> None:
        served = await self.served_adapters()
        if served is None or adapter.name not in served:  # SGLang refuses a second load of a name
            status, body = await self.post_route("/load_lora_adapter",
                                                 {"lora_name": adapter.name, "lora_path": adapter.path})
            if status != 200:
                raise InvalidRequest(f"LoRA adapter {adapter.name!r} at {adapter.path}: {_update_error(body)}",
                                     param="model")
        self.adapters |= {adapter.name}

    async def unload_adapter(self, name: str) -> None:
        status, body = await self.post_route("/unload_lora_adapter", {"lora_name": name})
        if status != 200:
            message = _update_error(body)
            raise (ModelNotFound if "does not exist" in message else InvalidRequest)(message, param="model")
        self.adapters -= {name}

    async def load(self) -> Load:
        """From `/metrics`; the adapters it serves re-read from `/v1/models` (loaded or evicted since)."""
        m = await self.scrape()  # empty unless the server runs with --enable-metrics
        served = await self.served_adapters()
        if served is not None:
            self.adapters = frozenset(served)
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


def _update_error(body: bytes) -> str:
    """The `error_message` of SGLang's answer to an adapter's load or unload."""
    try:
        answer = json.loads(body)
    except ValueError:
        return body.decode(errors="replace")[:500]
    return str(answer.get("error_message") or answer) if isinstance(answer, dict) else str(answer)
