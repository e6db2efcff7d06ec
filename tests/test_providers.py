"""litellm providers as a backend: real litellm against local OpenAI-compatible servers (the
instant stub, and one answering each error status), and a refused connection."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from advisor.measure import stub
from backends.base import (
    ContextTooLong,
    InvalidRequest,
    Overloaded,
    Unavailable,
)
from backends.providers import ProviderBackend, ProviderConfig

from .conftest import ADMIN_KEY, AUTH, free_port, gateway_app, generated, serve_app, usage_records, wait_ready

pytestmark = pytest.mark.slow

ERRORS = {  # prompt -> (status, message)
    "too long": (400, "This model's maximum context length is 4096 tokens. However, you requested 9000 tokens."),
    "bad": (400, "top_p must be in (0, 1], got 1.5."),
    "busy": (429, "Too many requests"),
    "down": (503, "The server is overloaded or not ready yet."),
}


async def failing(scope, receive, send):
    """Answers each prompt of ERRORS with its status and an OpenAI-shaped error."""
    body = await stub.read_body(receive)
    prompt = json.loads(body)["messages"][-1]["content"]
    status, text = ERRORS[prompt]
    payload = json.dumps({"error": {"message": text, "type": "invalid_request_error", "param": None, "code": status}})
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": payload.encode()})


@pytest.fixture(scope="module")
def upstreams():
    with serve_app(stub.app) as good, serve_app(failing) as bad:
        yield good, bad


def provider(base: str) -> ProviderBackend:
    return ProviderBackend(ProviderConfig(model=f"openai/{stub.MODEL}", api_base=f"{base}/v1", api_key="sk-local",
                                          max_context=4096), name="litellm")


def test_a_provider_streams_with_usage_and_its_errors_are_typed(upstreams):
    good, bad = upstreams

    async def scenario():
        ok = provider(good)
        await ok.start()
        text, finish = await generated(ok, prompt="hello", max_tokens=8)
        failing_provider, refused = provider(bad), provider(f"http://127.0.0.1:{free_port()}")
        failing_provider.litellm = refused.litellm = ok.litellm
        errors = {}
        for prompt in ERRORS:
            with pytest.raises(Exception) as raised:
                await generated(failing_provider, prompt=prompt, max_tokens=8)
            errors[prompt] = type(raised.value)
        with pytest.raises(Exception) as unreachable:
            await generated(refused, prompt="hello", max_tokens=8)
        return text, finish, errors, type(unreachable.value)

    text, finish, errors, unreachable = asyncio.run(scenario())
    assert text == "".join(f" tok{i}" for i in range(stub.CHUNKS)) and finish.usage.completion_tokens == 8
    assert errors == {"too long": ContextTooLong, "bad": InvalidRequest, "busy": Overloaded, "down": Unavailable}
    assert unreachable is Unavailable  # litellm says InternalServerError; the cause says refused


def test_a_provider_behind_the_gateway(upstreams, tmp_path):
    good, _ = upstreams
    with serve_app(gateway_app({"cloud": provider(good)}, tmp_path)) as url:
        wait_ready(url)  # litellm imports in the background, off the event loop
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=ADMIN_KEY, max_retries=0)
        reply = client.chat.completions.create(model="cloud", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content.startswith(" tok0") and reply.usage.completion_tokens == 8


def test_a_provider_is_billed_at_litellms_list_price(upstreams, tmp_path):
    """gpt-4o-mini in litellm's bundled cost map: $0.15 per million input tokens, $0.60 output; the
    stub reports 12 prompt and 8 completion tokens: 12 * 0.15 + 8 * 0.60 = 6.6 micro-dollars."""
    good, _ = upstreams
    backend = ProviderBackend(ProviderConfig(model="openai/gpt-4o-mini", api_base=f"{good}/v1", api_key="sk-local",
                                             max_context=4096), name="litellm")
    with serve_app(gateway_app({"mini": backend}, tmp_path)) as url:
        wait_ready(url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=ADMIN_KEY, max_retries=0)
        client.chat.completions.create(model="mini", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
        (record,) = usage_records(url, "default")
        assert (record["prompt_tokens"], record["completion_tokens"], record["cost_nano_usd"]) == (12, 8, 6600)
        totals = httpx.get(f"{url}/admin/usage", headers=AUTH).json()["totals"]
        assert totals["cost_usd"] == "0.0000066"
        assert 'servegate_spend_usd_total{model="mini",tenant="default"} 6.6e-06' in httpx.get(f"{url}/metrics").text
