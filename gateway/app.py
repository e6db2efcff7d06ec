"""The FastAPI application: routers, error handlers, the gateway state and backend lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import random
from collections.abc import Callable
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.staticfiles import StaticFiles
from opentelemetry.trace import TracerProvider
from sqlalchemy import Engine

from backends.base import Backend
from gateway.api import admin, batches, health, metrics, openai, responses, tgi
from gateway.api.batch_runner import BatchRunner
from gateway.api.deps import credential
from gateway.db import make_engine
from gateway.errors import BodyTooLarge, GatewayError, error_response, install_error_handlers
from gateway.inference.call import refusal
from gateway.operations.tracing import TRACER_NAME, TraceRequests, otlp_provider
from gateway.service import Gateway
from gateway.settings import Settings
from gateway.tenancy.quotas import QuotaExceeded, QuotaStoreDown

log = logging.getLogger("servegate.gateway")


class BodyLimit:
    """Refuses request bodies over `limit` bytes: at once when `Content-Length` says so, else
    as soon as the bytes read pass it (chunked uploads), before the body is held in memory."""

    def __init__(self, app, limit: int, upload_limit: int) -> None:
        self.app, self.limit, self.upload_limit = app, limit, upload_limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.upload_limit if scope["path"] == UPLOADS else self.limit
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        too_large = not declared.isdigit() or int(declared) > limit
        read = 0

        async def limited_receive():
            nonlocal read
            if too_large:
                raise BodyTooLarge(limit)
            message = await receive()
            read += len(message.get("body", b""))
            if read > limit:
                raise BodyTooLarge(limit)
            return message

        await self.app(scope, limited_receive, send)


class LargeBodyGate:
    """A large body is read and parsed as JSON on the event loop, tens of milliseconds for a few
    megabytes: before that, its sender must be a caller with quota left. A POST whose body is
    declared over `threshold` bytes, or not declared, is authenticated and checked against its
    tenant's quotas from its headers alone; refused, its body is never read, and the refusal is
    held for about `REFUSAL_PAUSE_S` first (jittered, so held refusals do not end together): a
    client that posts megabytes again at once after a 429 costs the gateway its connections and
    the copying of its bytes, hundreds of times a second, where a held refusal costs a sleeping
    task. Smaller bodies pass as they are: their own checks come after parsing, at no cost worth
    saving."""

    REFUSAL_PAUSE_S = 1.0

    def __init__(self, app, gateway: Gateway, threshold: int) -> None:
        self.app, self.gateway, self.threshold = app, gateway, threshold

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"].startswith("/admin"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) <= self.threshold:
            return await self.app(scope, receive, send)
        request = Request(scope)
        try:
            who = await self.gateway.directory.authenticate(credential(request))
            if "inference" in who.scopes:
                await self.gateway.quotas.check(who.quota_scopes(), 1, 1)
        except QuotaExceeded as exc:
            self.gateway.metrics.quota_rejections.labels(who.tenant.name, exc.limit).inc()
            error = refusal(exc, 1, 1)
        except QuotaStoreDown:
            return await self.app(scope, receive, send)  # the request's own reservation says so, in full
        except GatewayError as refused:
            error = refused
        else:
            return await self.app(scope, receive, send)
        await asyncio.sleep(self.REFUSAL_PAUSE_S * random.uniform(0.5, 1.5))
        await error_response(request, error)(scope, receive, send)


def create_app(backends: dict[str, Backend], settings: Settings | None = None, db: Engine | None = None,
               tracer_provider: TracerProvider | None = None,
               when_unservable: Callable[[], None] | None = None, freeze_gc: bool = False) -> FastAPI:
    """An app serving `backends` (served model id -> backend) to the tenants in the database.
    Backends start in the background, so probes answer at once and /ready turns 200 when
    they are loaded; one that fails is named in /ready's body and the log, and once none is left to
    serve `when_unservable` is called (the command stops its server). Requests
    are traced into `tracer_provider`, else to the OTLP collector the settings name, else not at all."""
    settings = settings or Settings()
    owned_provider = otlp_provider(settings.otlp_endpoint) if tracer_provider is None and settings.otlp_endpoint \
        else None
    tracer_provider = tracer_provider or owned_provider
    gateway = Gateway(backends, settings, db or make_engine(settings.database_url))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async def start(name: str, backend: Backend) -> None:
            try:
                await backend.start()
                if freeze_gc:  # what start-up made lives on: full collections no longer walk it (pauses of 100s of ms)
                    gc.freeze()
            except Exception as exc:
                gateway.failed_to_start[name] = f"{name}: {exc}"
                if isinstance(exc, (OSError, ValueError)):  # the model's own fault: its message says it all
                    log.error("backend for %s failed to start: %s", name, exc)
                else:
                    log.exception("backend for %s failed to start", name)
                if when_unservable is not None and len(gateway.failed_to_start) == len(backends):
                    when_unservable()

        await gateway.start()
        starting = [asyncio.create_task(start(n, b)) for n, b in backends.items()]
        runner = BatchRunner(gateway)
        gateway.supervise("batch runner", runner.run)
        try:
            yield
        finally:
            await runner.stop()  # the lines under way finish while their backends still run
            for task in starting:
                task.cancel()
            await asyncio.gather(*(b.close() for b in backends.values()), return_exceptions=True)
            await gateway.close()
            if owned_provider is not None:
                owned_provider.shutdown()  # the last spans flushed

    docs = {} if settings.api_docs else {"docs_url": None, "redoc_url": None}
    app = FastAPI(title="servegate", version="0.1.0", lifespan=lifespan, **docs)
    app.state.gateway = gateway
    app.add_middleware(LargeBodyGate, gateway=gateway, threshold=settings.gate_body_bytes)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes, upload_limit=settings.file_max_bytes + FORM_BYTES)
    if tracer_provider is not None:  # outermost: a refused body is traced too
        app.add_middleware(TraceRequests, tracer=tracer_provider.get_tracer(TRACER_NAME))
    install_error_handlers(app)
    for module in (health, metrics, openai, responses, batches, tgi, admin):
        app.include_router(module.router)
    app.include_router(tgi.router, prefix="/tgi/{model:path}")  # TGI routes for one model among several
    app.mount("/ui", Console(directory=CONSOLE, html=True), name="console")
    return app


CONSOLE = Path(__file__).parent / "console"
UPLOADS = "/v1/files"  # the one route whose body may be a file (`Settings.file_max_bytes`)
FORM_BYTES = 64 * 1024  # an upload's form fields and multipart framing, around the file itself


class Console(StaticFiles):
    """The operators' console: static files that call the admin API with the user's key. Nothing
    but its own files may run or load in it, and no other site may frame it."""

    HEADERS = {"Content-Security-Policy": "default-src 'self'; "
                                          "frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
               "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}

    def file_response(self, *args, **kwargs):
        response = super().file_response(*args, **kwargs)
        response.headers.update(self.HEADERS)
        return response
