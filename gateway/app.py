"""The FastAPI application: routers, error handlers, the gateway state and backend lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI
from sqlalchemy import Engine

from backends.base import Backend

from .api import admin, health, metrics, openai, tgi
from .db import make_engine
from .errors import install_error_handlers
from .service import Gateway
from .settings import Settings

log = logging.getLogger("servegate.gateway")


class RouteHeader:
    """Names the routing decision of an inference response in `x-servegate-route` (a plain ASGI
    wrapper: streamed bodies pass through untouched)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_route(message) -> None:
            route = scope.get("state", {}).get("servegate_route")
            if message["type"] == "http.response.start" and route:
                message = {**message, "headers": [*message.get("headers", []), (b"x-servegate-route", route.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_route)


def create_app(backends: dict[str, Backend], settings: Settings | None = None, db: Engine | None = None) -> FastAPI:
    """An app serving `backends` (served model id -> backend) to the tenants in the database.
    Backends start in the background, so probes answer at once and /ready turns 200 when
    they are loaded."""
    settings = settings or Settings()
    gateway = Gateway(backends, settings, db or make_engine(settings.database_url))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async def start(name: str, backend: Backend) -> None:
            try:
                await backend.start()
            except Exception:
                log.exception("backend for %s failed to start", name)

        await gateway.start()
        starting = [asyncio.create_task(start(n, b)) for n, b in backends.items()]
        try:
            yield
        finally:
            for task in starting:
                task.cancel()
            await asyncio.gather(*(b.close() for b in backends.values()), return_exceptions=True)
            await gateway.close()

    app = FastAPI(title="servegate", version="0.1.0", lifespan=lifespan)
    app.state.gateway = gateway
    app.add_middleware(RouteHeader)
    install_error_handlers(app)
    for module in (health, metrics, openai, tgi, admin):
        app.include_router(module.router)
    app.include_router(tgi.router, prefix="/tgi/{model:path}")  # TGI routes for one model among several
    return app
