"""vLLM's OpenAI-compatible server. Facts for vLLM 0.33.0 (the project's reference notes, from
`vllm/entrypoints/**` and `vllm/v1/metrics/loggers.py`): extra sampling parameters (`top_k`,
`min_p`, `repetition_penalty`, `structured_outputs`, ...) pass through untouched as request
extras; `/health` is 503 once the engine is dead; `/version`; `/tokenize`; `/v1/models` carries
`max_model_len`; live load from `/metrics`; 400 for invalid requests, 503 when its admission
limits refuse one (so clients retry elsewhere)."""

from __future__ import annotations

from . import fields
from .base import Capabilities, GenerateRequest, Load, TokenSpan, reported_count
from .openai_compat import OpenAICompatBackend, OpenAICompatConfig
from .tokenization import spans, vocabulary_bytes

# What of a chat request changes its prompt, as vLLM's `/tokenize` takes it (`TokenizeChatRequest`).
CHAT_TOKENIZE_FIELDS = ("tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
                        "add_special_tokens")


class VLLMBackend(OpenAICompatBackend):
    EXTRA_FIELDS = fields.VLLM
    TAKES_CACHE_SALT = True  # it salts the first block's hash

    def __init__(self, config: OpenAICompatConfig, name: str = "vllm") -> None:
        config.runtime = "vllm"
        super().__init__(config, name)
        self.version = ""

    async def start(self) -> None:
        await super().start()
        self.version = str((await self.get_json("/version")).get("version", ""))

    async def capabilities(self) -> Capabilities:
        return Capabilities(runtime="vllm", version=self.version, model=self.config.model,
                            max_context=self._max_context,
                            prefix_caching=True,  # on by default for decoder models (vllm/config/cache.py)
                            tokenize=True)

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
        m = await self.scrape()
        queries = m.total("vllm:prefix_cache_queries_total")
        return Load(
            running=reported_count(m.total("vllm:num_requests_running")),
            waiting=reported_count(m.total("vllm:num_requests_waiting")),
            kv_usage=m.mean("vllm:kv_cache_usage_perc") or 0.0,
            prefix_hit_rate=m.total("vllm:prefix_cache_hits_total") / queries if queries else None,
            details=m.pick(preemptions_total="vllm:num_preemptions_total",
                           prompt_tokens_total="vllm:prompt_tokens_total",
                           generation_tokens_total="vllm:generation_tokens_total"),
        )
