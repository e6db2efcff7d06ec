"""Running a `Call` for an HTTP client, shared by the OpenAI and TGI surfaces.

The first event is awaited before any response byte is sent, so validation and overload errors
become proper HTTP statuses instead of a broken stream. A client that disconnects, while we wait
or mid-stream, cancels the call: its stream is closed, which releases the backend's resources.
The call's `Gateway.call` block is entered by the handler and left by the response: when the
final event arrives (so the usage is recorded before the client receives the end), or when the
stream ends otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field

from fastapi import Request

from backends.base import Delta, Event, Finish, GenerateRequest, request_bytes
from gateway.errors import ClientDisconnected, GatewayError
from gateway.inference.call import Call
from gateway.inference.routing import Decision
from gateway.operations.tracing import OFF, RequestTrace, request_trace
from gateway.service import Gateway
from gateway.tenancy.auth import Principal

ROUTE_HEADER = "x-servegate-route"


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request | None, awaitable: Awaitable):
    """Await `awaitable` unless the client disconnects first (then cancel it and raise). Without a
    request (a batch's line) there is no client to leave."""
    if request is None:
        return await awaitable
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        work.cancel()
        with contextlib.suppress(BaseException):
            await work
        raise ClientDisconnected
    finally:
        watcher.cancel()


@dataclass
class Started:
    events: AsyncIterator[Event]  # the whole stream, first event included
    headers: dict[str, str]  # the routing decision, for the response


async def start(gateway: Gateway, request: Request | None, principal: Principal, decision: Decision,
                generate_request: GenerateRequest, api: str, stream: bool) -> Started:
    """Reserve and start the call, and wait for its first event (errors raise here). What goes
    upstream is held to the body cap whatever path assembled it (a Responses chain, a batch line)."""
    limit = gateway.settings.max_body_bytes
    if (size := request_bytes(generate_request)) > limit:
        raise GatewayError(413, f"The request would send {size} bytes of prompt and fields upstream (earlier "
                           f"responses' conversation included), more than this gateway sends ({limit} bytes).",
                           "invalid_request_error", code="request_too_large")
    block = contextlib.AsyncExitStack()  # the call's block, left by `_events` once the response ends
    call = await block.enter_async_context(
        gateway.call(principal, decision, generate_request, api, stream, trace_of(request)))
    try:
        first = await until_disconnect(request, call.open())
    except BaseException:
        await block.aclose()
        raise
    return Started(_events(block, call, first), {ROUTE_HEADER: decision.header(call.backend.name)})


async def _events(block: contextlib.AsyncExitStack, call: Call, first: Event) -> AsyncIterator[Event]:
    async with block:
        event = first
        rest = call.rest()
        while not isinstance(event, Finish):
            yield event
            event = await anext(rest)
    yield event  # settled: the end reaches the client after its usage is recorded


@dataclass
class Collected:
    deltas: list[Delta] = field(default_factory=list)
    finish: Finish | None = None

    def text(self, index: int) -> str:
        return "".join(d.text for d in self.deltas if d.index == index)

    def extras(self, index: int) -> list[dict]:
        """Choice `index`'s pass-through fields (`Delta.extra`), in order."""
        return [d.extra for d in self.deltas if d.index == index and d.extra]


def trace_of(request: Request | None) -> RequestTrace:
    return OFF if request is None else request_trace(request)


async def collect(started: Started, request: Request | None) -> Collected:
    """Gather a whole non-streamed answer, still cancelling it if the client leaves."""

    async def gather() -> Collected:
        result = Collected()
        async for event in started.events:
            if isinstance(event, Delta):
                result.deltas.append(event)
            else:
                result.finish = event
        return result

    return await until_disconnect(request, gather())
