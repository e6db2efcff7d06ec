"""The fleet: what this replica knows of each backend it can send to (its health, live load and
capabilities, its circuit breaker, its admission queue), and the loop that keeps that fresh.

Routing reads the fleet and changes nothing in it; a call's attempt on a backend goes through
`attempt`, which holds a place in the backend's queue and tells its breaker how it ended."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

from backends.base import Adapter, Backend, BackendError, Capabilities, Health, Load
from gateway.inference.admission import Admission


def unbounded() -> Admission:
    """No cap and no queue of this replica's."""
    return Admission(max_in_flight=1 << 30, max_queued=0, timeout_s=0)


@dataclass
class Breaker:
    """Consecutive failures open it for `cooldown_s`; then it is half-open: one request at a time
    may probe it, and a success closes it. Reading it (`allows`) changes nothing: the probe is
    claimed only when a request really starts on the target (`begin`), and handed back if that
    request never finishes there (`release`: cancelled, refused before sending)."""
    threshold: int = 3
    cooldown_s: float = 10.0
    failures: int = 0
    opened_at: float | None = None
    probing: bool = False

    def allows(self, now: float) -> bool:
        return self.opened_at is None or (now - self.opened_at >= self.cooldown_s and not self.probing)

    def begin(self, now: float) -> None:
        if self.opened_at is not None and now - self.opened_at >= self.cooldown_s:
            self.probing = True

    def release(self) -> None:
        self.probing = False

    def record(self, ok: bool, now: float) -> None:
        self.probing = False
        if ok:
            self.failures, self.opened_at = 0, None
            return
        self.failures += 1
        if self.failures >= self.threshold:
            self.opened_at = now


@dataclass
class Member:
    """One backend as this replica sees it."""
    backend: Backend
    breaker: Breaker = field(default_factory=Breaker)
    admission: Admission = field(default_factory=unbounded)
    load: Load | None = None  # as last polled
    capabilities: Capabilities | None = None  # as last polled (the adapters it can serve change)
    down: bool = False  # its health check says so
    # one load of a LoRA adapter at a time: the requests that find it missing meanwhile wait for it
    adapter_loads: dict[str, asyncio.Lock] = field(default_factory=dict)
    loaded_adapters: dict[str, Adapter] = field(default_factory=dict)  # by this replica, as registered then

    def available(self, now: float) -> bool:
        return not self.down and self.breaker.allows(now)

    @property
    def waiting(self) -> int:
        """Requests ahead of a new one: the backend's own count (all replicas' traffic, as last
        polled) or this replica's, whichever is larger."""
        polled = self.load.waiting + self.load.running if self.load else 0
        return max(polled, self.admission.in_flight + self.admission.queued)

    @property
    def kv_usage(self) -> float:
        return self.load.kv_usage if self.load else 0.0

    def adapter_rank(self, adapter: str) -> int:
        """How soon it can serve a LoRA adapter, as last polled: 0 in its compute slots now, 1 loaded
        (swapped in before the request runs), 2 neither (loaded first)."""
        if self.load is not None and adapter in self.load.resident_adapters:
            return 0
        return 1 if self.capabilities is not None and adapter in self.capabilities.adapters else 2


class Fleet:
    def __init__(self, served: dict[str, Backend], breaker: Breaker | None = None,
                 admission: Callable[[], Admission] | None = None) -> None:
        """`served`: model id -> its backend (one backend may serve several ids); `breaker`: the
        settings every member's breaker starts from; `admission`: makes a member's queue."""
        self.served = served
        backends = list({id(b): b for b in served.values()}.values())
        names = [b.name for b in backends]
        if len(names) != len(set(names)):  # routes, breakers and queues go by name
            raise ValueError(f"backends need distinct names: {sorted({n for n in names if names.count(n) > 1})} "
                             "name more than one")
        self.members = {b.name: Member(b, dataclasses.replace(breaker or Breaker()), (admission or unbounded)())
                        for b in backends}

    def __getitem__(self, name: str) -> Member:
        return self.members[name]

    def __contains__(self, name: str) -> bool:
        return name in self.members

    def backend(self, name: str) -> Backend | None:
        member = self.members.get(name)
        return member.backend if member else None

    @property
    def saturation(self) -> float:
        return max((m.admission.saturation for m in self.members.values()), default=0.0)

    @contextlib.asynccontextmanager
    async def attempt(self, name: str, tenant: str | None = None) -> AsyncIterator[None]:
        """A place in the backend's admission queue, for one attempt of `tenant`'s (the queue is
        fair across tenants); the attempt's result goes to its breaker (a client's mistake is not
        the backend's fault; an attempt that never finished there hands a half-open breaker's
        probe back)."""
        member = self.members[name]
        await member.admission.acquire(tenant)  # refused here: this replica's own queue is full, no fault of the target
        member.breaker.begin(time.monotonic())
        try:
            yield
        except BackendError as exc:
            member.breaker.record(not exc.retryable, time.monotonic())
            raise
        except BaseException:
            member.breaker.release()
            raise
        else:
            member.breaker.record(True, time.monotonic())
        finally:
            member.admission.release(tenant)

    async def poll(self, names: Iterable[str]) -> None:
        """One round of health, live load (queue, KV usage, resident adapters) and capabilities (the
        adapters loaded) for the named members: one that reports itself down is marked so until it
        is back."""
        for name in names:
            member = self.members.get(name)
            if member is None:
                continue
            with contextlib.suppress(Exception):
                member.down = await member.backend.health() == Health.DOWN
                if member.down:
                    continue
                member.load = await member.backend.load()
                member.capabilities = await member.backend.capabilities()

    async def unload_stale(self, registered: Callable[[str], Adapter | None]) -> None:
        """Unload what this replica loaded for an adapter since unregistered or moved to another path
        (a request for the new one then loads it afresh); adapters a backend served from its launch
        are not this replica's to unload."""
        for member in self.members.values():
            for name, adapter in list(member.loaded_adapters.items()):
                if registered(name) != adapter:
                    with contextlib.suppress(Exception):  # gone already, or the backend is down: no harm
                        await member.backend.unload_adapter(name)
                    del member.loaded_adapters[name]

    async def watch(self, names: Callable[[], Iterable[str]], interval_s: float) -> None:
        """Poll the members `names()` gives, every `interval_s`, for the replica's life."""
        while True:
            await self.poll(names())
            await asyncio.sleep(interval_s)
