"""OpenTelemetry traces of requests, in the GenAI semantic conventions; off by default.

A request's trace: the server span (`TraceRequests`, continuing a client's `traceparent`), with
children `gateway.auth`, `gateway.route` (the decision), `gateway.quota` (the reservation), one
client span per backend attempt named `{gen_ai.operation.name} {gen_ai.request.model}` (its
context goes upstream as W3C `traceparent`; an event marks the first token, with the TTFT), and
`gateway.settle`, where the outcome goes to the ledger, quotas and metrics (the stream's end,
with the usage). With tracing off, every request carries `OFF`, whose methods do nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from backends.base import GenerateRequest, Usage

TRACER_NAME = "servegate"


class RequestTrace:
    """One request's spans, all children of its server span."""

    def __init__(self, tracer: trace.Tracer | None, root: trace.Span | None) -> None:
        self.tracer, self.root = tracer, root

    @property
    def on(self) -> bool:
        return self.root is not None

    @contextlib.contextmanager
    def step(self, name: str, **attributes) -> Iterator[trace.Span]:
        """A child span around a gateway step; an exception marks it failed."""
        if not self.on:
            yield trace.INVALID_SPAN
            return
        span = self.tracer.start_span(name, context=trace.set_span_in_context(self.root), attributes=attributes)
        try:
            yield span
        except BaseException as exc:
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            span.end()

    def backend_call(self, request: GenerateRequest, backend: str) -> tuple[trace.Span, dict[str, str]]:
        """The client span of one attempt, and the headers that carry its context upstream."""
        if not self.on:
            return trace.INVALID_SPAN, {}
        operation = "chat" if request.messages is not None else "text_completion"
        attributes = {"gen_ai.operation.name": operation, "gen_ai.request.model": request.model or "",
                      "servegate.backend": backend,
                      "gen_ai.request.temperature": request.temperature, "gen_ai.request.top_p": request.top_p,
                      "gen_ai.request.choice.count": request.n}
        if request.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = request.max_tokens
        if request.seed is not None:
            attributes["gen_ai.request.seed"] = request.seed
        span = self.tracer.start_span(f"{operation} {request.model}", context=trace.set_span_in_context(self.root),
                                      kind=SpanKind.CLIENT, attributes=attributes)
        headers: dict[str, str] = {}
        propagate.inject(headers, context=trace.set_span_in_context(span))
        return span, headers

    def end(self, status: int) -> None:
        if self.on:
            self.root.set_attribute("http.response.status_code", status)
            if status >= 500:
                self.root.set_status(Status(StatusCode.ERROR))
            self.root.end()


OFF = RequestTrace(None, None)


def first_token(span: trace.Span, ttft_s: float) -> None:
    span.add_event("gen_ai.first_token", {"gen_ai.server.time_to_first_token": ttft_s})


def ended(span: trace.Span, usage: Usage | None, finish_reasons: tuple[str, ...], error: str | None) -> None:
    """An attempt's end: its usage and finish reasons, or its error."""
    if usage is not None:
        span.set_attribute("gen_ai.usage.input_tokens", usage.prompt_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", usage.completion_tokens)
    if finish_reasons:
        span.set_attribute("gen_ai.response.finish_reasons", list(finish_reasons))
    if error is not None:
        span.set_attribute("error.type", error)
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


class TraceRequests:
    """ASGI middleware: each HTTP request's server span, continuing the caller's trace, and its
    `RequestTrace` in `request.state.trace` for the steps below."""

    def __init__(self, app, tracer: trace.Tracer) -> None:
        self.app, self.tracer = app, tracer

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        parent = propagate.extract(carrier, context=otel_context.Context())
        root = self.tracer.start_span(f"{scope['method']} {scope['path']}", context=parent, kind=SpanKind.SERVER,
                                      attributes={"http.request.method": scope["method"], "url.path": scope["path"]},
                                      start_time=time.time_ns())
        request_trace = RequestTrace(self.tracer, root)
        scope.setdefault("state", {})["trace"] = request_trace
        status = 500

        async def traced_send(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, traced_send)
        finally:
            request_trace.end(status)


def decided(decision) -> dict:
    """A routing decision as span attributes."""
    attributes = {"gen_ai.request.model": decision.model, "servegate.route.variant": decision.variant,
                  "servegate.route.reason": decision.reason,
                  "servegate.route.candidates": [b.name for b in decision.candidates]}
    if decision.alias is not None:
        attributes |= {"servegate.route.alias": decision.alias, "servegate.route.version": decision.version}
    if decision.adapter is not None:
        attributes["servegate.adapter"] = decision.adapter.name
    return attributes


def request_trace(request) -> RequestTrace:
    """The request's trace (`OFF` where tracing is off)."""
    return getattr(request.state, "trace", OFF)


def otlp_provider(endpoint: str) -> trace.TracerProvider:
    """Spans batched to an OTLP/HTTP collector (the `otel` extra: opentelemetry-sdk and its exporter)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "servegate"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider
