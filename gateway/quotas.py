"""Quotas: requests/min, tokens/min, tokens/day and concurrency, per tenant and per key.

A request reserves before it is forwarded (prompt tokens + its max tokens), so streams in
flight can never push a window past its limit; when it ends it settles to the tokens really
used and frees its concurrency slot. Windows are fixed (the UTC minute, the UTC day).
Two stores share one interface: in process (one replica) and Redis, where one Lua script
checks and charges every window atomically, so N replicas enforce one limit, not N.
"""

from __future__ import annotations

import abc
import logging
import math
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field

import redis.asyncio as redis
from redis.exceptions import RedisError

log = logging.getLogger("servegate.quotas")
MINUTE, DAY = 60, 86_400


@dataclass(frozen=True)
class QuotaLimits:
    rpm: int | None = None
    tpm: int | None = None
    tokens_per_day: int | None = None
    max_concurrency: int | None = None


@dataclass(frozen=True)
class Scope:
    """Who a limit applies to, e.g. `tenant:acme` or `key:1a2b3c4d`."""

    name: str
    limits: QuotaLimits


class QuotaExceeded(Exception):
    def __init__(self, scope: str, limit: str, value: int, retry_after: float, message: str) -> None:
        super().__init__(message)
        self.scope, self.limit, self.value, self.retry_after, self.message = scope, limit, value, retry_after, message


@dataclass
class Reservation:
    id: str
    scopes: tuple[Scope, ...]
    tokens: int
    minute: int
    day: int
    settled: bool = field(default=False)
    local: bool = field(default=False)  # charged to the in-process fallback (Redis was down)


LIMIT_NAMES = {"rpm": "requests per minute", "tpm": "tokens per minute",
               "tokens_per_day": "tokens per day", "max_concurrency": "concurrent requests"}


def _exceeded(scope: Scope, limit: str, now: float) -> QuotaExceeded:
    value = getattr(scope.limits, limit)
    if limit == "tokens_per_day":
        wait = DAY - now % DAY
    elif limit == "max_concurrency":
        wait = 1.0
    else:
        wait = MINUTE - now % MINUTE
    return QuotaExceeded(scope.name, limit, value, math.ceil(wait),
                         f"Rate limit reached for {scope.name}: {LIMIT_NAMES[limit]} limit {value}.")


class QuotaStore(abc.ABC):
    async def reserve(self, scopes: tuple[Scope, ...], tokens: int) -> Reservation:
        """Charge one request and `tokens` to every scope's windows, or raise `QuotaExceeded`
        and charge nothing."""
        now = time.time()
        reservation = Reservation(uuid.uuid4().hex, scopes, tokens, int(now // MINUTE), int(now // DAY))
        refused = await self._reserve(reservation, now)
        if refused is not None:
            scope, limit = refused
            raise _exceeded(scope, limit, now)
        return reservation

    async def settle(self, reservation: Reservation, tokens_used: int) -> None:
        """Return the unused part of the reservation and free the concurrency slot (once)."""
        if reservation.settled:
            return
        reservation.settled = True
        await self._settle(reservation, tokens_used - reservation.tokens)

    @abc.abstractmethod
    async def _reserve(self, r: Reservation, now: float) -> tuple[Scope, str] | None: ...

    @abc.abstractmethod
    async def _settle(self, r: Reservation, token_delta: int) -> None: ...

    async def close(self) -> None:
        pass


class MemoryQuotaStore(QuotaStore):
    """One replica's quotas. Every method runs on the event loop without awaiting, so each
    check-and-charge is atomic."""

    def __init__(self) -> None:
        self.counters: dict[tuple[str, str, int], int] = defaultdict(int)
        self.in_flight: dict[str, int] = defaultdict(int)
        self._window = 0

    async def _reserve(self, r: Reservation, now: float) -> tuple[Scope, str] | None:
        self._forget_old_windows(r.minute)
        for scope in r.scopes:
            lim = scope.limits
            checks = (("rpm", ("rpm", r.minute), 1), ("tpm", ("tpm", r.minute), r.tokens),
                      ("tokens_per_day", ("tpd", r.day), r.tokens))
            for limit, (kind, window), amount in checks:
                cap = getattr(lim, limit)
                if cap is not None and self.counters[scope.name, kind, window] + amount > cap:
                    return scope, limit
            if lim.max_concurrency is not None and self.in_flight[scope.name] >= lim.max_concurrency:
                return scope, "max_concurrency"
        for scope in r.scopes:
            self.counters[scope.name, "rpm", r.minute] += 1
            self.counters[scope.name, "tpm", r.minute] += r.tokens
            self.counters[scope.name, "tpd", r.day] += r.tokens
            self.in_flight[scope.name] += 1
        return None

    async def _settle(self, r: Reservation, token_delta: int) -> None:
        for scope in r.scopes:
            for kind, window in (("tpm", r.minute), ("tpd", r.day)):
                if (scope.name, kind, window) in self.counters:
                    self.counters[scope.name, kind, window] += token_delta
            self.in_flight[scope.name] -= 1

    def _forget_old_windows(self, minute: int) -> None:
        if minute == self._window:
            return
        self._window, today = minute, minute * MINUTE // DAY
        for key in [k for k in self.counters if k[2] < (today if k[1] == "tpd" else minute)]:
            del self.counters[key]


# KEYS: per scope 4 keys (rpm, tpm, tpd, concurrency zset).
# ARGV: now, tokens, reservation id, slot deadline, then per scope 4 limits (-1: none).
RESERVE_LUA = """
local now, tokens, id, deadline = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local scopes = #KEYS / 4
for s = 0, scopes - 1 do
  local rpm, tpm, tpd, conc = KEYS[s*4+1], KEYS[s*4+2], KEYS[s*4+3], KEYS[s*4+4]
  local l_rpm, l_tpm, l_tpd, l_conc = tonumber(ARGV[s*4+5]), tonumber(ARGV[s*4+6]), tonumber(ARGV[s*4+7]),
                                      tonumber(ARGV[s*4+8])
  if l_rpm >= 0 and tonumber(redis.call('GET', rpm) or '0') + 1 > l_rpm then return {s, 'rpm'} end
  if l_tpm >= 0 and tonumber(redis.call('GET', tpm) or '0') + tokens > l_tpm then return {s, 'tpm'} end
  if l_tpd >= 0 and tonumber(redis.call('GET', tpd) or '0') + tokens > l_tpd then return {s, 'tokens_per_day'} end
  redis.call('ZREMRANGEBYSCORE', conc, '-inf', now)
  if l_conc >= 0 and redis.call('ZCARD', conc) >= l_conc then return {s, 'max_concurrency'} end
end
for s = 0, scopes - 1 do
  local rpm, tpm, tpd, conc = KEYS[s*4+1], KEYS[s*4+2], KEYS[s*4+3], KEYS[s*4+4]
  redis.call('INCR', rpm); redis.call('EXPIRE', rpm, 120)
  redis.call('INCRBY', tpm, tokens); redis.call('EXPIRE', tpm, 120)
  redis.call('INCRBY', tpd, tokens); redis.call('EXPIRE', tpd, 172800)
  redis.call('ZADD', conc, deadline, id); redis.call('EXPIRE', conc, 86400)
end
return nil
"""

# KEYS: per scope 3 keys (tpm, tpd, concurrency zset). ARGV: token delta, reservation id.
SETTLE_LUA = """
local delta, id = tonumber(ARGV[1]), ARGV[2]
for s = 0, #KEYS / 3 - 1 do
  for i = 1, 2 do
    local key = KEYS[s*3+i]
    if redis.call('EXISTS', key) == 1 then redis.call('INCRBY', key, delta) end
  end
  redis.call('ZREM', KEYS[s*3+3], id)
end
return 1
"""


class RedisQuotaStore(QuotaStore):
    """Quotas shared by every replica that points at the same Redis.

    A concurrency slot is a member of a sorted set scored by its deadline, so a replica that
    dies with requests in flight leaks no slot beyond `slot_ttl_s`. While Redis cannot be
    reached, this replica enforces the limits alone, in process, rather than refuse traffic."""

    def __init__(self, url: str, slot_ttl_s: float = 900.0, namespace: str = "sg:q") -> None:
        self.redis = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self.slot_ttl_s, self.namespace = slot_ttl_s, namespace
        self._reserve_script = self.redis.register_script(RESERVE_LUA)
        self._settle_script = self.redis.register_script(SETTLE_LUA)
        self.fallback = MemoryQuotaStore()

    def _keys(self, scope: Scope, r: Reservation) -> tuple[str, str, str, str]:
        base = f"{self.namespace}:{scope.name}"
        return f"{base}:rpm:{r.minute}", f"{base}:tpm:{r.minute}", f"{base}:tpd:{r.day}", f"{base}:conc"

    async def _reserve(self, r: Reservation, now: float) -> tuple[Scope, str] | None:
        keys, args = [], [now, r.tokens, r.id, now + self.slot_ttl_s]
        for scope in r.scopes:
            keys += self._keys(scope, r)
            lim = scope.limits
            args += [-1 if v is None else v for v in (lim.rpm, lim.tpm, lim.tokens_per_day, lim.max_concurrency)]
        try:
            refused = await self._reserve_script(keys=keys, args=args)
        except RedisError as exc:
            log.warning("redis unreachable, enforcing quotas in process: %s", exc)
            r.local = True
            return await self.fallback._reserve(r, now)
        if refused is None:
            return None
        index, limit = refused
        return r.scopes[int(index)], limit.decode() if isinstance(limit, bytes) else limit

    async def _settle(self, r: Reservation, token_delta: int) -> None:
        if r.local:
            return await self.fallback._settle(r, token_delta)
        keys = [k for scope in r.scopes for k in self._keys(scope, r)[1:]]
        try:
            await self._settle_script(keys=keys, args=[token_delta, r.id])
        except RedisError as exc:  # the slot expires at its deadline; the window keeps the full charge
            log.warning("redis unreachable, reservation %s not settled: %s", r.id, exc)

    async def close(self) -> None:
        await self.redis.aclose()
