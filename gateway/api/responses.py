"""OpenAI's Responses API: /v1/responses, and the responses it keeps.

A Responses body is served on the chat path: its input items become chat messages, and its tools,
tool_choice and text format the chat fields (`GenerateRequest.extra`), sent through
`client_call.start` as /v1/chat/completions sends them, so every backend serves it under the same
constraints and bills it as any call. The chat deltas become output items and stream events in
one place (`Output`), so a streamed response and a whole one are built alike. A response kept
(`store`, the default) is a `StoredResponse` row holding the conversation as chat messages, which
a follower (`previous_response_id`) continues; only its tenant may read or continue it, until it
expires.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Annotated, Any, Literal

import msgspec
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ConfigDict, Field
from sqlalchemy import delete
from sqlalchemy.exc import SQLAlchemyError
from sqlmodel import Session

from backends.base import BackendError, Delta, Finish, GenerateRequest, InvalidRequest, Usage
from gateway.api import ClientBody, TokenCount, client_call
from gateway.api.bodies import OffLoopBody
from gateway.api.deps import GatewayDep, InferencePrincipal
from gateway.api.openai import prompt_text
from gateway.errors import GatewayError
from gateway.service import Gateway
from gateway.tables import StoredResponse, utcnow
from gateway.tenancy.auth import Principal

router = APIRouter(prefix="/v1", tags=["openai"], route_class=OffLoopBody)
log = logging.getLogger("servegate.responses")

# Chat fields as a Responses body names them, for the errors the chat path raises about them.
RESPONSES_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
                   "reasoning_effort": "reasoning", "verbosity": "text.verbosity"}
# Chat templates know the system role; OpenAI reads a developer message as one.
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text")
ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}
# The fields each input item and text part may carry (OpenAI's); any other is refused by name, not
# stored and echoed back.
ITEM_FIELDS = {"message": {"type", "id", "status", "role", "content"},
               "function_call": {"type", "id", "status", "call_id", "name", "arguments"},
               "function_call_output": {"type", "id", "status", "call_id", "output"}}
PART_FIELDS = {"input_text": {"type", "text"}, "output_text": {"type", "text", "annotations", "logprobs"}}

Metadata = Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                     Field(max_length=16)]


class ResponsesRequest(ClientBody):
    # Any other field (built-in tool settings, conversations, prompts) is refused by name.
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: TokenCount | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    parallel_tool_calls: bool | None = None
    metadata: Metadata | None = None
    user: str | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    stream: bool | None = None
    # Taken at the values that ask for nothing more (clients send them so), refused by name otherwise.
    background: bool | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["disabled"] | None = None


# -- a Responses body as a chat request ---------------------------------------------------------
def _text(content: Any, where: str) -> str:
    """Content as text: a string, or its text parts joined as the chat path joins them."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or a list of text parts", param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in TEXT_PARTS:
            raise InvalidRequest(f"{where}[{j}]: content of type {kind!r} is not supported (input_text and "
                                 "output_text are)", param="input")
        _known_fields(part, PART_FIELDS[kind], f"{where}[{j}]")
        if not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{where}[{j}].text must be a string", param="input")
        texts.append(part["text"])
    return "\n".join(texts)


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequest(f"{where}.{key} must be a string", param="input")
    return value


def _known_fields(given: dict, known: set[str], where: str) -> None:
    if unknown := sorted(set(given) - known):
        raise InvalidRequest(f"{where}: unknown field {unknown[0][:64]!r} (this item takes {', '.join(sorted(known))})",
                             param="input")


def chat_messages(items: list[dict]) -> list[dict]:
    """Responses items (a request's input, or a response's output) as chat messages: function calls
    join the assistant message before them, as chat's `tool_calls` do, and their outputs are tool
    messages."""
    messages: list[dict] = []
    for i, item in enumerate(items):
        where, kind = f"input[{i}]", item.get("type", "message")
        if kind in ITEM_FIELDS:
            _known_fields(item, ITEM_FIELDS[kind], where)
        if kind == "message":
            if not isinstance(item.get("role"), str) or item["role"] not in ROLES:
                raise InvalidRequest(f"{where}.role must be user, system, developer or assistant", param="input")
            messages.append({"role": ROLES[item["role"]], "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function", "function": {
                "name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": _text(item.get("output"), f"{where}.output")})
        else:
            raise InvalidRequest(f"{where}: items of type {kind!r} are not supported (message, function_call and "
                                 "function_call_output are)", param="input")
    return messages


def _listed(items: list[dict]) -> list[dict]:
    """Input items as /input_items lists them: each with its type, an id and a status, and a
    message's content as parts."""
    listed = []
    for item in items:
        kind = item.get("type", "message")
        item = {"type": kind, **item, "id": item.get("id") or f"{ID_PREFIX[kind]}_{uuid.uuid4().hex}"}
        item.setdefault("status", "completed")
        if kind == "message" and isinstance(item.get("content"), str):
            assistant = item["role"] == "assistant"
            item["content"] = [{"type": "output_text", "text": item["content"], "annotations": []} if assistant
                               else {"type": "input_text", "text": item["content"]}]
        listed.append(item)
    return listed


def _chat_tools(tools: list[dict]) -> list[dict]:
    chat = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise InvalidRequest(f"tools[{i}]: tools of type {tool.get('type')!r} are not supported; only function "
                                 "tools are", param="tools")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise InvalidRequest(f"tools[{i}].name must be a function's name", param="tools")
        chat.append({"type": "function", "function": {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}})
    return chat


def _chat_tool_choice(choice: str | dict) -> str | dict:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequest('tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}',
                         param="tool_choice")


def _response_format(text_format: Any) -> dict | None:
    kind = text_format.get("type") if isinstance(text_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(text_format.get("name"), str) or not isinstance(text_format.get("schema"), dict):
            raise InvalidRequest("text.format of type json_schema needs a name and a schema", param="text.format")
        return {"type": "json_schema", "json_schema": {
            k: text_format[k] for k in ("name", "schema", "strict", "description") if k in text_format}}
    raise InvalidRequest(f"text.format of type {kind!r} is not supported (text, json_object and json_schema are)",
                         param="text.format")


def _chat_fields(body: ResponsesRequest) -> dict[str, Any]:
    """The chat request's fields beyond its messages (`GenerateRequest.extra`), only those asked
    for: a backend refuses by name what it does not take. Unsupported asks are refused here."""
    if body.background:
        raise InvalidRequest("background responses are not supported", param="background")
    if body.include:
        raise InvalidRequest(f"include {body.include[0]!r} is not supported", param="include")
    reasoning = body.reasoning or {}
    if reasoning.get("summary") or reasoning.get("generate_summary"):
        raise InvalidRequest("reasoning summaries are not supported", param="reasoning.summary")
    text = body.text or {}
    extra: dict[str, Any] = {}
    if body.tools:
        extra["tools"] = _chat_tools(body.tools)
    if body.tool_choice is not None:
        extra["tool_choice"] = _chat_tool_choice(body.tool_choice)
    if body.parallel_tool_calls is False:  # what every backend does by default needs no field
        extra["parallel_tool_calls"] = False
    if text.get("format") and (response_format := _response_format(text["format"])):
        extra["response_format"] = response_format
    if text.get("verbosity"):
        extra["verbosity"] = text["verbosity"]
    if reasoning.get("effort"):  # a model that does not reason is refused it by its backend
        extra["reasoning_effort"] = reasoning["effort"]
    if body.user:
        extra["user"] = body.user
    return extra


def _in_responses_terms(error: BackendError | GatewayError) -> BackendError | GatewayError:
    """An error about a chat field, naming the Responses field it came from."""
    name = RESPONSES_NAMES.get(error.param or "")
    if name is not None:
        error.param, error.message = name, f"{name}: {error.message}"
    return error


# -- output items and stream events -------------------------------------------------------------
class Output:
    """A response's output items as the chat deltas build them, and the stream events that build
    them on the client, numbered as OpenAI numbers them. A whole response is built the same way and
    its events dropped. Items follow one another: text after a call opens a new message."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self.open: dict | None = None  # the last item, until the next begins or the answer ends
        self.calls: dict[int, dict] = {}  # a chat tool call's index -> its item
        self.sequence = 0

    def event(self, kind: str, **fields: Any) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def _at(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def _add(self, item: dict) -> list[dict]:
        events = self.close("completed")
        self.items.append(item)
        self.open = item
        return [*events, self.event("response.output_item.added", output_index=len(self.items) - 1,
                                    item=copy.deepcopy(item))]

    def _message(self) -> list[dict]:
        item = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": "in_progress",
                "content": []}
        events = self._add(item)
        part = {"type": "output_text", "text": "", "annotations": []}
        events.append(self.event("response.content_part.added", **self._at(item), content_index=0, part=dict(part)))
        item["content"].append(part)
        return events

    def delta(self, delta: Delta) -> list[dict]:
        events = []
        if delta.text:
            if self.open is None or self.open["type"] != "message":
                events += self._message()
            self.open["content"][0]["text"] += delta.text
            events.append(self.event("response.output_text.delta", **self._at(self.open), content_index=0,
                                     delta=delta.text, logprobs=[]))
        for part in ((delta.extra or {}).get("delta") or {}).get("tool_calls") or ():
            events += self._tool_call(part)
        return events

    def _tool_call(self, part: dict) -> list[dict]:
        """A piece of a chat tool call: its first opens a function_call item (a runtime streams the
        id and name first, then the arguments in pieces)."""
        events = []
        function = part.get("function") or {}
        index = part.get("index", len(self.calls))
        item = self.calls.get(index)
        if item is None:
            item = self.calls[index] = {
                "id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                "call_id": part.get("id") or f"call_{uuid.uuid4().hex[:24]}", "name": function.get("name") or "",
                "arguments": ""}
            events += self._add(item)
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            events.append(self.event("response.function_call_arguments.delta", **self._at(item),
                                     delta=function["arguments"]))
        return events

    def close(self, status: str) -> list[dict]:
        """The open item's end."""
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        at = self._at(item)
        if item["type"] == "message":
            part = item["content"][0]
            events = [self.event("response.output_text.done", **at, content_index=0, text=part["text"], logprobs=[]),
                      self.event("response.content_part.done", **at, content_index=0, part=dict(part))]
        else:
            events = [self.event("response.function_call_arguments.done", **at, arguments=item["arguments"])]
        return [*events, self.event("response.output_item.done", output_index=at["output_index"],
                                    item=copy.deepcopy(item))]

    def finish(self, incomplete: bool) -> list[dict]:
        """The answer's end; an empty answer is an empty message, as OpenAI gives one."""
        events = [] if self.items else self._message()
        return events + self.close("incomplete" if incomplete else "completed")


def usage_json(usage: Usage) -> dict:
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens}


def _sse(event: dict) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"


# -- one response's life ------------------------------------------------------------------------
@dataclass
class Turn:
    """One response: the call under way, the Response it builds, and what is kept of it."""

    gateway: Gateway
    principal: Principal
    response: dict  # the Response, in progress
    conversation: list[dict]  # as chat messages, without the instructions: what a follower continues
    input_items: list[dict]
    started: client_call.Started
    output: Output = field(default_factory=Output)

    async def whole(self, request: Request | None) -> dict:
        collected = await client_call.collect(self.started, request)
        for delta in collected.deltas:
            self.output.delta(delta)
        incomplete = collected.finish.finish_reasons[0] == "length"
        self.output.finish(incomplete)
        return await self.finished(collected.finish, incomplete)

    async def stream(self) -> AsyncIterator[bytes]:
        output, finish = self.output, None
        yield _sse(output.event("response.created", response=self.response))
        yield _sse(output.event("response.in_progress", response=self.response))
        try:
            async with contextlib.aclosing(self.started.events) as events:
                async for event in events:
                    if isinstance(event, Finish):
                        finish = event
                    else:
                        for built in output.delta(event):
                            yield _sse(built)
        except BackendError as exc:  # mid-stream: the response fails, never a silent clean end
            error = _in_responses_terms(GatewayError.of(exc))
            if output.open is not None:
                output.open["status"] = "incomplete"
            failed = {**self.response, "status": "failed", "output": output.items,
                      "error": {"code": "server_error", "message": error.message}}
            yield _sse(output.event("response.failed", response=failed))
            return
        incomplete = finish.finish_reasons[0] == "length"
        for built in output.finish(incomplete):
            yield _sse(built)
        response = await self.finished(finish, incomplete)
        yield _sse(output.event(f"response.{response['status']}", response=response))

    async def finished(self, finish: Finish, incomplete: bool) -> dict:
        """The Response at its end, kept (before the client sees it) where asked."""
        response = {**self.response, "output": self.output.items, "usage": usage_json(finish.usage)}
        if incomplete:
            response |= {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}
        else:
            response |= {"status": "completed", "completed_at": int(time.time())}
        if response["store"]:
            await self.keep(response)
        return response

    async def keep(self, response: dict) -> None:
        """A store that fails leaves the answer delivered (it is generated and billed), unkept."""
        now = utcnow()
        row = StoredResponse(
            id=response["id"], tenant=self.principal.tenant.name, key_prefix=self.principal.key_prefix,
            model=response["model"], messages=self.conversation + chat_messages(response["output"]),
            input_items=self.input_items, body=response, created_at=now,
            expires_at=now + timedelta(seconds=self.gateway.settings.responses_retention_s))
        try:
            await asyncio.to_thread(_add, self.gateway.db, row)
        except SQLAlchemyError:
            log.exception("response %s was not stored", response["id"])


async def _start(gateway: Gateway, principal: Principal, body: ResponsesRequest, request: Request | None,
                 api: str = "responses", response_id: str | None = None) -> Turn:
    """Translate the body, start its call on the chat path and wait for its first event (errors raise here)."""
    items = [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) \
        else body.input
    if not items:
        raise InvalidRequest("input must not be empty", param="input")
    new = chat_messages(items)
    extra = _chat_fields(body)
    earlier = (await _stored(gateway, principal, body.previous_response_id, "previous_response_id")).messages \
        if body.previous_response_id else []
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + earlier + new
    response_id = response_id or f"resp_{uuid.uuid4().hex}"  # the ledger's request id too
    stream = bool(body.stream)
    decision = gateway.resolve(principal, body.model, prompt_text({"messages": messages}), body.max_output_tokens,
                               stream, client_call.trace_of(request))
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    generate_request = GenerateRequest(request_id=response_id, model=decision.model, messages=messages,
                                       max_tokens=body.max_output_tokens, temperature=temperature, top_p=top_p,
                                       extra=extra)
    try:
        started = await client_call.start(gateway, request, principal, decision, generate_request, api, stream)
    except (BackendError, GatewayError) as error:
        raise _in_responses_terms(error) from None
    response = {
        "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "background": False, "error": None, "incomplete_details": None, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens, "model": decision.asked, "output": [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": None},
        "store": body.store is not False, "temperature": temperature,
        "text": {"format": {"type": "text"}, **(body.text or {})}, "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [], "top_p": top_p, "truncation": "disabled", "usage": None, "user": body.user,
        "metadata": body.metadata or {},
    }
    return Turn(gateway, principal, response, earlier + new, _listed(items), started)


async def create_response(gateway: Gateway, principal: Principal, body: dict, request: Request | None = None,
                          api: str = "responses", response_id: str | None = None) -> dict:
    """A Responses body's whole answer, the non-streamed Response, for a caller without an HTTP
    client (a batch's line, billed under its own `api` and id). Raises as the endpoint does:
    GatewayError, BackendError, or pydantic's ValidationError for a malformed body."""
    asked = ResponsesRequest.model_validate(body)
    if asked.stream:
        raise InvalidRequest("stream is not available here", param="stream")
    return await (await _start(gateway, principal, asked, request, api, response_id)).whole(request)


@router.post("/responses")
async def create(request: Request, body: ResponsesRequest, principal: InferencePrincipal, gateway: GatewayDep):
    turn = await _start(gateway, principal, body, request)
    if body.stream:
        return StreamingResponse(turn.stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                          **turn.started.headers})
    return JSONResponse(await turn.whole(request), headers=turn.started.headers)


# -- stored responses ---------------------------------------------------------------------------
def _add(db, row: StoredResponse) -> None:
    with Session(db) as session:
        session.add(row)
        session.commit()


def _find(db, tenant: str, response_id: str) -> StoredResponse | None:
    with Session(db) as session:
        row = session.get(StoredResponse, response_id)
    return row if row is not None and row.tenant == tenant and row.expires_at > utcnow() else None


async def _stored(gateway: Gateway, principal: Principal, response_id: str, param: str = "response_id"):
    """The caller's tenant's response, unexpired; any other is not found, never told apart."""
    row = await asyncio.to_thread(_find, gateway.db, principal.tenant.name, response_id)
    if row is None:
        raise _not_found(response_id, param)
    return row


def _not_found(response_id: str, param: str) -> GatewayError:
    return GatewayError(404, f"Response with id {response_id!r} not found.", "invalid_request_error",
                        code="response_not_found", param=param)


def purge_expired(db, now: datetime) -> int:
    """Delete the stored responses expired at `now` (an aware datetime); returns how many."""
    with Session(db) as session:
        deleted = session.exec(delete(StoredResponse).where(StoredResponse.expires_at <= now)).rowcount
        session.commit()
    return deleted


@router.get("/responses/{response_id}")
async def retrieve(response_id: str, principal: InferencePrincipal, gateway: GatewayDep):
    return (await _stored(gateway, principal, response_id)).body


@router.delete("/responses/{response_id}")
async def remove(response_id: str, principal: InferencePrincipal, gateway: GatewayDep):
    def drop() -> int:
        with Session(gateway.db) as session:
            deleted = session.exec(delete(StoredResponse).where(
                StoredResponse.id == response_id, StoredResponse.tenant == principal.tenant.name,
                StoredResponse.expires_at > utcnow())).rowcount
            session.commit()
        return deleted

    if not await asyncio.to_thread(drop):
        raise _not_found(response_id, "response_id")
    return {"id": response_id, "object": "response", "deleted": True}


@router.get("/responses/{response_id}/input_items")
async def input_items(response_id: str, principal: InferencePrincipal, gateway: GatewayDep,
                      order: Literal["asc", "desc"] = "desc", limit: Annotated[int, Query(ge=1, le=100)] = 20,
                      after: str | None = None):
    items = (await _stored(gateway, principal, response_id)).input_items
    if order == "desc":
        items = items[::-1]
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise InvalidRequest(f"after: this response has no input item {after!r}", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
