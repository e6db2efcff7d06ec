"""Backpressure, per backend: a cap on requests in flight and a bounded FIFO wait queue.

A request that finds the queue full, or waits longer than the queue timeout, is refused with
503 and `Retry-After` instead of piling onto a saturated backend."""

from __future__ import annotations

import asyncio

from backends.base import Overloaded


class Admission:
    def __init__(self, max_in_flight: int, max_queued: int, timeout_s: float) -> None:
        self.max_in_flight, self.max_queued, self.timeout_s = max_in_flight, max_queued, timeout_s
        self._slots = asyncio.Semaphore(max_in_flight)
        self.queued = 0

    @property
    def in_flight(self) -> int:
        return self.max_in_flight - self._slots._value

    @property
    def saturation(self) -> float:
        """Requests in flight and waiting over the slots: 1 when every slot is busy, more when
        requests queue."""
        return (self.in_flight + self.queued) / self.max_in_flight

    async def acquire(self) -> None:
        if self._slots.locked() and self.queued >= self.max_queued:
            raise Overloaded(f"the backend is saturated: {self.in_flight} requests in flight and "
                             f"{self.queued} waiting; retry later")
        self.queued += 1
        try:
            await asyncio.wait_for(self._slots.acquire(), self.timeout_s)
        except TimeoutError:
            raise Overloaded(f"no capacity freed within {self.timeout_s:g} s; retry later") from None
        finally:
            self.queued -= 1

    def release(self) -> None:
        self._slots.release()
