"""The gateway's shared state, one per process: who may call (directory), how much (quotas),
what they used (ledger), how many at once (admission), and what it all looks like (metrics)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from sqlalchemy import Engine

from backends.base import Backend, Health
from policies.rollout import ROLLOUT, load_rollout

from .admission import Admission
from .auth import Directory, Principal
from .canary import CanaryGuard
from .ledger import UsageLedger
from .quotas import MemoryQuotaStore, QuotaStore, RedisQuotaStore
from .routing import Decision, ModelRouter, RequestFacts
from .settings import Settings
from .telemetry import GatewayMetrics

log = logging.getLogger("servegate.gateway")


class Gateway:
    def __init__(self, backends: dict[str, Backend], settings: Settings, db: Engine) -> None:
        self.settings, self.db = settings, db
        self.router = ModelRouter(backends, settings.route_seed)
        self.directory = Directory(db, settings)
        self.quotas: QuotaStore = RedisQuotaStore(settings.redis_url) if settings.redis_url else MemoryQuotaStore()
        self.ledger = UsageLedger(db, settings.spool_dir, settings.usage_flush_s)
        self.metrics = GatewayMetrics()
        self.admission = {  # per backend, by name
            name: Admission(settings.max_in_flight, settings.max_queued, settings.queue_timeout_s)
            for name in self.router.by_name
        }
        self.router.pending = lambda name: self.admission[name].in_flight + self.admission[name].queued
        self._tasks: set[asyncio.Task] = set()
        self.canary = CanaryGuard(self, load_rollout(settings.rollout_policy or ROLLOUT))

    async def start(self) -> None:
        await asyncio.to_thread(self.directory.load)  # the first read must succeed: no keys, no service
        self.load_routes()
        self.spawn(self.directory.run())
        self.spawn(self.ledger.run())
        self.spawn(self._refresh_routes())
        self.spawn(self._poll_loads())
        self.spawn(self.canary.run())

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*self._tasks)
        await asyncio.to_thread(self.ledger.close)
        await self.quotas.close()

    def spawn(self, coroutine) -> asyncio.Task:
        """Run in the background, holding a reference until done."""
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def visible_models(self, principal: Principal) -> list[str]:
        return [m for m in self.router.models() if principal.may_use(m)]

    def resolve(self, principal: Principal, model: str | None, prompt: str = "", max_tokens: int | None = None,
                stream: bool = False) -> Decision:
        facts = RequestFacts(principal.tenant.name, principal.tenant.tier, prompt, max_tokens or 0, stream)
        return self.router.resolve(model, self.visible_models(principal), facts)

    # -- routes -------------------------------------------------------------------------------
    def load_routes(self) -> None:
        """The route table from the database; this replica serves it from now on."""
        from sqlmodel import Session

        from .routes import table

        with Session(self.db) as session:
            self.router.set_routes(table(session))

    async def _refresh_routes(self) -> None:
        """Deploys, promotions and rollbacks reach every replica within the refresh interval; if the
        database is down, the last table keeps serving."""
        while True:
            await asyncio.sleep(self.settings.refresh_s)
            try:
                await asyncio.to_thread(self.load_routes)
            except Exception as exc:  # the database is down: keep the last table
                log.warning("route refresh failed: %s", exc)

    async def _poll_loads(self) -> None:
        """Route targets' health and live load (queue, KV usage): a target that reports itself
        down is skipped until it is back; the load feeds least-loaded and prefix-aware choices."""
        while True:
            names = {b for state in self.router.routes.values() for version in (state.active, state.canary)
                     if version is not None for b in version.spec.backends()}
            for name in names & set(self.router.by_name):
                backend = self.router.by_name[name]
                with contextlib.suppress(Exception):
                    if await backend.health() == Health.DOWN:
                        self.router.down.add(name)
                        continue
                    self.router.down.discard(name)
                    self.router.loads[name] = await backend.load()
                    if name not in self.router.capabilities:
                        self.router.capabilities[name] = await backend.capabilities()
            await asyncio.sleep(self.settings.load_poll_s)
