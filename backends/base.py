"""The one interface every runtime is reached through.

A backend turns a `GenerateRequest` into an async stream of `Delta` events that ends with
exactly one `Finish` carrying usage. Closing the stream early (client gone, timeout) must
release whatever the backend holds for the request. Failures are raised as `BackendError`
subclasses so that the gateway can map them to HTTP statuses and fallback decisions.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import functools
import json
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from decimal import Decimal
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import msgspec


@dataclass(frozen=True)
class Tokenized:
    backend: str  # the backend's name: its tokenizer made the ids
    ids: tuple[int, ...]


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter of a backend's base model: the name requests use, where its weights lie (a
    PEFT directory, or a GGUF LoRA file from llama.cpp's converter, for the runtimes that read one),
    and the SHA-256 those files must still have (`adapter_files.snapshot`; None: not checked)."""

    name: str
    path: str
    digest: str | None = None


@dataclass(frozen=True)
class GenerateRequest:
    """What to generate. Exactly one of `prompt`, `prompt_token_ids`, `messages` is set."""

    request_id: str
    model: str = ""
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None  # chat: the backend applies its template
    max_tokens: int | None = None  # None: up to the model's context
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    extra: dict[str, Any] = field(default_factory=dict)  # runtime-specific, passed through untouched
    trace_headers: dict[str, str] = field(default_factory=dict)  # W3C `traceparent` for an upstream server
    # Prefix-cache namespace: cached prompt blocks serve only requests of the same salt (the
    # gateway gives each tenant its own), where the runtime can keep them apart.
    cache_salt: str | None = None
    # The prompt as a backend tokenized it to count it (`Backend.tokenize_prompt`): that backend
    # runs these ids rather than tokenizing again; any other ignores them. Never sent upstream.
    tokenized: Tokenized | None = None
    # The LoRA adapter to apply, by the name its backend knows it (`Backend.load_adapter`); None:
    # the base model.
    adapter: str | None = None
    # Whose request it is (the gateway sets the tenant's name): an engine shares its steps fairly
    # between tenants. Never sent upstream.
    tenant: str | None = None

    def __post_init__(self) -> None:
        given = [x is not None for x in (self.prompt, self.prompt_token_ids, self.messages)]
        if sum(given) != 1:
            raise InvalidRequest("exactly one of prompt, prompt_token_ids or messages must be given")


@dataclass(frozen=True)
class EmbedRequest:
    """Texts (or token ids) to embed, one vector each, by the model's pooling: the last token's
    hidden state or the mean of them all, normalized to unit length, as vLLM's pooling runner does
    for a decoder model. `dimensions` keeps the vector's first ones (re-normalized), where the
    model was trained for it (Matryoshka) or the runtime allows it."""

    request_id: str
    inputs: tuple[str | tuple[int, ...], ...]
    model: str = ""
    dimensions: int | None = None
    cache_salt: str | None = None
    tenant: str | None = None  # as `GenerateRequest.tenant`

    def __post_init__(self) -> None:
        if not self.inputs:
            raise InvalidRequest("input must not be empty", param="input")


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


# The largest token count any runtime here takes (int32): larger ones, from a client or an upstream,
# are refused or ignored before they reach quotas (Redis' Lua numbers), the ledger or a runtime.
MAX_TOKENS = 2**31 - 1
MAX_TOKEN_ID = 2**31 - 1  # likewise the largest token id (int32)
NANO_USD_PER_USD = 10**9


def check_sampling(request: GenerateRequest) -> None:
    """The sampling ranges every runtime here means the same by, for the backends that run the
    model themselves (remote runtimes check their own and answer in their words)."""
    if request.max_tokens is not None and request.max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be at least 1, got {request.max_tokens}", param="max_tokens")
    if request.temperature < 0:
        raise InvalidRequest("temperature must be >= 0", param="temperature")
    if not 0 < request.top_p <= 1:
        raise InvalidRequest("top_p must be in (0, 1]", param="top_p")
    if request.top_k < 0:
        raise InvalidRequest("top_k must be >= 0 (0 disables it)", param="top_k")


def completion_limit(max_tokens: int | None, context: int, prompt_tokens: int) -> int:
    """The most tokens a completion may take: `max_tokens` where the request sets it, else what the
    context leaves after the prompt (at least one)."""
    return max_tokens if max_tokens is not None else max(context - prompt_tokens, 1)


def reported_count(value: object) -> int:
    """A count a runtime reported (a context length, a token count, a gauge) as a whole number in
    [0, MAX_TOKENS]; 0 for anything else: negative, past int32, NaN, infinite, not a number, or a
    string of thousands of digits (which `int()` refuses with a ValueError)."""
    if isinstance(value, str) and value.isdigit() and len(value) <= 10:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_TOKENS:
        return 0  # NaN fails the range test too
    return int(value)  # money is counted in whole nano-dollars: exact, and a token at $0.001/M is 1


@dataclass(frozen=True)
class Price:
    """What a model's tokens cost, in USD per million tokens."""

    input: Decimal
    output: Decimal
    cached_input: Decimal | None = None  # prompt tokens read from a prefix cache; None: as `input`

    def cost(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> int:
        """Nano-dollars, rounded up: a provider bills what it bills, never less."""
        cached = self.input if self.cached_input is None else self.cached_input
        per_million = (prompt_tokens - cached_tokens) * self.input + cached_tokens * cached + \
            completion_tokens * self.output
        return math.ceil(per_million * NANO_USD_PER_USD / 10**6)


@dataclass(frozen=True)
class Delta:
    """New output of choice `index`. The last delta of a choice carries its finish reason."""

    index: int
    text: str
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None  # "stop" | "length" | "tool_calls" | "abort"
    # What an OpenAI-compatible runtime sent beside the text, passed through to OpenAI clients:
    # {"delta": {"tool_calls": [...], ...}, "logprobs": {...}}.
    extra: dict[str, Any] | None = None


@dataclass(frozen=True)
class Finish:
    """The one final event: every choice's finish reason and the request's usage."""

    finish_reasons: tuple[str, ...]
    usage: Usage


Event = Delta | Finish


@dataclass(frozen=True)
class Embeddings:
    """One vector per input, in order, and what they cost: the inputs' tokens, billed as prompt tokens."""

    vectors: list[list[float]]
    prompt_tokens: int


@dataclass(frozen=True)
class TokenSpan:
    """One token of a tokenized text: its id, its text, and where it lies (character offsets)."""

    id: int
    text: str
    start: int
    stop: int


@dataclass(frozen=True)
class Capabilities:
    runtime: str
    version: str
    model: str
    max_context: int
    prefix_caching: bool
    dtype: str | None = None  # weights and activations, where the runtime says
    kv_dtype: str | None = None
    weights: str | None = None  # how the weights are stored (quantized types), where the runtime says
    weight_bytes_per_token: int | None = None
    structured_output: bool = False
    tokenize: bool = False
    chat: bool = True
    features: frozenset[str] = frozenset()  # e.g. {"n", "seed", "stop", "logprobs"}
    price: Price | None = None  # the provider's list price, where it publishes one
    # LoRA: how many adapters a step may mix (0: the backend serves none), their largest rank, and the
    # adapters it can serve now (loaded, whether in its compute slots or not).
    max_loras: int = 0
    max_lora_rank: int = 0
    adapters: frozenset[str] = frozenset()
    embeddings: bool = False  # serves `embed`


class Health(enum.StrEnum):
    READY = "ready"
    LOADING = "loading"
    DOWN = "down"


@dataclass(frozen=True)
class Load:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV cache in use, 0..1
    prefix_hit_rate: float | None = None  # hit tokens / queried tokens
    # Runtime-specific figures (KV blocks, preemptions...): gauges, or running totals named *_total.
    details: dict[str, float] = field(default_factory=dict)
    # LoRA adapters in compute slots now (a request for one runs without loading it first).
    resident_adapters: frozenset[str] = frozenset()


class BackendError(Exception):
    """Base of the error taxonomy. `code` is stable and machine-readable."""

    code = "upstream_error"
    # The one definition of retryable: the backend's fault, not the request's, so the same
    # request may succeed on another target (failover), later (`Retry-After`), and the target's
    # circuit breaker counts it.
    retryable = False

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ContextTooLong(BackendError):
    code = "context_length_exceeded"


class InvalidRequest(BackendError):
    code = "invalid_request"


class ModelNotFound(BackendError):
    code = "model_not_found"


class Overloaded(BackendError):
    code = "overloaded"
    retryable = True


class Unavailable(BackendError):
    code = "unavailable"
    retryable = True


class BackendTimeout(BackendError):
    code = "timeout"
    retryable = True


class UpstreamError(BackendError):
    code = "upstream_error"
    retryable = True


MAX_LOGPROBS = 20  # top log-probabilities a token may carry: OpenAI's top_logprobs cap, vLLM's default --max-logprobs


def text_only(messages: list[dict]) -> list[dict]:
    """Chat messages with their OpenAI content parts joined into plain text, for a runtime that
    reads only strings (a GGUF's template concatenates `content`); any part but text is refused
    by name, as the client's. Parts are joined by a newline, as vLLM
    (`vllm/renderers/chat_utils.py`) and llama-server (`common/chat.cpp`) join them for a
    template that reads strings: one conversation is then one prompt on every backend."""
    plain = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise InvalidRequest(f"content part of type {kind!r} is not supported by this model",
                                         param="messages")
                texts.append(part.get("text", ""))
            message = {**message, "content": "\n".join(texts)}
        plain.append(message)
    return plain


# What a prompt may hold beyond its text, for `prompt_upper_bound`.
SPECIAL_TOKENS = 16  # tokens a tokenizer adds around a text (BOS, EOS)
PER_MESSAGE = 16  # a chat message's role header and separators
TEMPLATE_TOKENS = 512  # a chat template's own text: a default system prompt, dates, a tools preamble
MEDIA_TOKENS = 4096  # an image, audio or file part: the placeholder tokens a runtime expands it to
# Request fields a chat template renders into the prompt (vLLM's and llama-server's chat routes).
TEMPLATED_FIELDS = ("tools", "functions", "documents", "chat_template_kwargs", "tool_choice")
# The `chat_template_kwargs` a client may set, on the runtimes that take the field: the switches
# the model families' own templates read (Qwen3's and Granite's `enable_thinking`, DeepSeek-V3.1's
# `thinking`, gpt-oss's `reasoning_effort` and `builtin_tools`, Llama 3.x's `tools_in_user_message`
# and `date_string`), none that replaces the template or feeds it anything else (`chat_template`,
# which vLLM refuses there).
CHAT_TEMPLATE_KWARGS = frozenset({"enable_thinking", "thinking", "reasoning_effort", "builtin_tools",
                                  "tools_in_user_message", "date_string"})


def prompt_text_bytes(request: GenerateRequest) -> int:
    """The UTF-8 bytes of the prompt's text (a prompt, or the messages' text content): cheap, and
    what a lower bound of its tokens divides by the longest token."""
    if request.prompt is not None:
        return len(request.prompt.encode())
    if request.messages is None:
        return 0
    size = 0
    for message in request.messages:
        content = message.get("content")
        if isinstance(content, str):
            size += len(content.encode())
        elif isinstance(content, list):
            size += sum(len(part["text"].encode()) for part in content
                        if isinstance(part, dict) and isinstance(part.get("text"), str))
    return size


def request_bytes(request: GenerateRequest) -> int:
    """The JSON bytes of what a request carries to a runtime besides its settings: the prompt (text,
    ids or messages, however they were assembled) and the pass-through fields (tools, formats)."""
    return len(msgspec.json.encode([request.prompt, request.prompt_token_ids, request.messages, request.extra],
                                   enc_hook=str))


def prompt_upper_bound(request: GenerateRequest) -> int:
    """At least as many tokens as any runtime makes of this request's prompt, without its
    tokenizer: a byte-level tokenizer never emits more tokens than UTF-8 bytes; whatever a chat
    template renders besides the text (every other field of a message: tool calls and their ids,
    names; tools, documents, `chat_template_kwargs`) counts by its JSON bytes twice over (templates
    may indent it), media parts by `MEDIA_TOKENS` each, plus margins for special tokens and the
    template's own text."""
    if request.prompt_token_ids is not None:
        return len(request.prompt_token_ids)
    bound = prompt_text_bytes(request) + SPECIAL_TOKENS
    if request.messages is None:
        return bound
    rendered: list = [request.extra[name] for name in TEMPLATED_FIELDS if request.extra.get(name)]
    for message in request.messages:
        bound += PER_MESSAGE
        rendered.append({key: value for key, value in message.items() if key != "content"})
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if not (isinstance(part, dict) and isinstance(part.get("text"), str)):
                    bound += MEDIA_TOKENS
    return bound + TEMPLATE_TOKENS + 2 * len(json.dumps(rendered, ensure_ascii=False).encode())


def _check_template_kwargs(kwargs: Any) -> None:
    """`chat_template_kwargs` holds only the switches templates read (`CHAT_TEMPLATE_KWARGS`)."""
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise InvalidRequest("chat_template_kwargs must be an object", param="chat_template_kwargs")
    for key, value in kwargs.items():
        if key not in CHAT_TEMPLATE_KWARGS:
            raise InvalidRequest(f"chat_template_kwargs.{key} is not accepted (accepted: "
                                 f"{', '.join(sorted(CHAT_TEMPLATE_KWARGS))})", param=f"chat_template_kwargs.{key}")
        if not (value is None or isinstance(value, (bool, int, float, str))
                or (isinstance(value, list) and all(isinstance(item, str) for item in value))):
            raise InvalidRequest(f"chat_template_kwargs.{key} must be a boolean, a number, a string or a list of "
                                 "strings", param=f"chat_template_kwargs.{key}")


@functools.cache
def servegate_version() -> str:
    """This install's version, read once: reading a distribution's metadata walks the import path,
    and capabilities, asked once or more a request, carry it."""
    try:
        return version("servegate")
    except PackageNotFoundError:
        return "dev"


class Backend(abc.ABC):
    """An LLM runtime behind servegate. Implementations must be safe to call concurrently."""

    name: str
    # Request fields beyond GenerateRequest's that this backend passes to its runtime (backends/fields.py).
    EXTRA_FIELDS: frozenset[str] = frozenset()

    @property
    def extra_fields(self) -> frozenset[str]:
        return self.EXTRA_FIELDS

    def admit_extras(self, request: GenerateRequest) -> GenerateRequest:
        """`request` with only the extra fields this backend takes. One it does not take is refused
        by name when set; left at an empty or default-like value (clients send those), it is dropped."""
        unknown = [key for key in request.extra if key not in self.extra_fields]
        for key in unknown:
            if request.extra[key] not in (None, False, 0, "", [], {}):
                raise InvalidRequest(f"parameter {key!r} is not supported by backend {self.name!r}", param=key)
        _check_template_kwargs(request.extra.get("chat_template_kwargs"))
        if not unknown:
            return request
        return dataclasses.replace(request, extra={k: v for k, v in request.extra.items() if k not in unknown})

    async def start(self) -> None:
        """Connect or load. `health()` says LOADING until this is done."""

    async def close(self) -> None:
        """Release every resource; in-flight streams end with `Unavailable`."""

    @abc.abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """Stream deltas, then exactly one `Finish`. Raises `BackendError` subclasses."""

    @abc.abstractmethod
    async def capabilities(self) -> Capabilities: ...

    @abc.abstractmethod
    async def health(self) -> Health: ...

    @abc.abstractmethod
    async def load(self) -> Load: ...

    async def count_prompt_tokens(self, request: GenerateRequest) -> int:
        """Prompt tokens, for quota reservations and for billing where the runtime does not say:
        exact where a backend tokenizes itself, else `prompt_upper_bound`."""
        return prompt_upper_bound(request)

    async def tokenize_prompt(self, request: GenerateRequest) -> Tokenized | None:
        """The prompt as this backend will run it, where it tokenizes prompts itself (the caller
        passes it back in `GenerateRequest.tokenized`, so a prompt is tokenized once); else None."""
        return None

    def min_prompt_tokens(self, request: GenerateRequest) -> int:
        """A cheap lower bound of the prompt's tokens, known before counting them (which may cost
        time): a request whose bound already passes the context or a quota is refused without the
        count. 0 where the runtime's tokenizer is not known here."""
        return len(request.prompt_token_ids) if request.prompt_token_ids is not None else 0

    async def exact_prompt_tokens(self, request: GenerateRequest) -> int | None:
        """The prompt's tokens as the runtime itself counts them (its tokenizer, chat template and
        special tokens), asked of it: for a request that ended without the runtime's usage, billed
        the reservation's count otherwise. None where the runtime cannot say."""
        return None

    async def tokenize(self, text: str) -> list[TokenSpan]:
        raise InvalidRequest(f"backend {self.name!r} does not offer tokenization")

    async def embed(self, request: EmbedRequest) -> Embeddings:
        """One vector per input (`EmbedRequest`); InvalidRequest where this backend embeds nothing."""
        raise InvalidRequest(f"backend {self.name!r} does not serve embeddings", param="model")

    async def load_adapter(self, adapter: Adapter) -> None:
        """Make a LoRA adapter servable under its name (`GenerateRequest.adapter`); loading one that
        is loaded already is a no-op. InvalidRequest where the weights cannot serve this model."""
        raise InvalidRequest(f"backend {self.name!r} does not serve LoRA adapters", param="model")

    async def unload_adapter(self, name: str) -> None:
        """Forget an adapter; requests running with it finish first. ModelNotFound where unknown."""
        raise ModelNotFound(f"backend {self.name!r} has no adapter {name!r}", param="model")
