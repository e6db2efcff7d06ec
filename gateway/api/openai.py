"""OpenAI-compatible API: /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models."""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from backends.base import (
    MAX_TOKEN_ID,
    BackendError,
    Delta,
    EmbedRequest,
    Finish,
    GenerateRequest,
    InvalidRequest,
    Usage,
)
from gateway.api import MAX_TOKENS, ClientBody, TokenCount, client_call
from gateway.api.bodies import OffLoopBody
from gateway.api.client_call import Collected
from gateway.api.deps import GatewayDep, InferencePrincipal
from gateway.errors import GatewayError
from gateway.service import Gateway
from gateway.tenancy.auth import Principal

router = APIRouter(prefix="/v1", tags=["openai"], route_class=OffLoopBody)


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(ClientBody):
    # Fields not declared here reach the backend untouched, as `GenerateRequest.extra`.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: TokenCount | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=-1, le=MAX_TOKENS)] = 0  # vLLM's extension; -1 and 0 both mean no cut
    n: Annotated[int, Field(ge=1, le=16)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]] = []
    ignore_eos: bool = False

    def generate_request(self, model: str, request_id: str, **prompt: Any) -> GenerateRequest:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        extra = dict(self.model_extra or {})
        return GenerateRequest(
            request_id=request_id, model=model, max_tokens=self.max_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0), seed=self.seed,
            stop=tuple(stop), stop_token_ids=tuple(self.stop_token_ids), ignore_eos=self.ignore_eos,
            n=self.n, extra=extra, **prompt,
        )


class ChatMessage(BaseModel):
    # OpenAI's message fields (openai-python `chat_completion_*_message_param.py`), and the reasoning
    # text vLLM and SGLang return and take back; any other is refused by name, as unknown top-level
    # fields are by the backend, rather than reach an upstream verbatim.
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    function_call: dict[str, Any] | None = None
    refusal: str | None = None
    audio: dict[str, Any] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: TokenCount | None = None  # OpenAI's newer name: it wins over max_tokens

    @model_validator(mode="after")
    def _one_max_tokens(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: TokenCount | None = 16  # OpenAI's default for completions


def usage_json(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens, "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def merge_extras(extras: list[dict]) -> dict:
    """A whole answer's pass-through fields from its streamed pieces: tool calls assembled by
    their index (arguments concatenated), logprob lists and other text fields concatenated."""
    merged: dict[str, Any] = {}
    fields: dict[str, Any] = {}
    calls: dict[int, dict] = {}
    for extra in extras:
        for key, value in (extra.get("logprobs") or {}).items():
            if isinstance(value, list):
                merged.setdefault("logprobs", {}).setdefault(key, []).extend(value)
        for key, value in extra.get("delta", {}).items():
            if key == "tool_calls":
                for part in value:
                    call = calls.setdefault(part.get("index", len(calls)), {"function": {"arguments": ""}})
                    call.update({k: part[k] for k in ("id", "type") if part.get(k)})
                    function = part.get("function") or {}
                    if function.get("name"):
                        call["function"]["name"] = function["name"]
                    call["function"]["arguments"] += function.get("arguments") or ""
            elif isinstance(value, str):
                fields[key] = fields.get(key, "") + value
            else:
                fields[key] = value
    if calls:
        fields["tool_calls"] = [calls[i] for i in sorted(calls)]
    if fields:
        merged["delta"] = fields
    return merged


def sse(data: dict | str) -> bytes:
    return b"data: " + (data.encode() if isinstance(data, str) else msgspec.json.encode(data)) + b"\n\n"


class Responder:
    """Builds one endpoint's response bodies: chat and text completions differ only in shape."""

    def __init__(self, chat: bool, model: str, include_usage: bool, request_id: str) -> None:
        self.chat, self.model, self.include_usage = chat, model, include_usage
        self.id = request_id  # the usage ledger's key too
        self.created = int(time.time())

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _choice(self, index: int, text: str | None, finish_reason: str | None, chunk: bool, role: bool = False,
                extra: dict | None = None) -> dict:
        extra = extra or {}
        logprobs = extra.get("logprobs")
        if not self.chat:
            return {"index": index, "text": text or "", "finish_reason": finish_reason, "logprobs": logprobs}
        fields = extra.get("delta", {})
        if chunk:
            delta = {"role": "assistant", "content": text or ""} if role else ({"content": text} if text else {})
            return {"index": index, "delta": delta | fields, "finish_reason": finish_reason, "logprobs": logprobs}
        content = text or (None if fields.get("tool_calls") else text)  # OpenAI: null beside tool calls
        return {"index": index, "message": {"role": "assistant", "content": content} | fields,
                "finish_reason": finish_reason, "logprobs": logprobs}

    def full(self, result: Collected, n: int) -> dict:
        finish = result.finish
        choices = [self._choice(i, result.text(i), finish.finish_reasons[i], chunk=False,
                                extra=merge_extras(result.extras(i))) for i in range(n)]
        return self._envelope(choices, chunk=False) | {"usage": usage_json(finish.usage)}

    def chunk(self, index: int, text: str | None, finish_reason: str | None, role: bool = False,
              extra: dict | None = None) -> bytes:
        body = self._envelope([self._choice(index, text, finish_reason, chunk=True, role=role, extra=extra)],
                              chunk=True)
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    async def stream(self, events: AsyncIterator, n: int) -> AsyncIterator[bytes]:
        try:
            if self.chat:
                for i in range(n):
                    yield self.chunk(i, "", None, role=True)
            async for event in events:
                if isinstance(event, Delta):
                    if event.text or event.finish_reason or event.extra:
                        yield self.chunk(event.index, event.text, event.finish_reason, extra=event.extra)
                elif isinstance(event, Finish) and self.include_usage:
                    yield sse(self._envelope([], chunk=True) | {"usage": usage_json(event.usage)})
        except BackendError as exc:  # mid-stream failure: an error event, never a silent clean end
            yield sse(GatewayError.of(exc).openai_body())
        yield sse("[DONE]")


def prompt_text(prompt: dict[str, Any]) -> str:
    """The prompt as text, for prefix-aware routing: the prompt, or the messages' contents in order."""
    if isinstance(prompt.get("prompt"), str):
        return prompt["prompt"]
    parts = []
    for message in prompt.get("messages") or ():
        content = message.get("content")
        parts.append(content if isinstance(content, str) else " ".join(
            p.get("text", "") for p in content or () if isinstance(p, dict)))
    return "\n".join(parts)


async def respond(request: Request | None, gateway: Gateway, principal: Principal, body: SamplingRequest,
                  chat: bool, api: str = "openai", request_id: str | None = None, **prompt: Any):
    """The endpoint's answer; without a request (a batch's line, under an id of its own) there is no
    client to leave."""
    decision = gateway.resolve(principal, body.model, prompt_text(prompt), body.max_tokens, body.stream,
                               client_call.trace_of(request))
    request_id = request_id or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    generate_request = body.generate_request(decision.model, request_id, **prompt)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    responder = Responder(chat, decision.asked, include_usage, generate_request.request_id)
    started = await client_call.start(gateway, request, principal, decision, generate_request, api, body.stream)
    if body.stream:
        return StreamingResponse(responder.stream(started.events, body.n), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **started.headers})
    result = await client_call.collect(started, request)
    return JSONResponse(responder.full(result, body.n), headers=started.headers)


def chat_prompt(body: ChatCompletionRequest) -> dict[str, Any]:
    return {"messages": [m.model_dump(exclude_none=True) for m in body.messages]}


def completion_prompt(body: CompletionRequest) -> dict[str, Any]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise InvalidRequest("batched prompts are not supported: send one prompt per request", param="prompt")
        prompt = prompt[0]
    if not prompt:
        raise InvalidRequest("the prompt is empty", param="prompt")
    return {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": list(prompt)}


@router.post("/chat/completions")
async def chat_completions(request: Request, body: ChatCompletionRequest, principal: InferencePrincipal,
                           gateway: GatewayDep):
    return await respond(request, gateway, principal, body, chat=True, **chat_prompt(body))


@router.post("/completions")
async def completions(request: Request, body: CompletionRequest, principal: InferencePrincipal, gateway: GatewayDep):
    return await respond(request, gateway, principal, body, chat=False, **completion_prompt(body))


MAX_EMBEDDING_DIMENSIONS = 16384  # wider than any model's vectors (OpenAI's widest: 3072)


class EmbeddingRequest(ClientBody):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[str] | list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]] | \
        list[list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]]]
    # A backend refuses more than its model's own (the built-in engine: any, its models are not Matryoshka).
    dimensions: Annotated[int, Field(strict=True, ge=1, le=MAX_EMBEDDING_DIMENSIONS)] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None

    def inputs(self) -> tuple[str | tuple[int, ...], ...]:
        """One entry per vector: a text, or token ids (a list of ints is one input, as OpenAI reads it)."""
        given = self.input
        if isinstance(given, str) or (given and isinstance(given[0], int)):
            given = [given]
        if len(given) > MAX_EMBEDDING_INPUTS:
            raise InvalidRequest(f"input holds {len(given)} items, more than {MAX_EMBEDDING_INPUTS}", param="input")
        inputs = tuple(x if isinstance(x, str) else tuple(x) for x in given)
        if not inputs or any(len(x) == 0 for x in inputs):
            raise InvalidRequest("input must not be empty, nor hold an empty item", param="input")
        return inputs


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's cap on one request's inputs


def embedding_json(vector: list[float], encoding: str) -> list[float] | str:
    """A vector as OpenAI sends it: floats, or base64 of little-endian float32 (what its SDKs decode)."""
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


@router.post("/embeddings")
async def embeddings(request: Request, body: EmbeddingRequest, principal: InferencePrincipal, gateway: GatewayDep):
    answer = await embed(request, gateway, principal, body)
    # Vectors by the megabyte: encoded on a worker thread, by msgspec (several times json's speed).
    return Response(await asyncio.to_thread(msgspec.json.encode, answer), media_type="application/json")


async def embed(request: Request | None, gateway: Gateway, principal: Principal, body: EmbeddingRequest,
                api: str = "embeddings", request_id: str | None = None) -> dict:
    """The endpoint's answer; without a request (a batch's line, under an id of its own) there is no
    client to leave."""
    inputs = body.inputs()
    decision = gateway.resolve(principal, body.model, trace=client_call.trace_of(request))
    if decision.adapter is not None:
        raise InvalidRequest(f"embeddings are of a base model; {decision.adapter.name!r} is a LoRA adapter",
                             param="model")
    asked = EmbedRequest(request_id=request_id or f"embd-{uuid.uuid4().hex}", inputs=inputs,
                         dimensions=body.dimensions)
    result = await client_call.until_disconnect(request, gateway.embed(principal, decision, asked, api))
    return {
        "object": "list", "model": decision.asked,
        "data": [{"object": "embedding", "index": i, "embedding": embedding_json(v, body.encoding_format)}
                 for i, v in enumerate(result.vectors)],
        "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
    }


@router.get("/models")
async def list_models(principal: InferencePrincipal, gateway: GatewayDep):
    """The models the caller's tenant may use, then its LoRA adapters, each with its base as
    `parent` and `root`, as vLLM lists its `--lora-modules` (where it gives the path as the root,
    which is no tenant's to see)."""
    created = int(time.time())
    return {"object": "list", "data": [
        *({"id": m, "object": "model", "created": created, "owned_by": "servegate"}
          for m in gateway.visible_models(principal)),
        *({"id": a.name, "object": "model", "created": created, "owned_by": a.owner or "servegate", "root": a.base,
           "parent": a.base} for a in gateway.usable_adapters(principal)),
    ]}
