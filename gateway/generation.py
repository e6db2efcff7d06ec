"""Running a backend request on behalf of an HTTP client, shared by every API surface.

The first event is awaited before any response byte is sent, so validation and overload
errors become proper HTTP statuses instead of a broken stream. A client that disconnects,
while we wait or mid-stream, cancels the backend request (its stream is closed, which
releases the backend's resources).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field

from fastapi import Request

from backends.base import Delta, Event, Finish, UpstreamError


class ClientDisconnected(Exception):
    """The HTTP client went away; the backend request was cancelled."""


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


async def open_stream(events: AsyncIterator[Event], request: Request) -> tuple[Event, AsyncIterator[Event]]:
    """Start generation and wait for its first event (errors raise here, before any byte)."""
    try:
        first = await until_disconnect(request, anext(events))
    except BaseException:
        await events.aclose()
        raise
    return first, events


async def resume(first: Event, events: AsyncIterator[Event]) -> AsyncIterator[Event]:
    """The whole stream again, first event included; closing it closes the backend stream."""
    try:
        yield first
        async for event in events:
            yield event
    finally:
        await events.aclose()


@dataclass
class Collected:
    texts: dict[int, list[str]] = field(default_factory=dict)
    extras: dict[int, list[dict]] = field(default_factory=dict)  # Delta.extra, in order
    finish: Finish | None = None

    def text(self, index: int) -> str:
        return "".join(self.texts.get(index, ()))


async def collect(first: Event, events: AsyncIterator[Event], request: Request) -> Collected:
    """Gather a whole non-streamed answer, still cancelling it if the client leaves."""

    async def gather() -> Collected:
        result = Collected()
        async for event in resume(first, events):
            if isinstance(event, Delta):
                result.texts.setdefault(event.index, []).append(event.text)
                if event.extra:
                    result.extras.setdefault(event.index, []).append(event.extra)
            else:
                result.finish = event
        if result.finish is None:
            raise UpstreamError("the backend ended the stream without finishing")
        return result

    return await until_disconnect(request, gather())
