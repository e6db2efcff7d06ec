"""vLLM's OpenAI-compatible server. Facts for vLLM 0.33.0 (the project's reference notes, from
`vllm/entrypoints/**` and `vllm/v1/metrics/loggers.py`): extra sampling parameters (`top_k`,
`min_p`, `repetition_penalty`, `structured_outputs`, ...) pass through untouched as request
extras; `/health` is 503 once the engine is dead; `/version`; `/tokenize`; `/v1/models` carries
`max_model_len`; live load from `/metrics`; 400 for invalid requests, 503 when its admission
limits refuse one (so clients retry elsewhere).

LoRA (vLLM 0.32, `entrypoints/openai/models/serving.py`, `entrypoints/serve/lora/api_router.py`): a
request names an adapter as its `model`; `/v1/models` lists each loaded one with `parent` the base
model and `root` its path; `POST /v1/load_lora_adapter` {lora_name, lora_path} and
`/v1/unload_lora_adapter` {lora_name} exist only with VLLM_ALLOW_RUNTIME_LORA_UPDATING set. A missing
path is a 404 ("No adapter found for PATH"), an unknown adapter to unload a 404.

Embeddings (vLLM 0.32, the `embeddings` option): `/v1/embeddings` exists only where the served model is
a pooling model (`entrypoints/pooling/factories.py`, "embed" among its tasks), so the adapter is told;
`--runner pooling --convert embed` makes one of a decoder, pooling its last token's normalized final
hidden state (`model_executor/models/interfaces_base.py` `default_seq_pooling_type = "LAST"`,
`layers/pooler/seqwise/poolers.py` `pooler_for_embed`). `dimensions` is refused (400) for a model not
trained for Matryoshka embeddings (`pooling_params.py`); `cache_salt` salts its prefix cache there too
(`entrypoints/pooling/base/protocol.py`)."""

from __future__ import annotations

from . import fields
from .base import (
    Adapter,
    BackendError,
    Capabilities,
    GenerateRequest,
    InvalidRequest,
    Load,
    TokenSpan,
    reported_count,
)
from .openai_compat import OpenAICompatBackend, OpenAICompatConfig, message_of
from .tokenization import spans, vocabulary_bytes

# What of a chat request changes its prompt, as vLLM's `/tokenize` takes it (`TokenizeChatRequest`).
CHAT_TOKENIZE_FIELDS = ("tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
                        "add_special_tokens")
# An adapter that cannot serve the model is a 500 on the load route (any failure of the engine's
# `add_lora` but a missing path), in the words of vLLM's checks: `lora/peft_helper.py` `validate_legal`
# (rank, DoRA, bias, init) and `lora/model_manager.py` (target modules). The request's fault.
ADAPTER_REFUSALS = ("greater than max_lora_rank", "support", "target_modules")


class VLLMBackend(OpenAICompatBackend):
    EXTRA_FIELDS = fields.VLLM
    TAKES_CACHE_SALT = True  # it salts the first block's hash

    def __init__(self, config: OpenAICompatConfig, name: str = "vllm") -> None:
        config.runtime = "vllm"
        super().__init__(config, name)
        self.version = ""
        self.adapters: frozenset[str] = frozenset()

    async def start(self) -> None:
        await super().start()
        self.version = str((await self.get_json("/version")).get("version", ""))
        self.adapters = frozenset(await self.served_adapters() or ())

    async def capabilities(self) -> Capabilities:
        return Capabilities(runtime="vllm", version=self.version, model=self.config.model,
                            max_context=self._max_context,
                            prefix_caching=True,  # on by default for decoder models (vllm/config/cache.py)
                            tokenize=True, max_loras=self.config.max_loras, max_lora_rank=self.config.max_lora_rank,
                            adapters=self.adapters, embeddings=self.config.embeddings)

    def upstream_model(self, request: GenerateRequest) -> str:
        return request.adapter or self.config.model

    async def load_adapter(self, adapter: Adapter) -> None:
        served = await self.served_adapters()
        if served is None or adapter.name not in served:  # vLLM refuses a second load of a name (400)
            status, body = await self.post_route("/v1/load_lora_adapter",
                                                 {"lora_name": adapter.name, "lora_path": adapter.path})
            if status != 200:
                raise self._load_error(status, body, adapter)
        self.adapters |= {adapter.name}

    def _load_error(self, status: int, body: bytes, adapter: Adapter) -> BackendError:
        message = message_of(body)
        if status == 404 and "No adapter found" not in message:  # the route itself is missing
            return InvalidRequest(f"vLLM at {self.config.base_url} loads no LoRA adapters at run time: it runs "
                                  "without --enable-lora or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True", param="model")
        if status in (400, 404) or (status == 500 and any(words in message for words in ADAPTER_REFUSALS)):
            return InvalidRequest(f"LoRA adapter {adapter.name!r} at {adapter.path}: {message}", param="model")
        return self.error_for_status(status, body)

    async def unload_adapter(self, name: str) -> None:
        status, body = await self.post_route("/v1/unload_lora_adapter", {"lora_name": name})
        if status != 200:
            raise self.error_for_status(status, body)  # 404: ModelNotFound
        self.adapters -= {name}

    async def exact_prompt_tokens(self, request: GenerateRequest) -> int | None:
        """vLLM's `/tokenize`, which renders a chat as its chat route does (`TokenizeChatRequest`,
        with the request's own template switches and tools) and adds a text prompt's special tokens
        as its completions route does; `truncate_prompt_tokens` keeps the prompt's last ones."""
        if request.prompt_token_ids is not None:
            count = len(request.prompt_token_ids)
        else:
            fields = CHAT_TOKENIZE_FIELDS if request.messages is not None else ("add_special_tokens",)
            body = {k: request.extra[k] for k in fields if k in request.extra} | {"model": self.config.model}
            body |= {"messages": request.messages} if request.messages is not None else {"prompt": request.prompt}
            async with self.client.post("/tokenize", json=body) as response:
                if response.status != 200:
                    raise self.error_for_status(response.status, await response.read())
                count = reported_count((await response.json(content_type=None))["count"])
            if not count:  # no count a prompt can have: the reservation's stands
                return None
        keep = request.extra.get("truncate_prompt_tokens")
        return min(count, keep) if isinstance(keep, int) and keep > 0 else count

    async def tokenize(self, text: str) -> list[TokenSpan]:
        """vLLM's `/tokenize` (`vllm/entrypoints/serve/tokenize/protocol.py`): ids and, with
        `return_token_strs`, their vocabulary strings, from which the offsets follow."""
        body = {"model": self.config.model, "prompt": text, "add_special_tokens": False, "return_token_strs": True}
        async with self.client.post("/tokenize", json=body) as response:
            if response.status != 200:
                raise self.error_for_status(response.status, await response.read())
            answer = await response.json(content_type=None)
        return spans(text, answer["tokens"], [vocabulary_bytes(piece) for piece in answer["token_strs"]])

    async def load(self) -> Load:
        """From `/metrics`; the adapters it serves re-read from `/v1/models` (loaded or dropped by
        others since); as resident, those with requests in flight, running or next to run, from
        `vllm:lora_requests_info`'s current labels (`v1/metrics/loggers.py`, `stats.py`
        `LoRARequestStates`): vLLM says which its LoRA slots hold nowhere else."""
        m = await self.scrape()
        served = await self.served_adapters()
        if served is not None:
            self.adapters = frozenset(served)
        running = m.latest_labels("vllm:lora_requests_info").get("running_lora_adapters", "")
        queries = m.total("vllm:prefix_cache_queries_total")
        return Load(
            running=reported_count(m.total("vllm:num_requests_running")),
            waiting=reported_count(m.total("vllm:num_requests_waiting")),
            kv_usage=m.mean("vllm:kv_cache_usage_perc") or 0.0,
            prefix_hit_rate=m.total("vllm:prefix_cache_hits_total") / queries if queries else None,
            details=m.pick(preemptions_total="vllm:num_preemptions_total",
                           prompt_tokens_total="vllm:prompt_tokens_total",
                           generation_tokens_total="vllm:generation_tokens_total"),
            resident_adapters=frozenset(filter(None, running.split(","))),
        )
