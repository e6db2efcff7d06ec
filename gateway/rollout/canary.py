"""The canary guard: compares a route's canary with its active version on the live traffic this
replica serves (error rate, TTFT p95, time per output token p95, over a window and a minimum
sample, thresholds in policies/rollout.yaml). A breach ends the canary; a clean run can promote
it. Every replica judges its own traffic; the first to act changes the database and the others
follow at their next refresh (an action on a canary that is already gone does nothing)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass

from sqlalchemy import Engine
from sqlmodel import Session

from gateway.inference.routing import Decision, Router
from gateway.operations.telemetry import GatewayMetrics, percentile
from gateway.rollout import route_versions
from policies.rollout import RolloutPolicy

log = logging.getLogger("servegate.canary")
ACTOR = "canary-guard"


@dataclass(frozen=True)
class Sample:
    at: float
    ok: bool
    ttft_ms: float | None
    tpot_ms: float | None


@dataclass(frozen=True)
class Stats:
    requests: int
    error_rate: float
    ttft_p95: float | None
    tpot_p95: float | None

    @classmethod
    def of(cls, samples: list[Sample]) -> Stats:
        ok = [s for s in samples if s.ok]
        return cls(len(samples), 1 - len(ok) / len(samples) if samples else 0.0,
                   percentile([s.ttft_ms for s in ok if s.ttft_ms is not None], 95),
                   percentile([s.tpot_ms for s in ok if s.tpot_ms is not None], 95))


def verdict(policy: RolloutPolicy, active: Stats, canary: Stats) -> str | None:
    """Why the canary must end, or None while it holds (or too few requests to say)."""
    if min(active.requests, canary.requests) < policy.min_requests:
        return None
    if canary.error_rate - active.error_rate > policy.max_error_rate_delta:
        return (f"error rate {canary.error_rate:.1%} against {active.error_rate:.1%} "
                f"(more than +{policy.max_error_rate_delta:.1%})")
    for name in ("ttft", "tpot"):
        limit, slack = getattr(policy, f"max_{name}_p95_ratio"), getattr(policy, f"{name}_slack_ms")
        mine, theirs = getattr(canary, f"{name}_p95"), getattr(active, f"{name}_p95")
        if mine is not None and theirs and mine / theirs > limit and mine - theirs > slack:
            return f"{name.upper()} p95 {mine:.0f} ms against {theirs:.0f} ms (more than {limit:g}x)"
    return None


class CanaryGuard:
    def __init__(self, router: Router, db: Engine, metrics: GatewayMetrics, policy: RolloutPolicy) -> None:
        self.router, self.db, self.metrics, self.policy = router, db, metrics, policy
        self.samples: dict[tuple[str, int], deque[Sample]] = {}
        self.clean_since: dict[tuple[str, int], float] = {}

    def observe(self, decision: Decision, status: str, ttft_ms: float | None, latency_ms: float,
                tokens: int) -> None:
        """One finished request of a route while it runs a canary (cancelled ones say nothing about
        the backend); samples older than the window are dropped as new ones come."""
        state = self.router.routes.get(decision.alias) if decision.alias is not None else None
        if state is None or state.canary is None or status == "cancelled":
            return
        tpot = (latency_ms - ttft_ms) / (tokens - 1) if ttft_ms is not None and tokens > 1 else None
        window = self.samples.setdefault((decision.alias, decision.version), deque())
        window.append(Sample(time.monotonic(), status == "ok", ttft_ms, tpot))
        self._prune(window)

    def stats(self, alias: str, version: int) -> Stats:
        window = self.samples.get((alias, version), deque())
        self._prune(window)
        return Stats.of(list(window))

    def _prune(self, window: deque[Sample]) -> None:
        horizon = time.monotonic() - self.policy.window_s
        while window and window[0].at < horizon:
            window.popleft()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.policy.check_every_s)
            try:
                await self.check()
            except Exception:  # the database is down: judge again at the next check
                log.exception("canary check failed")

    async def check(self) -> None:
        live = {(alias, v.version) for alias, state in self.router.routes.items()
                for v in (state.active, state.canary) if v is not None}
        for key in set(self.samples) - live:  # versions retired since: nothing left to compare
            del self.samples[key]
        for alias, state in list(self.router.routes.items()):
            if state.active is None or state.canary is None:
                continue
            key = (alias, state.canary.version)
            active, canary = self.stats(alias, state.active.version), self.stats(*key)
            reason = verdict(self.policy, active, canary)
            if reason is not None:
                await asyncio.to_thread(self._act, "rollback", alias, state.canary.version, reason)
                continue
            clean = min(active.requests, canary.requests) >= self.policy.min_requests
            since = self.clean_since.setdefault(key, time.monotonic()) if clean else None
            if not clean:
                self.clean_since.pop(key, None)
            wait = self.policy.auto_promote_after_s
            if since is not None and wait is not None and time.monotonic() - since >= wait:
                await asyncio.to_thread(self._act, "promote", alias, state.canary.version,
                                        f"clean for {wait:g} s over {canary.requests} requests")

    def _act(self, action: str, alias: str, version: int, reason: str) -> None:
        with Session(self.db) as session:
            done = route_versions.end_canary(session, ACTOR, alias, version, reason, action)
            self.router.set_routes(route_versions.table(session))  # this replica follows at once
        if done:
            log.warning("canary %s@%d: %s (%s)", alias, version, action, reason)
            self.metrics.canary_actions.labels(alias, action).inc()
            self.clean_since.pop((alias, version), None)
