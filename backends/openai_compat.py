"""Any OpenAI-compatible server as a backend: one streaming HTTP client (aiohttp, HTTP/1.1
keep-alive pool) with connect and read timeouts; how long a stream may idle is the calling
gateway's to bound. aiohttp rather than httpx, and msgspec rather than json, because every
streamed piece through the gateway pays for them.

The SSE reader tolerates what real servers send: `data:` with or without a space, comments
and keep-alives, streams that end without `[DONE]`, errors sent as events mid-stream, usage in
a final chunk without choices. Runtime adapters (vLLM, SGLang, ...) are profiles of this one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import aiohttp
import msgspec

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
    Unavailable,
    UpstreamError,
    Usage,
    reported_count,
)
from .constraints import respelled

# An answer this large is decoded and checked on a worker thread: megabytes of vectors take tens of
# milliseconds, which every other request on the event loop would wait out.
LARGE_ANSWER_BYTES = 256 * 1024


@dataclass(frozen=True)
class Timeouts:
    """The connection's own bounds; how long a stream may idle is the gateway's call's to say."""
    connect: float = 5.0
    first_byte: float = 600.0  # a long prompt's prefill may take this long (bounds every read)


@dataclass
class OpenAICompatConfig:
    base_url: str  # without /v1
    model: str  # the model name the upstream serves
    api_key: str | None = None
    runtime: str = "openai"  # a runtime id (backends/runtimes.py)
    health_path: str = "/health"
    max_context: int = 0  # 0: ask /v1/models (vLLM's `max_model_len`)
    max_connections: int = 256
    timeouts: Timeouts = field(default_factory=Timeouts)
    # Request fields this upstream takes beyond those its adapter knows (a custom server's own).
    extra_fields: list[str] = field(default_factory=list)
    # LoRA, where the server reports it nowhere: the adapters it loaded at launch, by the names requests
    # use (TGI's `--lora-adapters` ids), and its limits (vLLM's `--max-loras`, `--max-lora-rank`).
    adapters: list[str] = field(default_factory=list)
    max_loras: int = 0
    max_lora_rank: int = 0
    # The upstream serves `/v1/embeddings`: said by the operator, as no runtime tells it anywhere a probe
    # could read without computing one. vLLM serving a pooling model (`--runner pooling`, e.g. with
    # `--convert embed`), SGLang an embedding model (`--is-embedding`), llama-server started with
    # `--embeddings` and a pooling other than none; never TGI (Text Embeddings Inference serves them).
    embeddings: bool = False


class OpenAICompatBackend(Backend):
    # A runtime's own finish reasons, in OpenAI's words (TGI's chat route says `eos_token`...).
    FINISH_REASONS: dict[str, str] = {}
    HEALTH_TIMEOUT_S = 5.0
    EXTRA_FIELDS = fields.OPENAI
    # The runtime keeps prefixes apart by a request's `cache_salt` (vLLM, SGLang): the gateway sends its
    # tenant's; a client's own is refused with the other unknown fields.
    TAKES_CACHE_SALT = False

    @property
    def extra_fields(self) -> frozenset[str]:
        return self.EXTRA_FIELDS | set(self.config.extra_fields)

    def admit_extras(self, request: GenerateRequest) -> GenerateRequest:
        """A structured output in the runtime's own spelling first (`constraints.respelled`)."""
        extra = respelled(request.extra, self.config.runtime)
        return super().admit_extras(request if extra is request.extra else dataclasses.replace(request, extra=extra))

    def __init__(self, config: OpenAICompatConfig, name: str = "openai") -> None:
        self.name, self.config = name, config
        self._client: aiohttp.ClientSession | None = None
        self._max_context = config.max_context

    async def start(self) -> None:
        c = self.config
        headers = {"Authorization": f"Bearer {c.api_key}"} if c.api_key else {}
        self._client = aiohttp.ClientSession(
            base_url=c.base_url, headers=headers, connector=aiohttp.TCPConnector(limit=c.max_connections),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=c.timeouts.connect, sock_read=c.timeouts.first_byte),
        )
        if not self._max_context:
            self._max_context = await self._model_max_len()

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    @property
    def client(self) -> aiohttp.ClientSession:
        if self._client is None:
            raise Unavailable(f"backend {self.name!r} is not started")
        return self._client

    # -- generation -------------------------------------------------------------------------
    def _body(self, request: GenerateRequest) -> tuple[str, dict]:
        body = {
            **request.extra, "model": self.upstream_model(request), "stream": True,
            "stream_options": {"include_usage": True}, "temperature": request.temperature, "top_p": request.top_p,
            "n": request.n,
        }
        for key, value in (("max_tokens", request.max_tokens), ("seed", request.seed),
                           ("stop", list(request.stop) or None), ("top_k", request.top_k or None),
                           ("stop_token_ids", list(request.stop_token_ids) or None),
                           ("ignore_eos", request.ignore_eos or None)):
            if value is not None:
                body[key] = value
        if self.TAKES_CACHE_SALT and request.cache_salt:
            body["cache_salt"] = request.cache_salt
        if request.messages is not None:
            return "/v1/chat/completions", body | {"messages": request.messages}
        prompt = request.prompt if request.prompt is not None else list(request.prompt_token_ids)
        return "/v1/completions", body | {"prompt": prompt}

    def upstream_model(self, request: GenerateRequest) -> str:
        """The `model` an upstream request names. A runtime that serves LoRA adapters overrides it with
        how its requests name one; elsewhere a request for one is refused, never answered by the base."""
        if request.adapter is not None:
            raise InvalidRequest(f"backend {self.name!r} does not serve LoRA adapters", param="model")
        return self.config.model

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        path, body = self._body(request)
        reasons: list[str | None] = [None] * request.n
        usage, pieces = None, 0
        async for chunk in self.stream_events(path, body, request.trace_headers):
            if "error" in chunk:
                raise error_from_body(chunk)
            if chunk.get("usage"):
                usage = usage_of(chunk["usage"])
            for choice in chunk.get("choices") or ():
                text, extra = _choice_parts(choice)
                index, reason = choice.get("index", 0), choice.get("finish_reason")
                reason = self.FINISH_REASONS.get(reason, reason)
                if reason and index < len(reasons):
                    reasons[index] = reason
                if text or reason or extra:
                    pieces += bool(text)
                    yield Delta(index, text, (), reason, extra)
        if not any(reasons):
            raise UpstreamError(f"{self.name}: the stream ended before any choice finished")
        # Servers that ignore stream_options (llama-cpp-python's) send no usage: count the
        # streamed pieces, one token each as these servers send them; the prompt stays unknown (0).
        yield Finish(tuple(r or "stop" for r in reasons), usage or Usage(0, pieces))

    async def stream_events(self, path: str, body: dict, headers: dict[str, str] | None = None) -> AsyncIterator[dict]:
        """POST `body` (with `headers`: a trace's context) and yield each SSE event's JSON until
        `[DONE]` or the end of the stream. Refused connections, timeouts and HTTP errors become the
        matching `BackendError`."""
        try:
            with self._transport_errors():
                async with await self._post(path, body, headers=headers) as response:
                    if response.status >= 400:
                        raise self.error_for_status(response.status, await response.read())
                    async for line in response.content:  # either framing; comments and blank lines skipped
                        if line.startswith(b"data:"):
                            data = line[5:].strip()
                            if data == b"[DONE]":
                                return
                            yield msgspec.json.decode(data)
        except aiohttp.http_exceptions.LineTooLong as exc:  # not a ClientError
            raise UpstreamError(f"{self.name}: an event longer than {exc.args[1]} bytes") from exc
        except (ValueError, msgspec.DecodeError) as exc:
            raise UpstreamError(f"{self.name}: an event is not JSON: {exc}") from exc

    @contextlib.contextmanager
    def _transport_errors(self) -> Iterator[None]:
        """A refused connection, a timeout or a broken exchange as the taxonomy's errors."""
        try:
            yield
        except aiohttp.ClientConnectorError as exc:
            raise Unavailable(f"{self.name}: cannot connect to {self.config.base_url}: {exc}") from exc
        except TimeoutError as exc:
            raise BackendTimeout(f"{self.name}: no answer within {self.config.timeouts.first_byte:g} s") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"{self.name}: {type(exc).__name__}: {exc}") from exc

    def error_for_status(self, status: int, body: bytes) -> BackendError:
        return error_from_status(status, body)

    async def _post(self, path: str, body: dict, **options) -> aiohttp.ClientResponse:
        """POST; once more if a pooled keep-alive connection turns out to be dead before any answer
        (servers close idle ones, and some, like llama-cpp-python's, close one after an error)."""
        try:
            return await self.client.post(path, json=body, **options)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if isinstance(exc, aiohttp.ClientConnectorError):  # refused: no stale connection, a down server
                raise
            return await self.client.post(path, json=body, **options)

    # -- embeddings -------------------------------------------------------------------------
    async def embed(self, request: EmbedRequest) -> Embeddings:
        """`/v1/embeddings` of the base model (embeddings take no adapter), vectors as floats whatever
        the client asked (the gateway encodes them), checked before anyone reads them."""
        if not self.config.embeddings:
            return await super().embed(request)
        texts = sum(isinstance(item, str) for item in request.inputs)
        if 0 < texts < len(request.inputs):  # OpenAI's `input` is texts or token lists, never both
            raise InvalidRequest("input mixes texts and token ids", param="input")
        body = {"model": self.config.model, "encoding_format": "float",
                "input": [item if isinstance(item, str) else list(item) for item in request.inputs]}
        if request.dimensions is not None:
            body["dimensions"] = request.dimensions
        if self.TAKES_CACHE_SALT and request.cache_salt:
            body["cache_salt"] = request.cache_salt
        with self._transport_errors():
            async with await self._post("/v1/embeddings", body) as response:
                answer = await response.read()
                if response.status >= 400:
                    raise self.error_for_status(response.status, answer)
        checked = (answer, len(request.inputs), request.dimensions, self.name)
        if len(answer) > LARGE_ANSWER_BYTES:
            return await asyncio.to_thread(embeddings_of, *checked)
        return embeddings_of(*checked)

    # -- introspection ----------------------------------------------------------------------
    async def _model_max_len(self) -> int:
        try:
            async with self.client.get("/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as response:
                models = (await response.json(content_type=None)).get("data", [])
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
            return 0
        mine = next((m for m in models if m.get("id") == self.config.model), {})
        return reported_count(mine.get("max_model_len"))

    async def capabilities(self) -> Capabilities:
        return Capabilities(runtime=self.config.runtime, version="", model=self.config.model,
                            max_context=self._max_context, prefix_caching=False, embeddings=self.config.embeddings)

    async def health(self) -> Health:
        if self._client is None:
            return Health.LOADING
        timeout = aiohttp.ClientTimeout(total=self.HEALTH_TIMEOUT_S)
        try:
            async with self.client.get(self.config.health_path, timeout=timeout) as response:
                return self.health_of(response.status)
        except (aiohttp.ClientError, TimeoutError):
            return Health.DOWN

    def health_of(self, status: int) -> Health:
        """The health route's status in our terms; vLLM's 503 means a dead engine."""
        return Health.READY if status == 200 else Health.DOWN

    async def load(self) -> Load:
        return Load()

    async def get_json(self, path: str, kind: type = dict):
        """A small GET (info routes): its JSON `kind` (a dict or a list), empty when the server
        does not answer it."""
        try:
            async with self.client.get(path, timeout=aiohttp.ClientTimeout(total=10)) as response:
                if response.status != 200:
                    return kind()
                answer = await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return kind()
        return answer if isinstance(answer, kind) else kind()

    async def served_adapters(self) -> dict[str, str] | None:
        """The LoRA adapters the upstream serves now, name -> path: the `/v1/models` cards whose
        `parent` is the base model, `root` their path (vLLM's and SGLang's cards). None where it did
        not answer."""
        models = (await self.get_json("/v1/models")).get("data")
        if not isinstance(models, list):
            return None
        return {str(m["id"]): str(m.get("root") or "") for m in models
                if isinstance(m, dict) and m.get("id") and m.get("parent") == self.config.model}

    async def post_route(self, path: str, body: dict) -> tuple[int, bytes]:
        """A POST to a control route (an adapter's load): its status and body; a refused connection or
        a timeout as the taxonomy's."""
        with self._transport_errors():
            async with await self._post(path, body) as response:
                return response.status, await response.read()

    async def scrape(self, path: str = "/metrics") -> Samples:
        """A Prometheus endpoint's samples; empty if it has none."""
        try:
            async with self.client.get(path, timeout=aiohttp.ClientTimeout(total=10)) as response:
                if response.status != 200:
                    return Samples()
                return Samples.parse(await response.text())
        except (aiohttp.ClientError, TimeoutError):
            return Samples()


@dataclass
class Samples:
    """A scrape: each sample name's values, one per label set. vLLM and SGLang label their gauges
    per engine or data-parallel rank: counts and counters add up (`total`), fractions such as KV
    usage average (`mean`)."""
    values: dict[str, list[float]] = field(default_factory=dict)
    labels: dict[str, list[dict[str, str]]] = field(default_factory=dict)  # each value's

    @classmethod
    def parse(cls, text: str) -> Samples:
        """Prometheus' text format."""
        from prometheus_client.parser import text_string_to_metric_families

        samples = cls()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples.values.setdefault(sample.name, []).append(sample.value)
                samples.labels.setdefault(sample.name, []).append(sample.labels)
        return samples

    def __bool__(self) -> bool:
        return bool(self.values)

    def __contains__(self, name: str) -> bool:
        return name in self.values

    def total(self, name: str) -> float:
        return sum(self.values.get(name, ()))

    def mean(self, name: str) -> float | None:
        found = self.values.get(name)
        return sum(found) / len(found) if found else None

    def latest_labels(self, name: str) -> dict[str, str]:
        """The labels of `name`'s highest value: an info gauge's current label set, where the runtime
        sets each set's value to the time it last reported it (vLLM's `vllm:lora_requests_info`)."""
        values = self.values.get(name)
        return self.labels[name][values.index(max(values))] if values else {}

    def pick(self, **names: str) -> dict[str, float]:
        """Totals under our names (`Load.details`), of those the server exposes."""
        return {ours: self.total(theirs) for ours, theirs in names.items() if theirs in self}


def _choice_parts(choice: dict) -> tuple[str, dict | None]:
    """A streamed choice's text, and what else it carries (tool calls, logprobs...)."""
    extra = {}
    if choice.get("logprobs"):
        extra["logprobs"] = choice["logprobs"]
    if "delta" not in choice:
        return choice.get("text") or "", extra or None
    delta = choice["delta"]
    fields = {k: v for k, v in delta.items() if k not in ("content", "role") and v is not None}
    if fields:
        extra["delta"] = fields
    return delta.get("content") or "", extra or None


class _Vector(msgspec.Struct):
    embedding: list[float]
    index: int | None = None


class _EmbeddingsAnswer(msgspec.Struct):
    data: list[_Vector]
    usage: dict | None = None


class _EmbeddingsOutline(msgspec.Struct):
    """An answer with its vectors left undecoded, each then decoded on its own: no one call holds
    the GIL (and the event loop) for megabytes of floats."""
    data: list[msgspec.Raw]
    usage: dict | None = None


def embeddings_of(answer: bytes | dict, inputs: int, dimensions: int | None, who: str) -> Embeddings:
    """An embeddings answer in OpenAI's shape (JSON, or a client library's dict: `data`, each
    `{embedding, index}`, and `usage`) checked: one vector per input, in `index` order, all finite
    and of one length (`dimensions`, where asked); its usage's prompt tokens by `reported_count`.
    Anything else is the upstream's fault (UpstreamError), never a crash or a wrong answer."""
    try:
        if isinstance(answer, bytes):
            outline = msgspec.json.decode(answer, type=_EmbeddingsOutline)
            parsed = _EmbeddingsAnswer([msgspec.json.decode(item, type=_Vector) for item in outline.data],
                                       outline.usage)
        else:
            parsed = msgspec.convert(answer, _EmbeddingsAnswer)
    except msgspec.DecodeError as exc:  # not JSON (a bare NaN), or not this shape
        raise UpstreamError(f"{who}: the embeddings answer is malformed: {exc}") from exc
    data = parsed.data
    if all(item.index is not None for item in data):
        data = sorted(data, key=lambda item: item.index)
        if [item.index for item in data] != list(range(len(data))):
            raise UpstreamError(f"{who}: the embeddings answer's indexes are not 0..{len(data) - 1}")
    vectors = [item.embedding for item in data]
    if len(vectors) != inputs:
        raise UpstreamError(f"{who}: {len(vectors)} vectors for {inputs} inputs")
    size = dimensions or len(vectors[0])
    if not size or any(len(vector) != size for vector in vectors):
        raise UpstreamError(f"{who}: vectors of lengths {sorted({len(v) for v in vectors})}, not all {size}")
    if not all(all(map(math.isfinite, vector)) for vector in vectors):
        raise UpstreamError(f"{who}: a vector holds NaN or an infinity")
    return Embeddings(vectors, reported_count((parsed.usage or {}).get("prompt_tokens")))


def usage_of(usage: dict) -> Usage:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Usage(usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0, cached)


def error_parts(body: bytes | str | dict) -> tuple[str, str]:
    """The human message and the error type of any runtime's error body: OpenAI's nested
    `{"error": {"message", "type"}}`, SGLang's flat `{"message", "type"}`, TGI's
    `{"error": "...", "error_type"}`, or plain text (no type)."""
    if not isinstance(body, dict):
        text = body.decode(errors="replace") if isinstance(body, bytes) else body
        try:
            body = json.loads(text)
        except ValueError:
            return text[:500], ""
        if not isinstance(body, dict):
            return str(body), ""
    error = body.get("error", body)
    if isinstance(error, dict):
        return str(error.get("message", error)), str(error.get("type") or "")
    return str(error), str(body.get("error_type") or "")


def message_of(body: bytes | str | dict) -> str:
    return error_parts(body)[0]


# How runtimes say a prompt does not fit: vLLM and SGLang "... context length ...", TGI's
# `validation.rs` (`MaxTotalTokens`, `InputLength`), llama-server's error type
# (`tools/server/server-common.cpp` `ERROR_TYPE_EXCEED_CONTEXT_SIZE`).
CONTEXT_WORDS = ("context length", "maximum context", "too long", "`inputs` tokens + `max_new_tokens` must be <=",
                 "`inputs` must have less than")
CONTEXT_TYPES = ("exceed_context_size_error",)


def says_too_long(message: str, kind: str = "") -> bool:
    return kind in CONTEXT_TYPES or any(words in message.lower() for words in CONTEXT_WORDS)


def error_for(status: int, message: str, kind: str = "") -> BackendError:
    """An HTTP status, its message and error type, in the taxonomy."""
    if status in (400, 422):
        return (ContextTooLong if says_too_long(message, kind) else InvalidRequest)(message)
    if status == 404:
        return ModelNotFound(message)
    if status in (429, 503):
        return Overloaded(message)
    if status == 504:
        return BackendTimeout(message)
    return UpstreamError(f"upstream answered {status}: {message}")


def error_from_status(status: int, body: bytes | str) -> BackendError:
    return error_for(status, *error_parts(body))


def error_from_body(event: dict) -> BackendError:
    """An error sent as a stream event on a 200 stream. Its own `code` (vLLM) or
    `http_status_code` (TGI's chat route) wins; without one (SGLang's native `/generate`), a
    client error is told by its type or by a prompt that does not fit; anything else is the
    upstream's failure (502)."""
    message, kind = error_parts(event)
    detail = event.get("error") if isinstance(event.get("error"), dict) else {}
    code = str(detail.get("code") or detail.get("http_status_code") or "")
    if code.isdigit() and len(code) == 3:  # an HTTP status, not any number an upstream may send
        return error_for(int(code), message, kind)
    client_error = kind == "invalid_request_error" or says_too_long(message, kind)
    return error_for(400 if client_error else 502, message, kind)
