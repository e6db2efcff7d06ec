"""Any provider litellm supports (OpenAI, Azure, Anthropic, Bedrock, Vertex, hosted vLLM...) as a
backend, for fallback or overflow. litellm is imported lazily, off the event loop (its import
takes seconds), with its remote cost-map fetch disabled; calls go out with litellm's own retries
off (the gateway decides about retries), and its exceptions are mapped to the taxonomy.

Facts (litellm 1.110, the project's reference notes): every litellm exception subclasses the
`openai` SDK's; a context overflow is `ContextWindowExceededError`; a refused connection comes
back as `InternalServerError`, not `APIConnectionError`, so the cause chain is inspected to say
"unavailable" all the same.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from . import fields
from .base import (
    Backend,
    BackendError,
    BackendTimeout,
    Capabilities,
    ContextTooLong,
    Delta,
    Embeddings,
    EmbedRequest,
    Event,
    Finish,
    GenerateRequest,
    Health,
    InvalidRequest,
    Load,
    ModelNotFound,
    Overloaded,
    Price,
    Unavailable,
    UpstreamError,
    Usage,
    reported_count,
)
from .openai_compat import embeddings_of

REFUSED = ("connection refused", "connect call failed", "all connection attempts failed", "cannot connect")


@dataclass
class ProviderConfig:
    model: str  # litellm's model string, e.g. "openai/gpt-4o-mini", "anthropic/claude-sonnet-4-5"
    api_base: str | None = None
    api_key: str | None = None
    max_context: int = 0  # 0: litellm's model map says, where it knows the model
    options: dict[str, Any] = field(default_factory=dict)  # more litellm arguments (api_version, region...)
    embeddings: bool | None = None  # the model serves `embed`; None: as litellm's model map says (mode "embedding")


def list_price(info: dict[str, Any]) -> Price | None:
    """The price in litellm's model cost map (`model_prices_and_context_window.json`, bundled with
    litellm), per token there, per million tokens here."""
    per_token = [info.get(k) for k in ("input_cost_per_token", "output_cost_per_token", "cache_read_input_token_cost")]
    if per_token[0] is None or per_token[1] is None:
        return None
    return Price(*(None if cost is None else (Decimal(repr(cost)) * 10**6).normalize() for cost in per_token))


def _refused(exc: BaseException) -> bool:
    seen = exc
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError) or any(s in str(seen).lower() for s in REFUSED):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def map_error(litellm, exc: Exception) -> BackendError:
    """A litellm exception in the taxonomy (most specific classes first: they subclass each other)."""
    message = str(getattr(exc, "message", "") or exc)
    for kind, ours in ((litellm.ContextWindowExceededError, ContextTooLong), (litellm.NotFoundError, ModelNotFound),
                       (litellm.BadRequestError, InvalidRequest), (litellm.UnprocessableEntityError, InvalidRequest),
                       (litellm.RateLimitError, Overloaded), (litellm.ServiceUnavailableError, Unavailable),
                       (litellm.Timeout, BackendTimeout), (litellm.APIConnectionError, Unavailable)):
        if isinstance(exc, kind):
            return ours(message)
    if _refused(exc):
        return Unavailable(f"the provider cannot be reached: {message}")
    if isinstance(exc, litellm.AuthenticationError):
        return UpstreamError(f"the provider refused the gateway's credentials: {message}")
    return UpstreamError(message)


class ProviderBackend(Backend):
    EXTRA_FIELDS = fields.OPENAI

    def __init__(self, config: ProviderConfig, name: str = "provider") -> None:
        self.name, self.config = name, config
        self.litellm = None
        self.price: Price | None = None  # litellm's list price, once started

    async def start(self) -> None:
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch from the internet at import

        def load():
            import litellm

            return litellm

        self.litellm = await asyncio.to_thread(load)
        try:
            info = self.litellm.get_model_info(self.config.model)
        except Exception:  # noqa: BLE001  (litellm raises a bare Exception for unmapped models)
            info = {}
        if not self.config.max_context:
            self.config.max_context = reported_count(info.get("max_input_tokens") or info.get("max_tokens"))
        if self.config.embeddings is None:
            self.config.embeddings = info.get("mode") == "embedding"
        self.price = list_price(info)

    def _arguments(self, request: GenerateRequest) -> dict[str, Any]:
        c = self.config
        args = {**c.options, **request.extra, "model": c.model, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": request.temperature,
                "top_p": request.top_p, "n": request.n, "num_retries": 0}
        for key, value in (("api_base", c.api_base), ("api_key", c.api_key), ("max_tokens", request.max_tokens),
                           ("seed", request.seed), ("stop", list(request.stop) or None)):
            if value is not None:
                args[key] = value
        return args

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        if self.litellm is None:
            raise Unavailable("the provider client is still loading")
        if request.prompt_token_ids is not None:
            raise InvalidRequest("providers take text, not token ids", param="prompt")
        messages = request.messages or [{"role": "user", "content": request.prompt}]
        reasons: list[str | None] = [None] * request.n
        usage = Usage(0, 0)
        try:
            stream = await self.litellm.acompletion(messages=messages, **self._arguments(request))
            async for chunk in stream:
                if getattr(chunk, "usage", None):
                    u = chunk.usage
                    details = getattr(u, "prompt_tokens_details", None)
                    usage = Usage(u.prompt_tokens or 0, u.completion_tokens or 0,
                                  getattr(details, "cached_tokens", 0) or 0)
                for choice in chunk.choices or ():
                    text = getattr(choice.delta, "content", None) or ""
                    if choice.finish_reason:
                        reasons[choice.index] = choice.finish_reason
                    if text or choice.finish_reason:
                        yield Delta(choice.index, text, (), choice.finish_reason)
        except BackendError:
            raise
        except Exception as exc:  # noqa: BLE001  (every litellm failure, typed)
            raise map_error(self.litellm, exc) from exc
        yield Finish(tuple(r or "stop" for r in reasons), usage)

    async def embed(self, request: EmbedRequest) -> Embeddings:
        """litellm's `aembedding`, its answer checked as a remote runtime's is."""
        if self.litellm is None:
            raise Unavailable("the provider client is still loading")
        if not self.config.embeddings:
            return await super().embed(request)
        c = self.config
        args = {**c.options, "model": c.model, "num_retries": 0, "encoding_format": "float",
                "input": [item if isinstance(item, str) else list(item) for item in request.inputs]}
        for key, value in (("api_base", c.api_base), ("api_key", c.api_key), ("dimensions", request.dimensions)):
            if value is not None:
                args[key] = value
        try:
            answer = await self.litellm.aembedding(**args)
        except Exception as exc:  # noqa: BLE001  (every litellm failure, typed)
            raise map_error(self.litellm, exc) from exc
        return embeddings_of(answer.model_dump(), len(request.inputs), request.dimensions, self.name)

    async def capabilities(self) -> Capabilities:
        provider = self.config.model.split("/", 1)[0] if "/" in self.config.model else "litellm"
        return Capabilities(runtime="litellm", version=provider, model=self.config.model,
                            max_context=self.config.max_context, prefix_caching=False, price=self.price,
                            embeddings=bool(self.config.embeddings))

    async def health(self) -> Health:
        # A provider's health is known from its answers (the routing issue's circuit breaker), not a probe.
        return Health.READY if self.litellm is not None else Health.LOADING

    async def load(self) -> Load:
        return Load()
