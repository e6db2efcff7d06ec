"""The gateway in front of an OpenAI-compatible upstream, through the generic adapter."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from advisor.measure import stub
from backends.base import (
    ContextTooLong,
    Delta,
    GenerateRequest,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    UpstreamError,
)
from backends.openai_compat import OpenAICompatBackend, OpenAICompatConfig, error_from_status

from .conftest import ADMIN_KEY, AUTH, free_port, gateway_app, openai_upstream, serve_app


def quirky_pieces(path: str) -> list[bytes]:
    """TGI-style framing (`data:` without a space), no `[DONE]`, and, on `/v1/completions`, an
    error event after the first chunk."""
    pieces = [p.replace(b"data: ", b"data:") for p in stub.STREAM[:-1]]
    if path == "/v1/completions":
        pieces = pieces[:1] + [b'data:{"error":{"message":"the engine died","code":500}}\n\n']
    return pieces


TOOL_CHUNKS = [
    {"index": 0, "delta": {"role": "assistant", "tool_calls": [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]},
     "logprobs": {"content": [{"token": "a", "logprob": -0.5, "top_logprobs": []}]}},
    {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
     "logprobs": {"content": [{"token": "b", "logprob": -0.25, "top_logprobs": []}]}},
    {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}},
    {"index": 0, "delta": {}, "finish_reason": "tool_calls"},
]


def tool_pieces(path: str) -> list[bytes]:
    """A tool call and logprobs, in pieces, as vLLM streams them."""
    chunks = [{"id": "x", "object": "chat.completion.chunk", "created": 0, "model": stub.MODEL, "choices": [c]}
              for c in TOOL_CHUNKS]
    return [f"data: {json.dumps(c)}\n\n".encode() for c in chunks] + [b"data: [DONE]\n\n"]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    with serve_app(stub.app) as plain, serve_app(openai_upstream(quirky_pieces)) as odd, \
            serve_app(openai_upstream(tool_pieces)) as tooling:
        backends = {
            "stub": OpenAICompatBackend(OpenAICompatConfig(base_url=plain, model=stub.MODEL), name="stub"),
            "quirky": OpenAICompatBackend(OpenAICompatConfig(base_url=odd, model=stub.MODEL), name="quirky"),
            "tools": OpenAICompatBackend(OpenAICompatConfig(base_url=tooling, model=stub.MODEL), name="tools"),
            "gone": OpenAICompatBackend(OpenAICompatConfig(base_url=f"http://127.0.0.1:{free_port()}",
                                                           model="gone", max_context=4096), name="gone"),
        }
        with serve_app(gateway_app(backends, tmp_path_factory.mktemp("compat"))) as url:
            yield url


@pytest.mark.slow
def test_streaming_and_not_through_the_adapter(gateway):
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=ADMIN_KEY, max_retries=0)
    want = "".join(f" tok{i}" for i in range(stub.CHUNKS))
    full = client.chat.completions.create(model="stub", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    assert full.choices[0].message.content == want and full.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(model="stub", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=8, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.prompt_tokens == 12
    quirky = client.chat.completions.create(model="quirky", messages=[{"role": "user", "content": "hi"}])
    assert quirky.choices[0].message.content == want  # `data:` framing, no [DONE]


@pytest.mark.slow
def test_tool_calls_and_logprobs_pass_through(gateway):
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=ADMIN_KEY, max_retries=0)
    ask = {"model": "tools", "messages": [{"role": "user", "content": "Weather in Paris?"}], "logprobs": True,
           "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]}
    whole = client.chat.completions.create(**ask)
    (call,) = whole.choices[0].message.tool_calls
    assert (call.id, call.function.name, call.function.arguments) == ("call_1", "get_weather", '{"city": "Paris"}')
    assert whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.content is None
    assert [t.token for t in whole.choices[0].logprobs.content] == ["a", "b"]
    streamed = [c for c in client.chat.completions.create(**ask, stream=True) if c.choices]
    pieces = [c.choices[0].delta.tool_calls[0].function.arguments for c in streamed
              if c.choices[0].delta.tool_calls]
    assert "".join(pieces) == '{"city": "Paris"}' and streamed[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.slow
def test_upstream_failures_map_to_clear_errors(gateway):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    gone = httpx.post(f"{gateway}/v1/chat/completions", headers=AUTH, json=body | {"model": "gone"})
    assert gone.status_code == 503 and gone.json()["error"]["code"] == "unavailable"
    assert "cannot connect" in gone.json()["error"]["message"]
    with httpx.stream("POST", f"{gateway}/v1/completions", headers=AUTH,
                      json={"model": "quirky", "prompt": "hi", "stream": True}) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert response.status_code == 200  # the first chunk was already sent, so the error comes as an event
    assert "the engine died" in json.loads(events[-2])["error"]["message"] and events[-1] == "[DONE]"


def test_error_statuses_map_to_the_taxonomy():
    assert isinstance(error_from_status(400, b'{"error":{"message":"bad top_p"}}'), InvalidRequest)
    too_long = error_from_status(400, b'{"error":{"message":"maximum context length is 4096 tokens"}}')
    assert isinstance(too_long, ContextTooLong)
    assert isinstance(error_from_status(404, b'{"detail":"no"}'), ModelNotFound)
    assert isinstance(error_from_status(503, b"busy"), Overloaded)
    assert isinstance(error_from_status(500, b"oops"), UpstreamError)


@pytest.mark.slow
def test_runtime_profiles_read_health_and_version_from_their_own_routes():
    from backends.base import Health
    from backends.profiles import ProfileBackend

    async def ollama_like(scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/api/version":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b'{"version":"0.12.3"}'})
            return
        if scope["type"] == "http" and scope["path"] == "/health":  # not Ollama's: must not be what is asked
            await send({"type": "http.response.start", "status": 500, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        await stub.app(scope, receive, send)

    async def scenario(url):
        backend = ProfileBackend(OpenAICompatConfig(base_url=url, model=stub.MODEL), "ollama")
        await backend.start()
        try:
            return await backend.health(), await backend.capabilities()
        finally:
            await backend.close()

    with serve_app(ollama_like) as url:
        health, caps = asyncio.run(scenario(url))
    assert health == Health.READY and (caps.runtime, caps.version) == ("ollama", "0.12.3")


@pytest.mark.slow
def test_a_pooled_connection_the_server_dropped_is_retried_on_a_fresh_one():
    """The server answers one request per connection and drops the connection when a second
    request comes on it, as servers that close idle or failed keep-alive connections do."""
    served = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for number in range(2):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next((line.split(b":")[1] for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length")), b"0"))
            await reader.readexactly(length)
            if number == 1:  # a second request on this connection: dropped, unanswered
                writer.close()
                return
            body = b"".join(stub.STREAM)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(body), body))
            await writer.drain()
            served.append(head.split(b" ")[1])

    async def scenario():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        backend = OpenAICompatBackend(OpenAICompatConfig(base_url=f"http://127.0.0.1:{port}", model=stub.MODEL,
                                                         max_context=4096))
        await backend.start()
        texts = []
        try:
            for _ in range(3):
                request = GenerateRequest(request_id="r", model="m", prompt="hi", max_tokens=8)
                texts.append("".join([e.text async for e in backend.generate(request) if isinstance(e, Delta)]))
        finally:
            await backend.close()
            server.close()
        return texts

    texts = asyncio.run(scenario())
    assert texts == ["".join(f" tok{i}" for i in range(stub.CHUNKS))] * 3 and len(served) == 3


@pytest.mark.slow
def test_llama_server_load_comes_from_its_metrics():
    from backends.llamacpp import LlamaCppServerBackend, llama_server_config

    metrics = (b"# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 2\n"
               b"# TYPE llamacpp:requests_deferred gauge\nllamacpp:requests_deferred 5\n"
               b"# TYPE llamacpp:tokens_predicted_total counter\nllamacpp:tokens_predicted_total 1234\n")

    async def llama_server(scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/metrics":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": metrics})
            return
        await stub.app(scope, receive, send)

    async def scenario(url):
        backend = LlamaCppServerBackend(llama_server_config(url, stub.MODEL, max_context=4096))
        await backend.start()
        try:
            return await backend.load()
        finally:
            await backend.close()

    with serve_app(llama_server) as url:
        load = asyncio.run(scenario(url))
    assert (load.running, load.waiting, load.details["tokens_predicted_total"]) == (2, 5, 1234)
