"""Timeouts on streams, at a cost per stream rather than per item.

`asyncio.timeout()` around every awaited chunk costs a timer and a context per chunk, which a
gateway pays on every token of every request. `StreamTimer` keeps one timer per stream, re-armed
lazily, and only ever cancels a wait for the stream, never the consumer's work between items.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")


class StreamTimer:
    """Bounds each wait for the next item (`idle_s`) and, optionally, the whole stream's life
    (`deadline`, a loop time). Raises `TimeoutError` from `next()` when one runs out."""

    def __init__(self, idle_s: float, deadline: float | None = None) -> None:
        self.idle_s, self.deadline = idle_s, deadline
        self.loop = asyncio.get_running_loop()
        self._task: asyncio.Task | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._waiting_since: float | None = None
        self._expired = False

    def _limit(self, since: float) -> float:
        end = since + self.idle_s
        return end if self.deadline is None else min(end, self.deadline)

    def _check(self) -> None:
        self._handle = None
        now = self.loop.time()
        if self._waiting_since is not None and now >= self._limit(self._waiting_since):
            self._expired = True
            self._task.cancel()
            return
        start = self._waiting_since if self._waiting_since is not None else now
        self._handle = self.loop.call_at(self._limit(start), self._check)

    async def next(self, items: AsyncIterator[T]) -> T:
        self._task = asyncio.current_task()  # a stream may be read by more than one task in turn
        self._waiting_since = self.loop.time()
        if self._handle is None:
            self._handle = self.loop.call_at(self._limit(self._waiting_since), self._check)
        try:
            return await anext(items)
        except asyncio.CancelledError:
            if self._expired:
                self._expired = False
                self._task.uncancel()
                raise TimeoutError from None
            raise
        finally:
            self._waiting_since = None

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
