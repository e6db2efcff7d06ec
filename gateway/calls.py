"""One inference request's life at the gateway, the same for every API surface:

limits -> quota reservation -> a backend slot (bounded queue) -> the backend stream, timed ->
usage settled, recorded and measured. A route gives several backends in order: when one fails
before its first event (down, overloaded, timed out), the next is tried; after the first event a
failure reaches the client as an error, never as a silent truncation. The usage record is
written when the backend's final event arrives, before the client receives the end of the
response; a request that fails or whose client leaves is recorded too (`error` / `cancelled`)
with the tokens it produced.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

from fastapi import Request

from backends.base import (
    BackendError,
    BackendTimeout,
    Delta,
    Event,
    GenerateRequest,
    Overloaded,
    Unavailable,
    UpstreamError,
    Usage,
)
from backends.timing import StreamTimer

from . import shadow
from .auth import Principal
from .errors import GatewayError
from .generation import open_stream
from .models import utcnow
from .quotas import QuotaExceeded, Reservation
from .routing import Decision
from .service import Gateway

log = logging.getLogger("servegate.requests")
UNKNOWN_CONTEXT = 131_072  # tokens; settled back to actual use when the request ends
# Failures of the backend itself, worth another backend; the client's own errors are not.
RETRYABLE = (Unavailable, Overloaded, BackendTimeout, UpstreamError)


class Call:
    def __init__(self, gateway: Gateway, principal: Principal, decision: Decision, greq: GenerateRequest, api: str,
                 stream: bool) -> None:
        self.gw, self.principal, self.decision = gateway, principal, decision
        self.model, self.backend = decision.model, decision.candidates[0]
        self.greq, self.api, self.stream = greq, api, stream
        self.started, self.started_at = time.monotonic(), utcnow()
        self.prompt_tokens = 0
        self.reservation: Reservation | None = None
        self.first_token_at: float | None = None
        self.answered = False  # a backend sent its first event
        self.produced = 0
        self.finished = False
        self.shadow: asyncio.Task | None = None  # the candidate's mirrored answer, when sampled
        self.text = ""  # the primary's answer, kept only to compare with the shadow's

    async def open(self, request: Request) -> tuple[Event, AsyncIterator[Event]]:
        """Reserve, then start the backend and wait for its first event (errors raise here). The
        backend that answered is named in the `x-servegate-route` response header."""
        await self._reserve()
        if self.decision.shadow is not None:
            self.shadow = self.gw.spawn(shadow.mirror(self.gw, self.decision.shadow, self.greq))
        try:
            opened = await open_stream(self._events(), request)
            request.state.servegate_route = self.decision.header(self.backend)
            return opened
        except BaseException as exc:
            if not self.finished:  # cancelled before the stream even started
                error = exc.code if isinstance(exc, BackendError) else None
                self._finish("error" if error else "cancelled", Usage(self.prompt_tokens, 0, 0), error)
            raise

    # -- before forwarding ------------------------------------------------------------------
    async def _reserve(self) -> None:
        cap = self.principal.max_tokens_per_request
        max_tokens = self.greq.max_tokens
        if cap is not None and max_tokens is not None and max_tokens > cap:
            raise GatewayError(400, f"max_tokens {max_tokens} exceeds this key's limit of {cap} tokens per request.",
                               "invalid_request_error", code="max_tokens_exceeded", param="max_tokens")
        if cap is not None and max_tokens is None:
            self.greq = dataclasses.replace(self.greq, max_tokens=cap)
        self.prompt_tokens = await self.backend.count_prompt_tokens(self.greq)
        if self.greq.max_tokens is not None:
            completion = self.greq.max_tokens
        else:  # no cap asked: reserve what the context leaves (a generous bound when it is unknown)
            context = (await self.backend.capabilities()).max_context or UNKNOWN_CONTEXT
            completion = max(context - self.prompt_tokens, 1)
        tokens = self.prompt_tokens + completion * self.greq.n
        try:
            self.reservation = await self.gw.quotas.reserve(self.principal.quota_scopes(), tokens)
        except QuotaExceeded as exc:
            self.gw.metrics.quota_rejections.labels(self.principal.tenant.name, exc.limit).inc()
            self._refuse_if_never_admissible(exc, tokens)
            kind = "tokens" if exc.limit in ("tpm", "tokens_per_day") else "requests"
            raise GatewayError(429, exc.message, kind, code="rate_limit_exceeded",
                               headers={"Retry-After": str(int(exc.retry_after))}) from None

    def _refuse_if_never_admissible(self, exc: QuotaExceeded, tokens: int) -> None:
        limit = exc.value
        if exc.limit in ("tpm", "tokens_per_day") and tokens > limit:
            raise GatewayError(400, f"This request reserves {tokens} tokens (prompt + max_tokens), more than "
                               f"{exc.scope}'s limit of {limit} {exc.limit}; lower max_tokens.",
                               "invalid_request_error", code="rate_limit_exceeded", param="max_tokens") from None

    # -- the stream ---------------------------------------------------------------------
    async def _events(self) -> AsyncIterator[Event]:
        """The first candidate's events; the next candidate's when one fails before answering."""
        status, error = "cancelled", None
        router, candidates = self.gw.router, self.decision.candidates
        try:
            for number, backend in enumerate(candidates, 1):
                self.backend = backend
                try:
                    async for event in self._attempt(backend):
                        yield event
                except BackendError as exc:
                    retryable = isinstance(exc, RETRYABLE)
                    router.record(backend, ok=not retryable)  # a client's mistake is not the backend's
                    if self.answered or not retryable or number == len(candidates):
                        raise
                    log.warning("backend %s failed before answering (%s); trying %s", backend.name, exc.code,
                                candidates[number].name, extra={"request_id": self.greq.request_id})
                    continue
                router.record(backend, ok=True)
                return
        except BackendError as exc:
            status, error = "error", exc.code
            raise
        except Exception:
            status, error = "error", "internal"
            raise
        finally:
            if not self.finished:
                self._finish(status, Usage(self.prompt_tokens, self.produced, 0), error)

    async def _attempt(self, backend) -> AsyncIterator[Event]:
        admission, metrics = self.gw.admission[backend.name], self.gw.metrics
        in_flight, itl = metrics.in_flight.labels(self.model), metrics.itl.labels(self.model)
        await admission.acquire()
        in_flight.inc()
        last = 0.0
        try:
            metrics.overhead.observe(time.monotonic() - self.started)
            async for event in self._timed(backend.generate(self.greq)):
                self.answered = True
                if isinstance(event, Delta):
                    self.produced += len(event.token_ids)
                    if self.shadow is not None and event.index == 0:
                        self.text += event.text
                    if event.text or event.token_ids:
                        now = time.monotonic()
                        if self.first_token_at is None:
                            self.first_token_at = now
                            metrics.ttft.labels(self.model).observe(now - self.started)
                        else:
                            itl.observe(now - last)
                        last = now
                else:
                    if not event.usage.prompt_tokens:  # the backend could not say: our own count
                        event = dataclasses.replace(
                            event, usage=dataclasses.replace(event.usage, prompt_tokens=self.prompt_tokens))
                    self._finish("ok", event.usage)  # recorded before the client sees the end
                yield event
        finally:
            admission.release()
            in_flight.dec()

    async def _timed(self, events: AsyncIterator[Event]) -> AsyncIterator[Event]:
        """The backend's events, each within the idle timeout and all within the request timeout
        (the route's `timeout_s` where it sets one)."""
        settings = self.gw.settings
        loop = asyncio.get_running_loop()
        timeout = self.decision.timeout_s or settings.request_timeout_s
        timer = StreamTimer(settings.idle_timeout_s, self.started - time.monotonic() + loop.time() + timeout)
        try:
            while True:
                try:
                    event = await timer.next(events)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise BackendTimeout(f"the backend sent nothing for {settings.idle_timeout_s:g} s, or the "
                                         f"request outlived {timeout:g} s") from None
                yield event
        finally:
            timer.cancel()
            await events.aclose()

    # -- after ------------------------------------------------------------------------------
    def _compare(self, status: str, usage: Usage, ttft_ms: float | None, latency_ms: float) -> None:
        """Record the shadow's answer beside this one; a failed or abandoned primary has nothing to
        compare with, so its shadow is dropped."""
        if status != "ok":
            self.shadow.cancel()
            return
        d = self.decision
        primary = shadow.Answer(self.text, usage.completion_tokens, ttft_ms, latency_ms)
        self.gw.spawn(shadow.record(self.gw, d.alias, d.version, self.greq, self.backend.name, primary,
                                    d.shadow.name, self.shadow))

    def _route_label(self) -> str:
        d = self.decision
        return self.model if d.alias is None else f"{d.alias}@{d.version}"

    def _finish(self, status: str, usage: Usage, error: str | None = None) -> None:
        self.finished = True
        now = time.monotonic()
        tenant = self.principal.tenant.name
        backend = getattr(self.backend, "name", "")
        ttft_ms = None if self.first_token_at is None else (self.first_token_at - self.started) * 1000
        record = {
            "request_id": self.greq.request_id, "tenant": tenant, "key_prefix": self.principal.key_prefix,
            "model": self.model, "backend": backend, "route": self._route_label(), "api": self.api,
            "stream": self.stream,
            "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "cached_tokens": usage.cached_tokens, "ttft_ms": ttft_ms, "latency_ms": (now - self.started) * 1000,
            "status": status, "error_type": error, "started_at": self.started_at, "finished_at": utcnow(),
        }
        self.gw.ledger.record(record)
        self.gw.canary.observe(self.decision, status, ttft_ms, record["latency_ms"], usage.completion_tokens)
        if self.shadow is not None:
            self._compare(status, usage, ttft_ms, record["latency_ms"])
        if self.reservation is not None:
            self.gw.spawn(self.gw.quotas.settle(self.reservation, usage.prompt_tokens + usage.completion_tokens))
        metrics = self.gw.metrics
        metrics.requests.labels(tenant, self.model, backend, status).inc()
        metrics.e2e.labels(self.model).observe(now - self.started)
        for kind in ("prompt", "completion", "cached"):
            metrics.tokens.labels(tenant, self.model, kind).inc(getattr(usage, f"{kind}_tokens"))
        extra = {k: record[k] for k in ("request_id", "tenant", "model", "status", "error_type", "prompt_tokens",
                                         "completion_tokens", "ttft_ms", "latency_ms")}
        extra["route"] = self.decision.header(self.backend)  # which version and backend, and why
        if self.gw.settings.log_prompts:
            extra["prompt"] = self.greq.prompt or self.greq.messages
        log.info("request finished", extra=extra)
