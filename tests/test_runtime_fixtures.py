"""The vLLM, SGLang and llama-server adapters against their wire formats, replayed from
tests/fixtures: vLLM's and llama-server's recorded from the live servers (tests/record_fixtures.py),
SGLang's built from its source (the fixture names the files and release). Set
SERVEGATE_TEST_VLLM_URL / SERVEGATE_TEST_SGLANG_URL (and ..._MODEL) to run the same tests against
a live server."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.base import ContextTooLong, Delta, GenerateRequest, Health, InvalidRequest, Usage
from backends.openai_compat import OpenAICompatConfig, usage_of
from backends.sglang import SGLangBackend
from backends.vllm import VLLMBackend

from .conftest import generated, serve_app
from .replay import replay

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).parent / "fixtures"
ADAPTERS = {"vllm": VLLMBackend, "sglang": SGLangBackend}


@pytest.fixture(params=sorted(ADAPTERS))
def runtime(request):
    name = request.param
    live = os.environ.get(f"SERVEGATE_TEST_{name.upper()}_URL")
    if live:
        yield name, live, os.environ[f"SERVEGATE_TEST_{name.upper()}_MODEL"], None
        return
    (path,) = FIXTURES.glob(f"{name}-*.json")
    fixture = json.loads(path.read_text())
    assert fixture["provenance"] and fixture["version"]  # every fixture says where it comes from
    with serve_app(replay(fixture)) as url:
        yield name, url, fixture["model"], fixture


def test_the_adapter_speaks_the_runtimes_protocol(runtime):
    name, url, model, fixture = runtime

    async def scenario():
        backend = ADAPTERS[name](OpenAICompatConfig(base_url=url, model=model))
        await backend.start()
        try:
            text, finish = await generated(backend, prompt="The primary colors are", max_tokens=6)
            chat, chat_finish = await generated(backend, messages=[{"role": "user", "content": "Colors?"}],
                                                max_tokens=6)
            with pytest.raises(ContextTooLong):
                await generated(backend, prompt="hello " * 5000, max_tokens=6)
            with pytest.raises(InvalidRequest):
                await generated(backend, prompt="hi", top_p=1.5, temperature=1.0, max_tokens=6)
            tokens = await backend.tokenize("Hello world") if name == "vllm" else []
            return (text, finish, chat, chat_finish, await backend.health(), await backend.load(),
                    await backend.capabilities(), tokens)
        finally:
            await backend.close()

    text, finish, chat, chat_finish, health, load, caps, tokens = asyncio.run(scenario())
    assert text and chat and health == Health.READY
    assert finish.usage.completion_tokens >= 1 and chat_finish.usage.prompt_tokens >= 1
    assert caps.runtime == name and caps.max_context > 0
    if fixture is None:
        return
    routes = fixture["routes"]
    # what the adapter says is what the runtime sent: the fixture's own chunks, usage and figures
    assert text == streamed_text(routes["POST /v1/completions"]["sse"])
    assert chat == streamed_text(routes["POST /v1/chat/completions"]["sse"])
    assert finish.usage == usage_of(last_usage(routes["POST /v1/completions"]["sse"]))
    assert finish.finish_reasons == (last_reason(routes["POST /v1/completions"]["sse"]),)
    assert caps.version == fixture["version"]
    assert caps.max_context == routes["GET /v1/models"]["json"]["data"][0]["max_model_len"]
    metrics = {f.name: sum(s.value for s in f.samples) for f in text_string_to_metric_families(
        routes["GET /metrics"]["text"])}
    prefix = "vllm:" if name == "vllm" else "sglang:"
    assert load.running == metrics[f"{prefix}num_requests_running" if name == "vllm" else f"{prefix}num_running_reqs"]
    assert 0 <= load.kv_usage <= 1
    if name == "vllm":
        recorded = routes["POST /tokenize"]["json"]
        assert [t.id for t in tokens] == recorded["tokens"]
        assert "".join(t.text for t in tokens) == routes["POST /tokenize"]["text"]


def streamed_text(events: list[dict]) -> str:
    return "".join(c.get("text") or (c.get("delta") or {}).get("content") or ""
                   for e in events for c in e.get("choices") or ())


def last_usage(events: list[dict]) -> dict:
    return next(e["usage"] for e in reversed(events) if e.get("usage"))


def last_reason(events: list[dict]) -> str:
    return next(c["finish_reason"] for e in reversed(events) for c in e.get("choices") or () if c.get("finish_reason"))


def test_sglang_native_generate_streams_cumulative_text_as_deltas():
    (path,) = FIXTURES.glob("sglang-*.json")
    fixture = json.loads(path.read_text())

    async def scenario(url):
        backend = SGLangBackend(OpenAICompatConfig(base_url=url, model=fixture["model"]), native=True)
        await backend.start()
        try:
            deltas = []
            async for event in backend.generate(GenerateRequest(request_id="r", model="m", prompt="Colors?",
                                                                max_tokens=6)):
                deltas.append(event)
            with pytest.raises(ContextTooLong):
                await generated(backend, prompt="hello " * 5000, max_tokens=6)
            return deltas
        finally:
            await backend.close()

    with serve_app(replay(fixture)) as url:
        events = asyncio.run(scenario(url))
    texts = [e.text for e in events if isinstance(e, Delta)]
    assert texts == [" red", ",", " yellow", " and", " blue", "."]  # pieces, not the growing text
    finish = events[-1]
    assert finish.finish_reasons == ("length",) and finish.usage == Usage(7, 6, 3)


def test_sglang_gets_the_tenants_cache_salt_on_every_route():
    """SGLang 0.5.23 keeps prefixes apart by `cache_salt` (its radix tree keys every child on it:
    `mem_cache/radix_cache.py`, `RadixKey.child_key_at`), which its OpenAI requests and `/generate`
    take (`entrypoints/openai/protocol.py`, `managers/io_struct.py`): the adapter sends the salt the
    gateway set on each route and refuses a client's own."""
    (path,) = FIXTURES.glob("sglang-*.json")
    fixture, seen = json.loads(path.read_text()), []

    async def scenario(url):
        config = OpenAICompatConfig(base_url=url, model=fixture["model"])
        backends = SGLangBackend(config), SGLangBackend(config, native=True)
        for backend in backends:
            await backend.start()
        try:
            for backend in backends:
                await generated(backend, prompt="Colors?", max_tokens=6, cache_salt="tenant-a")
            await generated(backends[0], messages=[{"role": "user", "content": "Colors?"}], max_tokens=6,
                            cache_salt="tenant-a")
            with pytest.raises(InvalidRequest, match="cache_salt"):
                backends[0].admit_extras(GenerateRequest(request_id="r", model="m", prompt="Colors?",
                                                         extra={"cache_salt": "tenant-b"}))
        finally:
            for backend in backends:
                await backend.close()

    with serve_app(replay(fixture, seen)) as url:
        asyncio.run(scenario(url))
    generations = [body for body in seen if {"prompt", "text", "messages"} & set(body)]
    assert len(generations) == 3 and all(body["cache_salt"] == "tenant-a" for body in generations)


def test_llama_server_build_metrics_tokens_and_prompt_cache():
    """llama-server (C++), replayed from what the live server answered (tests/record_fixtures.py):
    version and per-slot context from /props, load from its metrics, token pieces as offsets,
    cache_prompt asked."""
    from backends.llamacpp import LlamaCppServerBackend, llama_server_config

    (path,) = FIXTURES.glob("llama-server-*.json")
    fixture, seen = json.loads(path.read_text()), []
    routes = fixture["routes"]

    async def scenario(url):
        backend = LlamaCppServerBackend(llama_server_config(url, fixture["model"]))
        await backend.start()
        try:
            text, finish = await generated(backend, prompt="The primary colors are", max_tokens=6)
            with pytest.raises(ContextTooLong):
                await generated(backend, prompt="hello " * 5000, max_tokens=6)
            return text, finish, await backend.capabilities(), await backend.load(), await backend.tokenize(
                routes["POST /tokenize"]["text"])
        finally:
            await backend.close()

    with serve_app(replay(fixture, seen)) as url:
        text, finish, caps, load, tokens = asyncio.run(scenario(url))
    completion = routes["POST /v1/completions"]["sse"]
    assert text == streamed_text(completion) and finish.usage == usage_of(last_usage(completion))
    sent = next(body for body in seen if "prompt" in body)
    assert sent["cache_prompt"] is True and sent["prompt"] == "The primary colors are"
    assert next(body for body in seen if "content" in body)["with_pieces"] is True
    props = routes["GET /props"]["json"]
    assert (caps.version, caps.prefix_caching) == (props["build_info"], True)
    assert caps.max_context == props["default_generation_settings"]["n_ctx"]
    metrics = {f.name: sum(s.value for s in f.samples) for f in text_string_to_metric_families(
        routes["GET /metrics"]["text"])}
    assert load.running == metrics["llamacpp:requests_processing"]
    assert [t.id for t in tokens] == [t["id"] for t in routes["POST /tokenize"]["json"]["tokens"]]
    assert "".join(t.text for t in tokens) == routes["POST /tokenize"]["text"]
