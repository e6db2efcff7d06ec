"""The FastAPI application: routers, error handlers, backend lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI

from backends.base import Backend

from .api import health, metrics, openai
from .errors import install_error_handlers
from .routing import ModelRouter

log = logging.getLogger("servegate.gateway")


def create_app(backends: dict[str, Backend]) -> FastAPI:
    """An app serving `backends` (served model id -> backend). Backends start in the background,
    so probes answer at once and /ready turns 200 when they are loaded."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async def start(name: str, backend: Backend) -> None:
            try:
                await backend.start()
            except Exception:
                log.exception("backend for %s failed to start", name)

        starting = [asyncio.create_task(start(n, b)) for n, b in backends.items()]
        try:
            yield
        finally:
            for task in starting:
                task.cancel()
            await asyncio.gather(*(b.close() for b in backends.values()), return_exceptions=True)

    app = FastAPI(title="servegate", version="0.1.0", lifespan=lifespan)
    app.state.router = ModelRouter(backends)
    install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(metrics.router)
    app.include_router(openai.router)
    return app
