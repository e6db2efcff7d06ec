"""Running a `Call` for an HTTP client, shared by the OpenAI and TGI surfaces.

The first event is awaited before any response byte is sent, so validation and overload errors
become proper HTTP statuses instead of a broken stream. A client that disconnects, while we wait
or mid-stream, cancels the call: its stream is closed, which releases the backend's resources.
The call is handed back to the gateway exactly once: when its final event passes (so the usage
record is written before the client receives the end), or when its stream ends otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field

from fastapi import Request

from backends.base import Delta, Event, Finish, GenerateRequest

from .auth import Principal
from .calls import Call
from .errors import ClientDisconnected
from .routing import Decision
from .service import Gateway
from .tracing import of

ROUTE_HEADER = "x-servegate-route"
SETTLE_WAIT_S = 0.5  # how long the end of an answer waits for its quota settlement (Redis may be slow)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, awaitable: Awaitable):
    """Await `awaitable` unless the client disconnects first (then cancel it and raise)."""
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


async def start(gateway: Gateway, request: Request, principal: Principal, decision: Decision,
                greq: GenerateRequest, api: str, stream: bool) -> Started:
    """Reserve and start the call, and wait for its first event (errors raise here)."""
    call = gateway.call(principal, decision, greq, api, stream, of(request))
    try:
        first, events = await until_disconnect(request, call.open())
    except BaseException:
        gateway.settle(call)
        raise
    return Started(_settled(gateway, call, first, events), {ROUTE_HEADER: decision.header(call.backend.name)})


async def _settled(gateway: Gateway, call: Call, first: Event, events: AsyncIterator[Event]) -> AsyncIterator[Event]:
    settled = False
    try:
        event = first
        while True:
            if isinstance(event, Finish):
                settling = gateway.settle(call)
                settled = True
                if settling is not None:  # the slot is free before the client can send its next request
                    await asyncio.wait({settling}, timeout=SETTLE_WAIT_S)
            yield event
            event = await anext(events)
    except StopAsyncIteration:
        return
    finally:
        await events.aclose()
        if not settled:
            gateway.settle(call)


@dataclass
class Collected:
    deltas: list[Delta] = field(default_factory=list)
    finish: Finish | None = None

    def text(self, index: int) -> str:
        return "".join(d.text for d in self.deltas if d.index == index)

    def extras(self, index: int) -> list[dict]:
        """Choice `index`'s pass-through fields (`Delta.extra`), in order."""
        return [d.extra for d in self.deltas if d.index == index and d.extra]


async def collect(started: Started, request: Request) -> Collected:
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
