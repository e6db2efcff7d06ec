"""The gateway's shared state, one per process: who may call (directory), how much (quotas),
what they used (ledger), how many at once (admission), and what it all looks like (metrics)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from sqlalchemy import Engine

from backends.base import Backend

from .admission import Admission
from .auth import Directory, Principal
from .ledger import UsageLedger
from .quotas import MemoryQuotaStore, QuotaStore, RedisQuotaStore
from .routing import ModelRouter
from .settings import Settings
from .telemetry import GatewayMetrics

log = logging.getLogger("servegate.gateway")


class Gateway:
    def __init__(self, backends: dict[str, Backend], settings: Settings, db: Engine) -> None:
        self.settings, self.db = settings, db
        self.router = ModelRouter(backends)
        self.directory = Directory(db, settings)
        self.quotas: QuotaStore = RedisQuotaStore(settings.redis_url) if settings.redis_url else MemoryQuotaStore()
        self.ledger = UsageLedger(db, settings.spool_dir, settings.usage_flush_s)
        self.metrics = GatewayMetrics()
        self.admission = {
            model: Admission(settings.max_in_flight, settings.max_queued, settings.queue_timeout_s)
            for model in backends
        }
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        await asyncio.to_thread(self.directory.load)  # the first read must succeed: no keys, no service
        self.spawn(self.directory.run())
        self.spawn(self.ledger.run())

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

    def resolve(self, principal: Principal, model: str | None) -> tuple[str, Backend]:
        return self.router.resolve(model, self.visible_models(principal))
