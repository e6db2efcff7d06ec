"""TGI-compatible API, so TGI's clients move to servegate unchanged: `POST /` (where TGI's
clients post), `/generate`, `/generate_stream`, `/info`, `/tokenize`, as in TGI's OpenAPI spec.

Streams use TGI's framing: `data:{json}` events, no `[DONE]`, the last token's event carrying
`generated_text` and `details`, and a failure after the first byte sent as an error event on
the 200 stream. The routes serve the caller's only model; `/tgi/{model}/...` picks one.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from backends.base import BackendError, Delta, Finish, GenerateRequest, ModelNotFound, servegate_version
from gateway.api import MAX_TOKENS, ClientBody, TokenCount, client_call
from gateway.api.bodies import OffLoopBody
from gateway.api.deps import GatewayDep, InferencePrincipal
from gateway.errors import GatewayError
from gateway.operations import tracing
from gateway.service import Gateway
from gateway.tenancy.auth import Principal

router = APIRouter(tags=["tgi"], route_class=OffLoopBody)
MAX_STOP_SEQUENCES = 4


class Parameters(BaseModel):
    # Fields not declared here (grammar, watermark, top_n_tokens...) reach the backend as extras,
    # which refuses by name any it cannot honour.
    model_config = ConfigDict(extra="allow")

    max_new_tokens: TokenCount | None = None
    do_sample: bool = False
    temperature: Annotated[float, Field(gt=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(gt=0, le=MAX_TOKENS)] | None = None
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    stop: Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)] = []
    details: bool = False
    return_full_text: bool | None = None
    decoder_input_details: bool = False
    adapter_id: str | None = None  # a LoRA adapter of the model, by its registered name



class TGIRequest(ClientBody):
    inputs: Annotated[str, Field(min_length=1)]
    parameters: Parameters = Parameters()
    stream: bool = False  # only read by `POST /`


class Token(BaseModel):
    id: int
    text: str
    logprob: float | None = None
    special: bool = False


def _sampling(p: Parameters) -> dict[str, Any]:
    """TGI samples when asked to or when any sampling knob is set; otherwise it is greedy."""
    sample = p.do_sample or any(v is not None for v in (p.top_p, p.top_k)) or p.temperature not in (None, 1.0)
    if not sample:
        return {"temperature": 0.0}
    return {"temperature": p.temperature or 1.0, "top_p": p.top_p or 1.0, "top_k": p.top_k or 0}


def _request(body: TGIRequest, model: str) -> GenerateRequest:
    p = body.parameters
    extra = {k: v for k, v in (p.model_extra or {}).items()}
    if p.decoder_input_details:
        extra["decoder_input_details"] = True
    return GenerateRequest(request_id=f"tgi-{uuid.uuid4().hex}", model=model, prompt=body.inputs,
                           max_tokens=p.max_new_tokens, seed=p.seed, stop=tuple(p.stop), extra=extra, **_sampling(p))


def _finish_reason(reason: str | None, generate_request: GenerateRequest) -> str:
    if reason == "length":
        return "length"
    return "stop_sequence" if generate_request.stop else "eos_token"


def _tokens(delta: Delta) -> list[Token]:
    """One TGI token per token id; a chunk's text rides on its last token (texts concatenate). A
    remote OpenAI-compatible backend streams text without ids: one token per piece, id 0 (TGI's
    schema needs a non-negative id; the real one is unknown)."""
    ids = delta.token_ids or ((0,) if delta.text else ())
    return [Token(id=t, text=delta.text if i == len(ids) - 1 else "") for i, t in enumerate(ids)]


async def _start(request: Request, gateway: Gateway, principal: Principal, body: TGIRequest, model: str | None,
                 stream: bool) -> tuple[GenerateRequest, client_call.Started]:
    """`parameters.adapter_id` names the model asked for: an adapter (of `model`, where that is given)."""
    adapter_id = body.parameters.adapter_id
    decision = gateway.resolve(principal, adapter_id or model, body.inputs, body.parameters.max_new_tokens, stream,
                               tracing.request_trace(request))
    if adapter_id and (decision.adapter is None or model and decision.model != model):
        raise ModelNotFound(f"The adapter `{adapter_id}` does not exist or you do not have access to it.",
                            param="adapter_id")
    generate_request = _request(body, decision.model)
    started = await client_call.start(gateway, request, principal, decision, generate_request, "tgi", stream)
    return generate_request, started


async def _generate(request: Request, gateway: Gateway, principal: Principal, body: TGIRequest,
                    model: str | None) -> tuple[dict, dict[str, str]]:
    """TGI's answer, and the response headers."""
    generate_request, started = await _start(request, gateway, principal, body, model, stream=False)
    result = await client_call.collect(started, request)
    text = result.text(0)
    if body.parameters.return_full_text:
        text = body.inputs + text
    answer: dict[str, Any] = {"generated_text": text}
    if body.parameters.details:
        answer["details"] = {
            "finish_reason": _finish_reason(result.finish.finish_reasons[0], generate_request),
            "generated_tokens": result.finish.usage.completion_tokens, "seed": generate_request.seed,
            "prefill": [], "tokens": [t.model_dump() for delta in result.deltas for t in _tokens(delta)],
        }
    return answer, started.headers


def _event(data: dict) -> bytes:
    return b"data:" + msgspec.json.encode(data) + b"\n\n"


async def _stream_events(generate_request: GenerateRequest, events: AsyncIterator, prefix: str,
                         with_details: bool) -> AsyncIterator[bytes]:
    """TGI's stream: the last token is held back until we know it is the last; it carries the
    whole text, and the details when they were asked for (TGI sends null otherwise)."""
    texts: list[str] = [prefix]
    pending: Token | None = None
    index = 0
    try:
        async for event in events:
            if isinstance(event, Delta):
                for token in _tokens(event):
                    if pending is not None:
                        yield _event({"index": index, "token": pending.model_dump(), "generated_text": None,
                                      "details": None})
                        index += 1
                    pending = token
                    texts.append(token.text)
            elif isinstance(event, Finish):
                details = {"finish_reason": _finish_reason(event.finish_reasons[0], generate_request),
                           "generated_tokens": event.usage.completion_tokens,
                           "input_length": event.usage.prompt_tokens, "seed": generate_request.seed}
                last = pending or Token(id=0, text="", special=True)
                yield _event({"index": index, "token": last.model_dump(), "generated_text": "".join(texts),
                              "details": details if with_details else None})
    except BackendError as exc:  # after the first byte: an error event on the 200 stream
        yield _event(GatewayError.of(exc).tgi_body())


async def _generate_stream(request: Request, gateway: Gateway, principal: Principal, body: TGIRequest,
                           model: str | None):
    generate_request, started = await _start(request, gateway, principal, body, model, stream=True)
    prefix = body.inputs if body.parameters.return_full_text else ""
    stream = _stream_events(generate_request, started.events, prefix, body.parameters.details)
    return StreamingResponse(stream, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **started.headers})


@router.post("/", summary="Generate tokens, streamed when `stream` is true (TGI's compat route)")
async def compat_generate(request: Request, body: TGIRequest, principal: InferencePrincipal, gateway: GatewayDep,
                          model: str | None = None):
    if body.stream:
        return await _generate_stream(request, gateway, principal, body, model)
    answer, headers = await _generate(request, gateway, principal, body, model)
    return JSONResponse([answer], headers=headers)


@router.post("/generate", summary="Generate tokens")
async def generate(request: Request, body: TGIRequest, principal: InferencePrincipal, gateway: GatewayDep,
                   model: str | None = None):
    answer, headers = await _generate(request, gateway, principal, body, model)
    return JSONResponse(answer, headers=headers)


@router.post("/generate_stream", summary="Generate a stream of token events (server-sent events)")
async def generate_stream(request: Request, body: TGIRequest, principal: InferencePrincipal, gateway: GatewayDep,
                          model: str | None = None):
    return await _generate_stream(request, gateway, principal, body, model)


@router.post("/tokenize", summary="Tokenize inputs")
async def tokenize(request: Request, body: TGIRequest, principal: InferencePrincipal, gateway: GatewayDep,
                   model: str | None = None):
    """Charged like a prompt: a request and its tokens to the tenant's windows (no cost)."""
    decision = gateway.resolve(principal, model)
    spans = await client_call.until_disconnect(request, gateway.tokenize(principal, decision, body.inputs))
    return [{"id": t.id, "text": t.text, "start": t.start, "stop": t.stop} for t in spans]


@router.get("/info", summary="Model and router information")
async def info(principal: InferencePrincipal, gateway: GatewayDep, model: str | None = None):
    decision = gateway.resolve(principal, model)
    caps = await decision.candidates[0].capabilities()
    return {
        "model_id": decision.model, "model_sha": None, "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": gateway.settings.max_in_flight + gateway.settings.max_queued,
        "max_best_of": 1, "max_stop_sequences": MAX_STOP_SEQUENCES,
        "max_input_tokens": max(caps.max_context - 1, 0), "max_total_tokens": caps.max_context, "dtype": caps.dtype,
        "weights": caps.weights, "weight_bytes_per_token": caps.weight_bytes_per_token,
        "validation_workers": 1, "max_client_batch_size": 1,
        "router": "servegate", "version": servegate_version(), "sha": None, "docker_label": None,
    }

