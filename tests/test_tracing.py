"""OpenTelemetry traces: one request's spans in the GenAI conventions, the trace reaching the
upstream as `traceparent`, a caller's trace continued, and nothing at all when tracing is off."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from advisor.measure import stub
from backends.openai_compat import OpenAICompatBackend, OpenAICompatConfig

from .conftest import ADMIN_KEY, AUTH, gateway_app, serve_app

pytestmark = pytest.mark.slow

STEPS = ["gateway.auth", "gateway.route", "gateway.quota", "chat m", "gateway.settle"]


def recording_upstream(seen: list[dict]):
    """The bench stub, remembering each POST's headers."""

    async def app(scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            seen.append({k.decode(): v.decode() for k, v in scope["headers"]})
        await stub.app(scope, receive, send)

    return app


def finished(exporter, root_name: str, count: int = 1, timeout: float = 5.0) -> list:
    """The spans once `count` server spans named `root_name` ended (after the response's last byte)."""
    deadline = time.monotonic() + timeout
    while sum(s.name == root_name for s in exporter.get_finished_spans()) < count:
        assert time.monotonic() < deadline, [s.name for s in exporter.get_finished_spans()]
        time.sleep(0.02)
    return list(exporter.get_finished_spans())


@pytest.fixture
def traced(tmp_path):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter, provider, seen = InMemorySpanExporter(), TracerProvider(), []
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with serve_app(recording_upstream(seen)) as upstream:
        backend = OpenAICompatBackend(OpenAICompatConfig(base_url=upstream, model=stub.MODEL), name="up")
        with serve_app(gateway_app({"m": backend}, tmp_path, tracer_provider=provider)) as url:
            yield url, exporter, seen


def test_a_request_yields_the_gateway_spans_and_its_trace_reaches_the_upstream(traced):
    from opentelemetry.trace import SpanKind

    url, exporter, seen = traced
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=ADMIN_KEY, max_retries=0)
    chunks = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=8, temperature=0.5, stream=True,
                                                 stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    spans = finished(exporter, "POST /v1/chat/completions")
    root = next(s for s in spans if s.name == "POST /v1/chat/completions")
    by_name = {s.name: s for s in spans if s.context.trace_id == root.context.trace_id}
    assert set(STEPS) <= set(by_name), sorted(by_name)
    assert root.kind == SpanKind.SERVER and root.attributes["http.response.status_code"] == 200
    for name in STEPS:  # children of the request's span, in the order the request met them
        assert by_name[name].parent.span_id == root.context.span_id
    starts = [by_name[name].start_time for name in STEPS]
    assert starts == sorted(starts)

    call = by_name["chat m"]
    assert call.kind == SpanKind.CLIENT
    assert call.attributes["gen_ai.operation.name"] == "chat"
    assert call.attributes["gen_ai.request.model"] == "m"
    assert call.attributes["gen_ai.request.max_tokens"] == 8
    assert call.attributes["gen_ai.request.temperature"] == 0.5
    assert call.attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert call.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert tuple(call.attributes["gen_ai.response.finish_reasons"]) == ("length",)
    first = [e for e in call.events if e.name == "gen_ai.first_token"]
    assert len(first) == 1 and 0 < first[0].attributes["gen_ai.server.time_to_first_token"] < 5
    assert by_name["gateway.route"].attributes["servegate.route.candidates"] == ("up",)
    assert by_name["gateway.settle"].attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens

    # the upstream was asked within the same trace, as a child of the backend call's span
    version, trace_id, parent, flags = seen[-1]["traceparent"].split("-")
    assert (version, trace_id, parent) == ("00", f"{root.context.trace_id:032x}", f"{call.context.span_id:016x}")
    assert int(flags, 16) & 1  # sampled


def test_a_callers_trace_is_continued_and_refusals_are_traced(traced):
    url, exporter, _ = traced
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    answer = httpx.post(f"{url}/v1/completions", headers={**AUTH, "traceparent": f"00-{trace_id}-{parent}-01"},
                        json={"model": "m", "prompt": "hi", "max_tokens": 4}, timeout=30)
    assert answer.status_code == 200
    root = next(s for s in finished(exporter, "POST /v1/completions") if s.name == "POST /v1/completions")
    assert f"{root.context.trace_id:032x}" == trace_id and f"{root.parent.span_id:016x}" == parent

    refused = httpx.post(f"{url}/v1/completions", headers={"Authorization": "Bearer sk-nope"},
                         json={"model": "m", "prompt": "hi"}, timeout=30)
    assert refused.status_code == 401
    spans = finished(exporter, "POST /v1/completions", count=2)
    auth = [s for s in spans if s.name == "gateway.auth" and not s.status.is_ok]
    assert len(auth) == 1 and auth[0].status.description == "GatewayError"


def test_tracing_is_off_by_default(tmp_path):
    from gateway.operations.tracing import TraceRequests

    seen: list[dict] = []
    with serve_app(recording_upstream(seen)) as upstream:
        backend = OpenAICompatBackend(OpenAICompatConfig(base_url=upstream, model=stub.MODEL), name="up")
        app = gateway_app({"m": backend}, tmp_path)
        assert not any(m.cls is TraceRequests for m in app.user_middleware)
        with serve_app(app) as url:
            answer = httpx.post(f"{url}/v1/completions", headers=AUTH,
                                json={"model": "m", "prompt": "hi", "max_tokens": 4}, timeout=30)
    assert answer.status_code == 200 and seen and "traceparent" not in seen[-1]
