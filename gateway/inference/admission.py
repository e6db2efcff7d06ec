"""Backpressure, per backend: a cap on requests in flight and a bounded wait queue, fair across
tenants.

A request that finds the queue full, or waits longer than the queue timeout, is refused with
503 and `Retry-After` instead of piling onto a saturated backend. A freed slot goes to the waiting
tenant with the fewest requests in flight, tenants with as few taking turns (each tenant's own
requests in arrival order): one tenant's hundred queued requests never sit in front of another
tenant's one, which waits for at most one slot per other tenant waiting with as few in flight."""

from __future__ import annotations

import asyncio
from collections import Counter, deque

from backends.base import Overloaded


class Admission:
    def __init__(self, max_in_flight: int, max_queued: int, timeout_s: float) -> None:
        self.max_in_flight, self.max_queued, self.timeout_s = max_in_flight, max_queued, timeout_s
        self.in_flight = 0
        self.queued = 0
        self._tenants_in_flight: Counter[str | None] = Counter()
        # Each waiting tenant's requests, the tenants in turn order: a tenant just served goes last.
        self._waiting: dict[str | None, deque[asyncio.Future[None]]] = {}

    @property
    def saturation(self) -> float:
        """Requests in flight and waiting over the slots: 1 when every slot is busy, more when
        requests queue."""
        return (self.in_flight + self.queued) / self.max_in_flight

    async def acquire(self, tenant: str | None = None) -> None:
        if self.in_flight < self.max_in_flight:  # then none waits (`_grant`)
            self._take(tenant)
            return
        if self.queued >= self.max_queued:
            raise Overloaded(f"the backend is saturated: {self.in_flight} requests in flight and "
                             f"{self.queued} waiting; retry later")
        granted = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tenant, deque()).append(granted)
        self.queued += 1
        try:
            async with asyncio.timeout(self.timeout_s):
                await granted
        except BaseException as exc:
            if granted.done() and not granted.cancelled():
                self.release(tenant)  # granted as it gave up: the slot goes to the next
            else:
                self._withdraw(tenant, granted)
            if isinstance(exc, TimeoutError):
                raise Overloaded(f"no capacity freed within {self.timeout_s:g} s; retry later") from None
            raise
        finally:
            self.queued -= 1

    def release(self, tenant: str | None = None) -> None:
        self.in_flight -= 1
        self._tenants_in_flight[tenant] -= 1
        if not self._tenants_in_flight[tenant]:
            del self._tenants_in_flight[tenant]
        self._grant()

    def _take(self, tenant: str | None) -> None:
        self.in_flight += 1
        self._tenants_in_flight[tenant] += 1

    def _grant(self) -> None:
        """Free slots to waiting requests, until none is free or none waits: the tenant with the
        fewest in flight first, ties to the one whose turn it is (`min` keeps the first of equals)."""
        while self.in_flight < self.max_in_flight and self._waiting:
            tenant = min(self._waiting, key=self._tenants_in_flight.__getitem__)
            queue = self._waiting.pop(tenant)
            granted = queue.popleft()
            if queue:
                self._waiting[tenant] = queue  # its next turn after the others'
            if not granted.done():  # else cancelled, its waiter not yet back to withdraw it
                self._take(tenant)
                granted.set_result(None)

    def _withdraw(self, tenant: str | None, granted: asyncio.Future[None]) -> None:
        queue = self._waiting.get(tenant)
        if queue is not None and granted in queue:
            queue.remove(granted)
            if not queue:
                del self._waiting[tenant]
