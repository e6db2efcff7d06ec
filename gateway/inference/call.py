"""One inference request's life, the same for every API surface and free of HTTP:

quota reservation -> a backend slot (bounded queue) -> the backend's stream, timed -> one
`Outcome`. A decision gives several backends in order: when one fails before its first event
with an error another target may not share (`BackendError.retryable`), the next is tried; after
the first event a failure reaches the client as an error, never as a silent truncation. Each
attempt is told to its target's circuit breaker when it ends, so a failing target leaves the
rotation at once, not when a long request that failed over finishes.

The completion tokens of an outcome are what the client was sent, whatever the backend reports:
token ids where the backend gives them, else at least one token per streamed piece; the
backend's own usage counts only when it is higher. A request that ended without the backend's
usage (client gone, backend died) keeps what it sent, for the gateway to have its backend count
the prompt and the text. A request refused or failed before any answer, or one whose client left
before it reached a backend, uses nothing and bills nothing.

A request for a LoRA adapter makes sure each backend it tries has it, loading it where the
backend's capabilities do not list it (timed); a backend that cannot serve adapters is passed
over, and when none is left the request is refused saying why.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import datetime

from backends.base import (
    MAX_TOKENS,
    Backend,
    BackendError,
    BackendTimeout,
    Capabilities,
    ContextTooLong,
    Delta,
    Event,
    Finish,
    GenerateRequest,
    InvalidRequest,
    Price,
    UpstreamError,
    Usage,
    completion_limit,
    prompt_text_bytes,
)
from backends.timing import StreamTimer
from gateway.errors import GatewayError
from gateway.inference.fleet import Fleet
from gateway.inference.routing import Decision
from gateway.operations.telemetry import GatewayMetrics
from gateway.operations.tracing import OFF, RequestTrace, ended, first_token
from gateway.settings import Settings
from gateway.tables import dollars, utcnow
from gateway.tenancy.auth import Principal
from gateway.tenancy.quotas import LIMIT_NAMES, QuotaExceeded, QuotaStore, QuotaStoreDown, Reservation

log = logging.getLogger("servegate.requests")
UNKNOWN_CONTEXT = 131_072  # tokens; settled back to actual use when the request ends
BYTES_PER_TOKEN = 4  # text without token ids, when nobody can tokenize it: English BPE averages ~4
PRECHECK_BYTES = 64 * 1024  # a prompt this large is checked against quotas before it is counted


@dataclass(frozen=True)
class Shared:
    """What every call uses of its gateway: the fleet (each target's queue and breaker), the
    quotas, the metrics and the timeouts, and where a billed call's first checkpoint goes."""

    fleet: Fleet
    quotas: QuotaStore
    metrics: GatewayMetrics
    settings: Settings
    # Takes a billed call's checkpoint the moment it holds a reservation, before the call goes on:
    # a process that dies at any point after bills the call and releases what it reserved.
    reserved: Callable[[Outcome], None]


@dataclass(frozen=True)
class Outcome:
    """How one request ended: the single event the gateway hands to ledger, quotas, metrics,
    canary and shadow comparison."""

    request: GenerateRequest  # as sent to the backend
    principal: Principal
    decision: Decision
    api: str
    stream: bool
    status: str  # ok | error | cancelled | interrupted (its process died: billed at its last checkpoint)
    error: str | None
    usage: Usage
    backend: str  # the target that answered or failed last; "" if none was reached
    tried: tuple[str, ...]
    ttft_ms: float | None
    latency_ms: float
    started_at: datetime
    finished_at: datetime
    reservation: Reservation | None
    price: Price | None = None  # of the model that answered; None: unpriced (free)
    text: str = ""  # choice 0's text, kept when a shadow compares
    # What a request that ended without the backend's usage sent, for the gateway to have its
    # backend count the prompt and tokenize the text sent without token ids; `usage` holds
    # estimates until then.
    recount: Received | None = None
    adapter_load_ms: float = 0.0  # spent loading the request's LoRA adapter onto backends

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def cost(self) -> int:
        """Nano-dollars, at the price of the model that answered."""
        u = self.usage
        return self.price.cost(u.prompt_tokens, u.completion_tokens, u.cached_tokens) if self.price else 0

    @property
    def route(self) -> str:
        """Where it went and why (the `x-servegate-route` header, the log's `route`)."""
        return self.decision.header(self.backend)


@dataclass
class Received:
    """What the client was sent: token ids where given, else pieces of text."""

    token_ids: int = 0
    pieces: int = 0  # pieces of text without token ids
    texts: dict[int, list[str]] = field(default_factory=dict)  # their text, per choice

    def add(self, delta: Delta) -> None:
        if delta.token_ids:
            self.token_ids += len(delta.token_ids)
        elif delta.text:
            self.pieces += 1
            self.texts.setdefault(delta.index, []).append(delta.text)

    @property
    def lower_bound(self) -> int:
        """Tokens the client surely received: one per id, at least one per piece."""
        return self.token_ids + self.pieces

    def estimate(self) -> int:
        text_bytes = sum(len(piece.encode()) for pieces in self.texts.values() for piece in pieces)
        return self.counted(math.ceil(text_bytes / BYTES_PER_TOKEN))

    def counted(self, text_tokens: int) -> int:
        """Completion tokens once the text without ids is counted: never below one per piece."""
        return self.token_ids + max(self.pieces, text_tokens)

    def choice_texts(self) -> list[str]:
        return ["".join(pieces) for pieces in self.texts.values()]


class Call:
    """One request's run on its decision's backends, as an `async with` block: opened inside it
    (`open`: the first event, or the error that refuses it) and read (`rest`); the block's end
    closes the stream where it stands, which fixes the outcome (`Gateway.call` then settles it)."""

    def __init__(self, shared: Shared, principal: Principal, decision: Decision, request: GenerateRequest, api: str,
                 stream: bool, *, billed: bool = True, keep_text: bool = False, trace: RequestTrace = OFF) -> None:
        """`billed`: reserves quota and feeds the metrics (a shadow's mirrored call is not);
        `keep_text`: choice 0's text goes into the outcome; `trace`: the request's spans."""
        self.shared, self.principal, self.decision, self.request = shared, principal, decision, request
        self.api, self.stream, self.billed, self.keep_text, self.trace = api, stream, billed, keep_text, trace
        self.started, self.started_at = time.monotonic(), utcnow()
        self.prompt_tokens = 0  # the gateway's own count: exact, or an upper bound
        self.completion_bound = MAX_TOKENS  # the most completion tokens the request may bill
        self.reservation: Reservation | None = None
        self.price: Price | None = None
        self.backend: Backend | None = None
        self.tried: list[str] = []
        self.first_token_at: float | None = None
        self.answered = False  # a backend sent its first event: no failover after it
        self.received = Received()
        self.text: list[str] = []
        self.adapter_load_s = 0.0
        self.outcome: Outcome | None = None  # set once the request has ended
        self._events: AsyncGenerator[Event, None] | None = None

    async def open(self) -> Event:
        """Reserve, start, and wait for the first event: errors raise here, before a client is
        sent anything."""
        if self.billed:
            with self.trace.step("gateway.quota"):
                await self._reserve()
        self._events = self._stream()
        return await anext(self._events)

    def rest(self) -> AsyncIterator[Event]:
        """The events after the first, up to the `Finish` (whose usage is the one billed)."""
        return self._events

    async def __aenter__(self) -> Call:
        return self

    async def __aexit__(self, *_) -> None:
        """A call left before its end is `cancelled`; one never opened has no outcome."""
        if self._events is not None:
            await self._events.aclose()

    # -- before forwarding ------------------------------------------------------------------
    async def _reserve(self) -> None:
        backend = self.decision.candidates[0]
        capabilities = await backend.capabilities()
        context, n = capabilities.max_context, self.request.n
        scopes = self.principal.quota_scopes(self.decision.adapter)
        self.price = price = self._price(capabilities)
        at_least = backend.min_prompt_tokens(self.request)
        if context and at_least > context:
            raise ContextTooLong(f"This prompt holds at least {at_least} tokens, more than the model's context of "
                                 f"{context} tokens.", param="messages" if self.request.messages else "prompt")
        tokens, cost = at_least + (self.request.max_tokens or 1) * n, 0
        try:
            if prompt_text_bytes(self.request) > PRECHECK_BYTES:  # refused before the count, where counting takes time
                cost = price.cost(at_least, (self.request.max_tokens or 1) * n) if price else 0
                await self.shared.quotas.check(scopes, tokens, cost)
            if tokenized := await backend.tokenize_prompt(self.request):  # run as counted, not tokenized again
                self.request = dataclasses.replace(self.request, tokenized=tokenized)
                counted = len(tokenized.ids)
            else:
                counted = await backend.count_prompt_tokens(self.request)
            self.prompt_tokens = min(counted, context or MAX_TOKENS)
            completion = completion_limit(self.request.max_tokens, context or UNKNOWN_CONTEXT, self.prompt_tokens)
            self.completion_bound = completion * n
            tokens = self.prompt_tokens + self.completion_bound
            cost = price.cost(self.prompt_tokens, self.completion_bound) if price else 0
            self.reservation = await self.shared.quotas.reserve(scopes, tokens, cost)
        except QuotaExceeded as exc:
            self.shared.metrics.quota_rejections.labels(self.principal.tenant.name, exc.limit).inc()
            raise refusal(exc, tokens, cost) from None
        except QuotaStoreDown as exc:
            raise GatewayError(503, f"{exc}; quotas cannot be checked, and this gateway refuses requests meanwhile "
                               "(SERVEGATE_QUOTA_REDIS_DOWN=closed).", "service_unavailable",
                               code="quota_store_unavailable", headers={"Retry-After": "1"}) from None

    async def _load_adapter(self, backend: Backend, span) -> None:
        """The request's adapter made servable on `backend` where its capabilities do not list it
        (the backend may have dropped it since the fleet last polled), by one request at a time:
        the others wait for its load rather than load it again. The time it takes is the request's,
        counted in its outcome, its span and a histogram."""
        adapter = self.decision.adapter.adapter
        started = time.monotonic()
        member = self.shared.fleet[backend.name]
        async with member.adapter_loads.setdefault(adapter.name, asyncio.Lock()):
            missing = adapter.name not in (await backend.capabilities()).adapters
            if missing:
                await backend.load_adapter(adapter)
                member.loaded_adapters[adapter.name] = adapter
        took = time.monotonic() - started  # a wait for another request's load is this one's too
        self.adapter_load_s += took
        span.set_attribute("servegate.adapter.load_s", took)
        if missing:
            self.shared.metrics.adapter_loads.labels(backend.name).observe(took)

    def _price(self, capabilities: Capabilities) -> Price | None:
        return self.shared.settings.price(self.decision.model, capabilities.price, self.api)

    # -- the stream ---------------------------------------------------------------------
    async def _stream(self) -> AsyncGenerator[Event, None]:
        """The first candidate's events, each within the idle timeout and all within the request
        timeout (the route's `timeout_s` where it sets one), counted as they pass; the next
        candidate's when one fails before answering. One generator for all of it: every streamed
        piece pays for each layer it passes."""
        settings, metrics, fleet = self.shared.settings, self.shared.metrics, self.shared.fleet
        model, candidates = self.decision.model, self.decision.candidates
        timeout = self.decision.timeout_s or settings.request_timeout_s
        loop = asyncio.get_running_loop()
        timer = StreamTimer(settings.idle_timeout_s, self.started - time.monotonic() + loop.time() + timeout)
        itl, last, finish = metrics.itl.labels(model), 0.0, None
        status, error = "cancelled", None
        passed_over: list[str] = []  # backends that cannot serve the request's adapter, and why
        try:
            if self.reservation is not None:  # its first checkpoint, where a failure to write it still settles the call
                self.shared.reserved(self.checkpoint())
            for number, backend in enumerate(candidates, 1):
                self.backend = backend
                if self.billed and number > 1:  # the first candidate's price was read when reserving
                    self.price = self._price(await backend.capabilities())
                span, headers = self.trace.backend_call(self.request, backend.name)
                usage, reasons, failure = None, (), None
                try:
                    request = backend.admit_extras(self.request)  # nothing undeclared goes upstream
                    if headers:
                        request = dataclasses.replace(request, trace_headers=headers)
                    async with fleet.attempt(backend.name, request.tenant):
                        self.tried.append(backend.name)
                        if self.billed:
                            metrics.overhead.observe(time.monotonic() - self.started)
                        if self.decision.adapter is not None:
                            try:
                                await self._load_adapter(backend, span)
                            except InvalidRequest as exc:
                                failure = exc.code
                                passed_over.append(f"{backend.name}: {exc.message}")
                                if number == len(candidates):
                                    raise InvalidRequest(f"no backend of {model!r} can serve the adapter "
                                                         f"{self.decision.adapter.name!r}: {'; '.join(passed_over)}",
                                                         param="model") from None
                                continue
                        if self.billed:
                            metrics.in_flight.labels(backend.name).inc()
                        events = backend.generate(request)
                        try:
                            while True:
                                try:
                                    event = await timer.next(events)
                                except StopAsyncIteration:
                                    raise UpstreamError(f"{backend.name}: the stream ended without finishing") from None
                                except TimeoutError:
                                    raise BackendTimeout(f"the backend sent nothing for {settings.idle_timeout_s:g} "
                                                         f"s, or the request outlived {timeout:g} s") from None
                                self.answered = True
                                if isinstance(event, Finish):
                                    finish, usage, reasons = event, event.usage, event.finish_reasons
                                    break
                                self.received.add(event)
                                if self.keep_text and event.index == 0:
                                    self.text.append(event.text)
                                if event.text or event.token_ids:
                                    now = time.monotonic()
                                    if self.first_token_at is None:
                                        self.first_token_at = now
                                        first_token(span, now - self.started)
                                        if self.billed:
                                            metrics.ttft.labels(model).observe(now - self.started)
                                    elif self.billed:
                                        itl.observe(now - last)
                                    last = now
                                yield event
                        finally:
                            await events.aclose()
                            if self.billed:
                                metrics.in_flight.labels(backend.name).dec()
                    break  # the target's slot is free and its breaker told before the client sees the end
                except BackendError as exc:
                    failure = exc.code
                    if self.answered or not exc.retryable or number == len(candidates):
                        raise
                    log.warning("backend %s failed before answering (%s); trying %s", backend.name, exc.code,
                                candidates[number].name, extra={"request_id": self.request.request_id})
                finally:
                    ended(span, usage, reasons, failure)
            self.outcome = self._outcome("ok", None, finish.usage)
            yield dataclasses.replace(finish, usage=self.outcome.usage)
        except BackendError as exc:
            status, error = "error", exc.code
            raise
        except Exception:
            status, error = "error", "internal"
            raise
        finally:
            timer.cancel()
            if self.outcome is None:
                self.outcome = self._outcome(status, error, None)

    # -- after ------------------------------------------------------------------------------
    def checkpoint(self) -> Outcome | None:
        """What the request has used so far (what it was sent, streamed or not), billed as
        `interrupted` should this process die before it ends; None while it holds no reservation,
        or once it has ended."""
        if self.reservation is None or self.outcome is not None:
            return None
        return self._outcome("interrupted", "process_died", None)

    def _outcome(self, status: str, error: str | None, reported: Usage | None) -> Outcome:
        received, recount = self.received, None
        if reported is not None:  # the backend's own count where it says more than the client got
            counted = self.prompt_tokens if self.billed else MAX_TOKENS  # an unbilled call counted nothing
            prompt = self._reported("prompt_tokens", reported.prompt_tokens, counted) or self.prompt_tokens
            completion = self._reported("completion_tokens", reported.completion_tokens, self.completion_bound)
            if completion is None:
                completion = received.estimate()
            # never more cached than the prompt held: cached tokens priced below input ones would bill less than nothing
            cached = self._reported("cached_tokens", reported.cached_tokens, prompt) or 0
            usage = Usage(prompt, max(completion, received.lower_bound), cached)
        elif not self.answered and (status in ("error", "interrupted") or not self.tried):
            usage = Usage(0, 0)  # refused or failed before any answer, or gone before reaching a backend
        else:
            usage = Usage(self.prompt_tokens, received.estimate())
            recount = received
        return Outcome(
            request=self.request, principal=self.principal, decision=self.decision, api=self.api,
            stream=self.stream, status=status, error=error, usage=usage,
            backend=self.backend.name if self.backend else "", tried=tuple(self.tried),
            ttft_ms=None if self.first_token_at is None else (self.first_token_at - self.started) * 1000,
            latency_ms=(time.monotonic() - self.started) * 1000, started_at=self.started_at, finished_at=utcnow(),
            reservation=self.reservation, price=self.price, text="".join(self.text), recount=recount,
            adapter_load_ms=self.adapter_load_s * 1000)


    def _reported(self, field: str, value: object, bound: int) -> int | None:
        """A token count as the backend reported it, if it is a whole number in [0, bound] (`bound`:
        what the request could use, by the gateway's own count). A count out of range is logged with
        the backend's name and gives None: the gateway's own count is billed instead."""
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= bound:
            return value
        if value is not None:
            log.warning("backend %s reported usage.%s = %.40r, outside [0, %d]; billed the gateway's own count",
                        self.backend.name if self.backend else "?", field, value, bound,
                        extra={"request_id": self.request.request_id})
        return None


def refusal(exc: QuotaExceeded, tokens: int, cost: int) -> GatewayError:
    """A quota's refusal of a request that would reserve `tokens` and `cost`, in OpenAI's words: a
    request larger than the limit itself is the client's to change (400), else a 429 to retry."""
    if exc.budget and cost > exc.value:
        return GatewayError(400, f"This request could cost up to {dollars(cost)} (prompt + max_tokens), more "
                            f"than {exc.scope}'s {LIMIT_NAMES[exc.limit]} of {dollars(exc.value)}; lower "
                            "max_tokens.", "invalid_request_error", code="budget_exceeded", param="max_tokens")
    if exc.budget:  # OpenAI's words for a spent balance
        return GatewayError(429, exc.message, "insufficient_quota", code="insufficient_quota",
                            headers={"Retry-After": str(int(exc.retry_after))})
    if exc.limit in ("tpm", "tokens_per_day") and tokens > exc.value:
        return GatewayError(400, f"This request reserves {tokens} tokens (prompt + max_tokens), more than "
                            f"{exc.scope}'s limit of {exc.value} {exc.limit}; lower max_tokens.",
                            "invalid_request_error", code="rate_limit_exceeded", param="max_tokens")
    kind = "tokens" if exc.limit in ("tpm", "tokens_per_day") else "requests"
    return GatewayError(429, exc.message, kind, code="rate_limit_exceeded",
                        headers={"Retry-After": str(int(exc.retry_after))})
