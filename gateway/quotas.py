"""Quotas: requests/min, tokens/min, tokens/day, concurrency and spend (daily and monthly
budgets), per tenant and per key.

A request reserves before it is forwarded (prompt tokens + its max tokens, and what they would
cost at most), so streams in flight can never push a window past its limit; when it ends it
settles to the tokens and cost really used and frees its concurrency slot. Windows are fixed
(the UTC minute, day and calendar month). Settling also adds the request's cost to what each
scope has spent; a settlement that carries spend across 80% or 100% of a budget says so (each
crossing happens in exactly one settlement, whichever replica makes it).
Two stores share one interface: in process (one replica) and Redis, where one Lua script
checks and charges every window atomically, so N replicas enforce one limit, not N.
"""

from __future__ import annotations

import abc
import calendar
import logging
import math
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime

import redis.asyncio as redis
from redis.exceptions import RedisError

from .models import dollars

log = logging.getLogger("servegate.quotas")
MINUTE, DAY = 60, 86_400
ALERT_PERCENTS = (80, 100)


@dataclass(frozen=True)
class QuotaLimits:
    rpm: int | None = None
    tpm: int | None = None
    tokens_per_day: int | None = None
    max_concurrency: int | None = None
    daily_budget: int | None = None  # nano-dollars
    monthly_budget: int | None = None


@dataclass(frozen=True)
class Counter:
    """One windowed count a limit is checked against."""

    limit: str  # the QuotaLimits field
    key: str  # its name in the store
    charge: str  # requests | tokens | cost
    window: str  # minute | day | month
    ttl: int  # seconds its Redis key outlives the window's start


COUNTERS = (
    Counter("rpm", "rpm", "requests", "minute", 2 * MINUTE),
    Counter("tpm", "tpm", "tokens", "minute", 2 * MINUTE),
    Counter("tokens_per_day", "tpd", "tokens", "day", 2 * DAY),
    Counter("daily_budget", "usd-day", "cost", "day", 2 * DAY),
    Counter("monthly_budget", "usd-month", "cost", "month", 32 * DAY),
)
BUDGETS = tuple(c for c in COUNTERS if c.charge == "cost")
LIMIT_NAMES = {"rpm": "requests per minute", "tpm": "tokens per minute", "tokens_per_day": "tokens per day",
               "max_concurrency": "concurrent requests", "daily_budget": "daily budget",
               "monthly_budget": "monthly budget"}


@dataclass(frozen=True)
class Scope:
    """Who a limit applies to, e.g. `tenant:acme` or `key:1a2b3c4d`."""

    name: str
    limits: QuotaLimits


class QuotaExceeded(Exception):
    def __init__(self, scope: str, limit: str, value: int, retry_after: float, message: str) -> None:
        super().__init__(message)
        self.scope, self.limit, self.value, self.retry_after, self.message = scope, limit, value, retry_after, message

    @property
    def budget(self) -> bool:
        return self.limit in ("daily_budget", "monthly_budget")


@dataclass(frozen=True)
class BudgetCrossing:
    """A scope's spend in one budget window reached `percent` of the budget."""

    scope: str
    budget: str  # daily_budget | monthly_budget
    window: str  # 2026-12-01 | 2026-12
    percent: int
    spent: int  # nano-dollars, after the settlement that crossed
    limit: int


@dataclass
class Reservation:
    id: str
    scopes: tuple[Scope, ...]
    tokens: int
    cost: int  # nano-dollars, at most
    minute: int
    day: int
    month: int  # months since year 0
    settled: bool = field(default=False)
    local: bool = field(default=False)  # charged to the in-process fallback (Redis was down)

    def window(self, counter: Counter) -> int:
        return getattr(self, counter.window)

    def amount(self, counter: Counter) -> int:
        return {"requests": 1, "tokens": self.tokens, "cost": self.cost}[counter.charge]


def _month(now: float) -> int:
    moment = datetime.fromtimestamp(now, UTC)
    return moment.year * 12 + moment.month - 1


def _window_left(window: str, now: float) -> float:
    if window == "minute":
        return MINUTE - now % MINUTE
    if window == "day":
        return DAY - now % DAY
    moment = datetime.fromtimestamp(now, UTC)
    return calendar.monthrange(moment.year, moment.month)[1] * DAY - (now - datetime(
        moment.year, moment.month, 1, tzinfo=UTC).timestamp())


def _window_name(counter: Counter, r: Reservation) -> str:
    if counter.window == "month":
        return f"{r.month // 12:04d}-{r.month % 12 + 1:02d}"
    return datetime.fromtimestamp(r.day * DAY, UTC).date().isoformat()


def _exceeded(scope: Scope, limit: str, used: int, now: float) -> QuotaExceeded:
    value = getattr(scope.limits, limit)
    counter = next((c for c in COUNTERS if c.limit == limit), None)
    wait = 1.0 if counter is None else _window_left(counter.window, now)
    if counter is not None and counter.charge == "cost":
        message = (f"Budget reached for {scope.name}: {dollars(used)} of its {LIMIT_NAMES[limit]} of "
                   f"{dollars(value)} spent or reserved.")
    else:
        message = f"Rate limit reached for {scope.name}: {LIMIT_NAMES[limit]} limit {value}."
    return QuotaExceeded(scope.name, limit, value, math.ceil(wait), message)


class QuotaStore(abc.ABC):
    async def reserve(self, scopes: tuple[Scope, ...], tokens: int, cost: int = 0) -> Reservation:
        """Charge one request, `tokens` and `cost` (nano-dollars) to every scope's windows, or raise
        `QuotaExceeded` and charge nothing."""
        now = time.time()
        reservation = Reservation(uuid.uuid4().hex, scopes, tokens, cost, int(now // MINUTE), int(now // DAY),
                                  _month(now))
        refused = await self._reserve(reservation, now)
        if refused is not None:
            scope, limit, used = refused
            raise _exceeded(scope, limit, used, now)
        return reservation

    async def settle(self, reservation: Reservation, tokens_used: int, cost: int = 0) -> list[BudgetCrossing]:
        """Return the unused part of the reservation, free the concurrency slot and add `cost` to
        the spend (once). Returns the budget thresholds this settlement carried spend across."""
        if reservation.settled:
            return []
        reservation.settled = True
        spent = await self._settle(reservation, tokens_used - reservation.tokens, cost - reservation.cost, cost)
        crossings = []
        for scope, totals in zip(reservation.scopes, spent):
            for counter, total in zip(BUDGETS, totals):
                limit = getattr(scope.limits, counter.limit)
                for percent in ALERT_PERCENTS if limit is not None else ():
                    threshold = limit * percent / 100
                    if total - cost < threshold <= total:
                        crossings.append(BudgetCrossing(scope.name, counter.limit, _window_name(counter, reservation),
                                                        percent, total, limit))
        return crossings

    @abc.abstractmethod
    async def _reserve(self, r: Reservation, now: float) -> tuple[Scope, str, int] | None:
        """None, or the scope and limit that refused and what its window held."""

    @abc.abstractmethod
    async def _settle(self, r: Reservation, token_delta: int, cost_delta: int, cost: int) -> list[list[int]]:
        """Per scope, what it has spent in each budget window (BUDGETS) once `cost` is added."""

    async def close(self) -> None:
        pass


class MemoryQuotaStore(QuotaStore):
    """One replica's quotas. Every method runs on the event loop without awaiting, so each
    check-and-charge is atomic."""

    def __init__(self) -> None:
        self.counters: dict[tuple[str, str, int], int] = defaultdict(int)
        self.spent: dict[tuple[str, str, int], int] = defaultdict(int)
        self.in_flight: dict[str, int] = defaultdict(int)
        self._minute = 0

    async def _reserve(self, r: Reservation, now: float) -> tuple[Scope, str, int] | None:
        self._forget_old_windows(r)
        for scope in r.scopes:
            for counter in COUNTERS:
                cap = getattr(scope.limits, counter.limit)
                used = self.counters[scope.name, counter.key, r.window(counter)]
                if cap is not None and used + r.amount(counter) > cap:
                    return scope, counter.limit, used
            cap = scope.limits.max_concurrency
            if cap is not None and self.in_flight[scope.name] >= cap:
                return scope, "max_concurrency", self.in_flight[scope.name]
        for scope in r.scopes:
            for counter in COUNTERS:
                self.counters[scope.name, counter.key, r.window(counter)] += r.amount(counter)
            self.in_flight[scope.name] += 1
        return None

    async def _settle(self, r: Reservation, token_delta: int, cost_delta: int, cost: int) -> list[list[int]]:
        spent = []
        for scope in r.scopes:
            for counter in COUNTERS:
                key = (scope.name, counter.key, r.window(counter))
                if counter.charge != "requests" and key in self.counters:
                    self.counters[key] += token_delta if counter.charge == "tokens" else cost_delta
            self.in_flight[scope.name] -= 1
            totals = []
            for counter in BUDGETS:
                self.spent[scope.name, counter.key, r.window(counter)] += cost
                totals.append(self.spent[scope.name, counter.key, r.window(counter)])
            spent.append(totals)
        return spent

    def _forget_old_windows(self, r: Reservation) -> None:
        if r.minute == self._minute:
            return
        self._minute = r.minute
        for table in (self.counters, self.spent):
            for key in [k for k in table if k[2] < next(r.window(c) for c in COUNTERS if c.key == k[1])]:
                del table[key]


# KEYS: per scope, one key per counter (COUNTERS), then the concurrency zset.
# ARGV: now, reservation id, slot deadline, number of counters C, C amounts, C key TTLs, then per
# scope C limits and the concurrency limit (-1: none).
# Returns nil, or {scope index, limit index (C + 1: concurrency), what its window held}.
RESERVE_LUA = """
local now, id, deadline, C = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local per, limits = C + 1, 4 + 2 * C
for s = 0, #KEYS / per - 1 do
  for c = 1, C do
    local limit = tonumber(ARGV[limits + s * per + c])
    if limit >= 0 then
      local used = tonumber(redis.call('GET', KEYS[s * per + c]) or '0')
      if used + tonumber(ARGV[4 + c]) > limit then return {s, c, used} end
    end
  end
  local conc, limit = KEYS[s * per + per], tonumber(ARGV[limits + s * per + per])
  redis.call('ZREMRANGEBYSCORE', conc, '-inf', now)
  if limit >= 0 and redis.call('ZCARD', conc) >= limit then return {s, per, redis.call('ZCARD', conc)} end
end
for s = 0, #KEYS / per - 1 do
  for c = 1, C do
    redis.call('INCRBY', KEYS[s * per + c], tonumber(ARGV[4 + c]))
    redis.call('EXPIRE', KEYS[s * per + c], tonumber(ARGV[4 + C + c]))
  end
  redis.call('ZADD', KEYS[s * per + per], deadline, id)
  redis.call('EXPIRE', KEYS[s * per + per], 86400)
end
return nil
"""

# KEYS: per scope, one key per counter, the concurrency zset, then one spend key per budget (B).
# ARGV: reservation id, C, B, C deltas (0: leave it), the cost, B spend-key TTLs.
# Returns, per scope, its spend in each budget window after adding the cost.
SETTLE_LUA = """
local id, C, B = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local per, cost, spent = C + 1 + B, tonumber(ARGV[4 + C]), {}
for s = 0, #KEYS / per - 1 do
  for c = 1, C do
    local key, delta = KEYS[s * per + c], tonumber(ARGV[3 + c])
    if delta ~= 0 and redis.call('EXISTS', key) == 1 then redis.call('INCRBY', key, delta) end
  end
  redis.call('ZREM', KEYS[s * per + C + 1], id)
  for b = 1, B do
    local key = KEYS[s * per + C + 1 + b]
    table.insert(spent, redis.call('INCRBY', key, cost))
    redis.call('EXPIRE', key, tonumber(ARGV[4 + C + b]))
  end
end
return spent
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

    def _key(self, scope: Scope, name: str, window: int) -> str:
        return f"{self.namespace}:{scope.name}:{name}:{window}"

    def _window_keys(self, scope: Scope, r: Reservation) -> list[str]:
        """The scope's counter keys (COUNTERS) for the reservation's windows, then its concurrency set."""
        return [self._key(scope, c.key, r.window(c)) for c in COUNTERS] + [f"{self.namespace}:{scope.name}:conc"]

    async def _reserve(self, r: Reservation, now: float) -> tuple[Scope, str, int] | None:
        keys, limits = [], []
        for scope in r.scopes:
            keys += self._window_keys(scope, r)
            limits += [-1 if v is None else v for v in (*(getattr(scope.limits, c.limit) for c in COUNTERS),
                                                         scope.limits.max_concurrency)]
        args = [now, r.id, now + self.slot_ttl_s, len(COUNTERS), *(r.amount(c) for c in COUNTERS),
                *(c.ttl for c in COUNTERS), *limits]
        try:
            refused = await self._reserve_script(keys=keys, args=args)
        except RedisError as exc:
            log.warning("redis unreachable, enforcing quotas in process: %s", exc)
            r.local = True
            return await self.fallback._reserve(r, now)
        if refused is None:
            return None
        index, counter, used = (int(v) for v in refused)
        limit = COUNTERS[counter - 1].limit if counter <= len(COUNTERS) else "max_concurrency"
        return r.scopes[index], limit, used

    async def _settle(self, r: Reservation, token_delta: int, cost_delta: int, cost: int) -> list[list[int]]:
        if r.local:
            return await self.fallback._settle(r, token_delta, cost_delta, cost)
        keys = []
        for scope in r.scopes:
            keys += self._window_keys(scope, r)
            keys += [self._key(scope, f"{c.key}:spent", r.window(c)) for c in BUDGETS]
        deltas = [{"requests": 0, "tokens": token_delta, "cost": cost_delta}[c.charge] for c in COUNTERS]
        args = [r.id, len(COUNTERS), len(BUDGETS), *deltas, cost, *(c.ttl for c in BUDGETS)]
        try:
            spent = await self._settle_script(keys=keys, args=args)
        except RedisError as exc:  # the slot expires at its deadline; the window keeps the full charge
            log.warning("redis unreachable, reservation %s not settled: %s", r.id, exc)
            return [[0] * len(BUDGETS) for _ in r.scopes]
        return [[int(v) for v in spent[i:i + len(BUDGETS)]] for i in range(0, len(spent), len(BUDGETS))]

    async def close(self) -> None:
        await self.redis.aclose()
