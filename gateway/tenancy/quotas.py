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

What outlives a restart: spend and windows are rebuilt from the usage ledger (`Spent`) before a
tenant is served: at the start of an in-process store, and on Redis whenever it is found empty
(restarted without persistence, flushed). With Redis, a concurrency slot is a lease the replica
renews while its request runs, so a replica that dies holds its slots for at most `lease_s`; a
settlement that cannot reach Redis is retried until it lands, and lands once.
"""

from __future__ import annotations

import abc
import asyncio
import calendar
import logging
import math
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Literal

import redis.asyncio as redis
from redis.exceptions import RedisError

from gateway.tables import dollars

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


class QuotaStoreDown(Exception):
    """The shared quota store cannot be reached and this gateway fails closed."""


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
    epoch: str = ""  # which life of the shared store charged it (a store rebuilt since holds none of it)

    def window(self, counter: Counter) -> int:
        return getattr(self, counter.window)

    def amount(self, counter: Counter) -> int:
        return {"requests": 1, "tokens": self.tokens, "cost": self.cost}[counter.charge]

    def as_dict(self) -> dict:
        """Enough to settle it from another process (a checkpoint of a stream that may outlive us)."""
        return {k: v for k, v in asdict(self).items() if k not in ("scopes", "settled")} | {
            "scopes": [scope.name for scope in self.scopes]}

    @classmethod
    def of(cls, fields: dict) -> Reservation:
        """One written by `as_dict`, its scopes without limits (no alert is raised by settling it)."""
        scopes = tuple(Scope(name, QuotaLimits()) for name in fields["scopes"])
        return cls(**{k: v for k, v in fields.items() if k != "scopes"}, scopes=scopes)


@dataclass(frozen=True)
class Spent:
    """What one scope used in one window, by the ledger: rebuilt into a store that lost its count."""

    scope: str
    counter: str  # Counter.key
    window: int
    amount: int


History = Callable[[], Awaitable[list[Spent]]]  # the ledger's totals for the current windows


def month_of(now: float) -> int:
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
        return await self._charged(scopes, tokens, cost, charge=True)

    async def check(self, scopes: tuple[Scope, ...], tokens: int, cost: int = 0) -> None:
        """Raise `QuotaExceeded` where `reserve` would, charging nothing: a cheap refusal before the
        work of counting a request exactly."""
        await self._charged(scopes, tokens, cost, charge=False)

    async def _charged(self, scopes: tuple[Scope, ...], tokens: int, cost: int, charge: bool) -> Reservation:
        now = time.time()
        reservation = Reservation(uuid.uuid4().hex, scopes, tokens, cost, int(now // MINUTE), int(now // DAY),
                                  month_of(now))
        refused = await self._reserve(reservation, now, charge)
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
    async def _reserve(self, r: Reservation, now: float, charge: bool = True) -> tuple[Scope, str, int] | None:
        """None, or the scope and limit that refused and what its window held; charged only if
        `charge` and nothing refused."""

    @abc.abstractmethod
    async def _settle(self, r: Reservation, token_delta: int, cost_delta: int, cost: int) -> list[list[int]]:
        """Per scope, what it has spent in each budget window (BUDGETS) once `cost` is added."""

    async def release(self, r: Reservation, tokens_used: int, cost: int) -> None:
        """Settle a reservation a process that died had made (from its checkpoint). In process, the
        reservation died with it, and the windows are rebuilt from the ledger: nothing to do."""

    async def run(self) -> None:
        """Background upkeep while the gateway runs (a shared store renews its leases)."""

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

    def seed(self, history: list[Spent]) -> None:
        """Windows as the ledger counted them (at a start, or when the shared store went away)."""
        for spent in history:
            self.counters[spent.scope, spent.counter, spent.window] = spent.amount
            if any(spent.counter == c.key for c in BUDGETS):
                self.spent[spent.scope, spent.counter, spent.window] = spent.amount

    async def _reserve(self, r: Reservation, now: float, charge: bool = True) -> tuple[Scope, str, int] | None:
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
        if not charge:
            return None
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
            self.in_flight[scope.name] = max(self.in_flight[scope.name] - 1, 0)
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


# KEYS: per scope, one key per counter (COUNTERS) and the concurrency zset; then the epoch key.
# ARGV: now, reservation id, slot deadline, C (counters), S (scopes), charge (1: charge, 0: only
# check), C amounts, C key TTLs, then per scope C limits and the concurrency limit (-1: none).
# Returns {0, epoch} (charged, or would be), {1, scope index, limit index (C + 1: concurrency), what
# its window held} (refused), or {2} (the store is cold: nothing in it may be trusted until rebuilt).
RESERVE_LUA = """
local now, id, deadline = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
local C, S, charge = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6] == '1'
local per, limits = C + 1, 6 + 2 * C
local epoch = redis.call('GET', KEYS[S * per + 1])
if not epoch then return {2} end
for s = 0, S - 1 do
  for c = 1, C do
    local limit = tonumber(ARGV[limits + s * per + c])
    if limit >= 0 then
      local used = tonumber(redis.call('GET', KEYS[s * per + c]) or '0')
      if used + tonumber(ARGV[6 + c]) > limit then return {1, s, c, used} end
    end
  end
  local conc, limit = KEYS[s * per + per], tonumber(ARGV[limits + s * per + per])
  redis.call('ZREMRANGEBYSCORE', conc, '-inf', now)
  if limit >= 0 and redis.call('ZCARD', conc) >= limit then return {1, s, per, redis.call('ZCARD', conc)} end
end
if not charge then return {0, epoch} end
for s = 0, S - 1 do
  for c = 1, C do
    redis.call('INCRBY', KEYS[s * per + c], tonumber(ARGV[6 + c]))
    redis.call('EXPIRE', KEYS[s * per + c], tonumber(ARGV[6 + C + c]))
  end
  redis.call('ZADD', KEYS[s * per + per], deadline, id)
  redis.call('EXPIRE', KEYS[s * per + per], 86400)
end
return {0, epoch}
"""

# KEYS: per scope, one key per counter, the concurrency zset, then one spend key per budget (B);
# then the epoch key and the reservation's settled marker.
# ARGV: reservation id, C, B, S, the reservation's epoch, C deltas, C whole amounts, C counter TTLs,
# the cost, B spend-key TTLs, the marker's TTL.
# A reservation settles once (the marker); one charged in another life of the store (rebuilt since
# from the ledger, which did not hold it yet) adds what it used, not the difference.
# Returns, per scope, its spend in each budget window after adding the cost ({} if settled before).
SETTLE_LUA = """
local id, C, B, S, epoch = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local per, cost, spent = C + 1 + B, tonumber(ARGV[6 + 3 * C]), {}
if not redis.call('SET', KEYS[S * per + 2], '1', 'NX', 'EX', tonumber(ARGV[7 + 3 * C + B])) then return {} end
local same = redis.call('GET', KEYS[S * per + 1]) == epoch
for s = 0, S - 1 do
  for c = 1, C do
    local key = KEYS[s * per + c]
    if same then
      local delta = tonumber(ARGV[5 + c])
      if delta ~= 0 and redis.call('EXISTS', key) == 1 then redis.call('INCRBY', key, delta) end
    else
      redis.call('INCRBY', key, tonumber(ARGV[5 + C + c]))
      redis.call('EXPIRE', key, tonumber(ARGV[5 + 2 * C + c]))
    end
  end
  redis.call('ZREM', KEYS[s * per + C + 1], id)
  for b = 1, B do
    local key = KEYS[s * per + C + 1 + b]
    table.insert(spent, redis.call('INCRBY', key, cost))
    redis.call('EXPIRE', key, tonumber(ARGV[6 + 3 * C + b]))
  end
end
return spent
"""

REBUILD_WAIT_S = 10.0  # how long a replica waits for another's rebuild of a cold store
SETTLE_RETRY_S = (0.1, 5.0)  # a failed settlement's first wait before retrying, and the longest


class RedisQuotaStore(QuotaStore):
    """Quotas shared by every replica that points at the same Redis.

    A concurrency slot is a member of a sorted set scored by its lease's end: this replica renews
    the leases of its open requests every `lease_s / 3`, so a replica that dies (or loses Redis)
    holds its slots for at most `lease_s`. A settlement that cannot reach Redis is retried until
    it lands. Redis found empty (its epoch key gone) is rebuilt from the ledger (`history`) by one
    replica, the others waiting, before anyone is served. While Redis cannot be reached,
    `fail="open"` enforces the limits on this replica alone, in process (its windows rebuilt from
    the ledger), and `fail="closed"` refuses requests (`QuotaStoreDown`)."""

    def __init__(self, url: str, lease_s: float = 15.0, namespace: str = "sg:q", history: History | None = None,
                 fail: Literal["open", "closed"] = "open") -> None:
        self.redis = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self.lease_s, self.namespace, self.history, self.fail = lease_s, namespace, history, fail
        self._reserve_script = self.redis.register_script(RESERVE_LUA)
        self._settle_script = self.redis.register_script(SETTLE_LUA)
        self.fallback = MemoryQuotaStore()
        self._degraded = False  # Redis failed the last reservation: the fallback holds this outage's count
        self.open: dict[str, Reservation] = {}  # charged here, not yet settled: their leases are renewed

    def _key(self, scope: str, name: str, window: int) -> str:
        return f"{self.namespace}:{scope}:{name}:{window}"

    def _slots(self, scope: str) -> str:
        return f"{self.namespace}:{scope}:conc"

    @property
    def _epoch(self) -> str:
        return f"{self.namespace}:epoch"

    def _window_keys(self, scope: Scope, r: Reservation) -> list[str]:
        """The scope's counter keys (COUNTERS) for the reservation's windows, then its concurrency set."""
        return [self._key(scope.name, c.key, r.window(c)) for c in COUNTERS] + [self._slots(scope.name)]

    async def _reserve(self, r: Reservation, now: float, charge: bool = True) -> tuple[Scope, str, int] | None:
        keys, limits = [], []
        for scope in r.scopes:
            keys += self._window_keys(scope, r)
            limits += [-1 if v is None else v for v in (*(getattr(scope.limits, c.limit) for c in COUNTERS),
                                                         scope.limits.max_concurrency)]
        args = [now, r.id, now + self.lease_s, len(COUNTERS), len(r.scopes), int(charge),
                *(r.amount(c) for c in COUNTERS), *(c.ttl for c in COUNTERS), *limits]
        try:
            answer = await self._reserve_script(keys=[*keys, self._epoch], args=args)
            if answer[0] == 2:  # cold: rebuilt from the ledger, then asked again
                await self._rebuild()
                answer = await self._reserve_script(keys=[*keys, self._epoch], args=args)
                if answer[0] == 2:
                    raise RedisError("the quota store is still being rebuilt from the ledger")
        except RedisError as exc:
            if self.fail == "closed":
                raise QuotaStoreDown(f"the quota store cannot be reached: {exc}") from exc
            log.warning("redis unreachable, enforcing quotas in process: %s", exc)
            r.local = True
            if not self._degraded:  # a new outage: this replica counts on from the ledger's totals
                self._degraded = True
                await self._seed_fallback()
            return await self.fallback._reserve(r, now, charge)
        self._degraded = False
        if answer[0] == 1:
            index, counter, used = (int(v) for v in answer[1:])
            limit = COUNTERS[counter - 1].limit if counter <= len(COUNTERS) else "max_concurrency"
            return r.scopes[index], limit, used
        r.epoch = answer[1].decode()
        if charge:
            self.open[r.id] = r
        return None

    async def _settle(self, r: Reservation, token_delta: int, cost_delta: int, cost: int) -> list[list[int]]:
        if r.local:
            return await self.fallback._settle(r, token_delta, cost_delta, cost)
        self.open.pop(r.id, None)
        keys = []
        for scope in r.scopes:
            keys += self._window_keys(scope, r)
            keys += [self._key(scope.name, f"{c.key}:spent", r.window(c)) for c in BUDGETS]
        keys += [self._epoch, f"{self.namespace}:settled:{r.id}"]
        deltas = [{"requests": 0, "tokens": token_delta, "cost": cost_delta}[c.charge] for c in COUNTERS]
        used = [{"requests": 1, "tokens": r.tokens + token_delta, "cost": cost}[c.charge] for c in COUNTERS]
        args = [r.id, len(COUNTERS), len(BUDGETS), len(r.scopes), r.epoch, *deltas, *used, *(c.ttl for c in COUNTERS),
                cost, *(c.ttl for c in BUDGETS), 2 * DAY]
        wait = SETTLE_RETRY_S[0]
        while True:  # until it lands: the marker makes a retry of one that did land a no-op
            try:
                spent = await self._settle_script(keys=keys, args=args)
                break
            except RedisError as exc:
                log.warning("redis unreachable, reservation %s not settled yet (retrying in %.1f s): %s", r.id, wait,
                            exc)
                await asyncio.sleep(wait)
                wait = min(wait * 2, SETTLE_RETRY_S[1])
        return [[int(v) for v in spent[i:i + len(BUDGETS)]] for i in range(0, len(spent), len(BUDGETS))]

    async def release(self, r: Reservation, tokens_used: int, cost: int) -> None:
        if not r.local:  # charged to the dead process's own fallback otherwise
            await self.settle(r, tokens_used, cost)

    async def _rebuild(self) -> None:
        """Fill a cold store with the ledger's totals for the current windows, under a new epoch;
        one replica does it (a lock key), the others wait for its epoch."""
        lock = f"{self.namespace}:rebuilding"
        if not await self.redis.set(lock, "1", nx=True, ex=int(REBUILD_WAIT_S) * 3):
            deadline = time.monotonic() + REBUILD_WAIT_S
            while not await self.redis.exists(self._epoch) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return
        try:
            history = await self.history() if self.history else []
            async with self.redis.pipeline(transaction=True) as pipe:
                for spent in history:
                    counter = next(c for c in COUNTERS if c.key == spent.counter)
                    pipe.set(self._key(spent.scope, spent.counter, spent.window), spent.amount, ex=counter.ttl)
                    if counter in BUDGETS:
                        pipe.set(self._key(spent.scope, f"{spent.counter}:spent", spent.window), spent.amount,
                                 ex=counter.ttl)
                pipe.set(self._epoch, uuid.uuid4().hex)
                await pipe.execute()
            log.warning("the quota store was empty: rebuilt %d windows from the ledger", len(history))
        except Exception as exc:  # the ledger cannot be read: nobody is served on a blank count
            raise RedisError(f"the quota store is empty and the ledger cannot be read to rebuild it: {exc}") from exc
        finally:
            await self.redis.delete(lock)

    async def _seed_fallback(self) -> None:
        """The in-process store starts each outage from the ledger's totals, not from zero (the
        reservations it holds from an earlier outage settle into it all the same)."""
        fallback = MemoryQuotaStore()
        fallback.in_flight = self.fallback.in_flight
        try:
            fallback.seed(await self.history() if self.history else [])
        except Exception as exc:
            log.error("the ledger cannot be read: quotas in process start from zero: %s", exc)
        self.fallback = fallback

    async def run(self) -> None:
        """Renew the leases of this replica's open requests."""
        while True:
            await asyncio.sleep(self.lease_s / 3)
            held = [r for r in self.open.values() if not r.settled]
            if not held:
                continue
            deadline = time.time() + self.lease_s
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for r in held:
                        for scope in r.scopes:
                            pipe.zadd(self._slots(scope.name), {r.id: deadline})
                    await pipe.execute()
            except RedisError as exc:  # the next round tries again; a lease lapses after lease_s
                log.warning("redis unreachable, %d leases not renewed: %s", len(held), exc)

    async def close(self) -> None:
        await self.redis.aclose()
