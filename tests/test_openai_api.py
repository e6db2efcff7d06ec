"""`servegate serve`'s OpenAI API through the official `openai` SDK and raw HTTP, on a real socket."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch

from advisor.measure.baselines import servegate_env
from backends.builtin import BuiltinBackend, EngineConfig

from .conftest import ADMIN_KEY, AUTH, free_port, gateway_app, serve_app, wait_ready

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def backend():
    return BuiltinBackend(EngineConfig(engine_process=False, gguf_weights="dequantized"))  # the tests read its engine


@pytest.fixture(scope="module")
def base_url(backend, tmp_path_factory):
    with serve_app(gateway_app({backend.model_id: backend}, tmp_path_factory.mktemp("gw"))) as url:
        first_ready = httpx.get(f"{url}/ready")
        wait_ready(url)
        yield url, first_ready
    engine = backend.engine
    assert engine.kv.num_free == engine.kv.num_blocks, "KV blocks leaked by the API tests"


@pytest.fixture
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url[0]}/v1", api_key=ADMIN_KEY, max_retries=0)


def test_probes_and_models(base_url, client):
    url, first_ready = base_url
    assert first_ready.status_code == 503  # the model was still loading
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{url}/ready").status_code == 200
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_metrics_expose_kv_and_scheduling_figures(base_url, client, backend):
    client.completions.create(model=MODEL, prompt="Metrics please " * 12, max_tokens=3)
    client.completions.create(model=MODEL, prompt="Metrics please " * 12, max_tokens=3)
    text = httpx.get(f"{base_url[0]}/metrics").text
    figures = {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("servegate_backend_")}
    assert figures["servegate_backend_kv_blocks_total"] == backend.engine.kv.num_blocks
    assert figures["servegate_backend_prefix_cache_hits_total"] >= 16  # the repeated prompt hit the cache
    for name in ("kv_blocks_used", "kv_blocks_cached", "kv_live_token_fraction", "preemptions_total",
                 "recomputed_tokens_total", "queue_delay_seconds_total", "running", "waiting", "kv_usage"):
        assert f"servegate_backend_{name}" in figures


def test_chat_greedy_equals_transformers(client, hf_model, default_model):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    tok = default_model.tokenizer
    prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                        add_special_tokens=False)
    with torch.inference_mode():
        ids = hf_model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt):]
    want = tok.decode(ids, skip_special_tokens=True)
    got = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=20)
    assert got.choices[0].message.content == want
    assert got.usage.prompt_tokens == len(prompt) and got.usage.completion_tokens == len(ids)


def test_chat_stream_with_usage_and_cached_tokens(client):
    messages = [{"role": "system", "content": "You answer briefly. " * 10},
                {"role": "user", "content": "Name a color."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 48  # the repeated prompt hit the cache


def test_one_tenants_cached_prefix_never_serves_another(base_url, backend):
    """A prefix-cache hit shortens the time to the first token and shows in the usage: shared
    across tenants it would tell one what another sent. Each tenant's prompts hit only its own."""
    url = base_url[0]
    prompt = "A private note on the quarterly figures. " * 12
    clients = []
    for name in ("cache-a", "cache-b"):
        assert httpx.post(f"{url}/admin/tenants", json={"name": name}, headers=AUTH).status_code == 201
        key = httpx.post(f"{url}/admin/keys", json={"tenant": name}, headers=AUTH).json()["key"]
        clients.append(openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0))
    cached = [c.completions.create(model=MODEL, prompt=prompt, max_tokens=1).usage.prompt_tokens_details.cached_tokens
              for c in (clients[0], clients[1], clients[0], clients[1])]
    assert cached[:2] == [0, 0] and cached[2] >= 64 and cached[3] >= 64  # each hit its own copy
    assert backend.engine.kv.num_cached >= 2 * (cached[2] // backend.engine.kv.block_size)


def test_completions_stream_and_not(client):
    full = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=10, temperature=0)
    assert full.choices[0].finish_reason in ("length", "stop") and full.usage.completion_tokens <= 10
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=10, temperature=0, stream=True) if c.choices)
    assert streamed == full.choices[0].text
    n3 = client.completions.create(model=MODEL, prompt="Once", max_tokens=5, temperature=1, n=3, seed=1)
    assert sorted(c.index for c in n3.choices) == [0, 1, 2]


def test_bad_inputs_get_clear_openai_errors(base_url, client):
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=MODEL, prompt="hello " * 9000, max_tokens=5)
    assert too_long.value.code == "context_length_exceeded" and "maximum context length" in too_long.value.message
    with pytest.raises(openai.BadRequestError) as zero:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=0)
    assert "max_tokens" in zero.value.message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert unknown.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as unsupported:
        client.completions.create(model=MODEL, prompt="hi", suffix="there")
    assert "suffix" in unsupported.value.message
    url = base_url[0]
    bad_json = httpx.post(f"{url}/v1/chat/completions", content=b'{"model": ',
                          headers={"content-type": "application/json", **AUTH})
    assert bad_json.status_code == 400 and "JSON" in bad_json.json()["error"]["message"]
    bad_stream = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x " * 9000, "stream": True},
                            headers=AUTH)
    assert bad_stream.status_code == 400 and bad_stream.json()["error"]["code"] == "context_length_exceeded"
    for calls in ("bad", [{"function": "f"}], [{"type": "function"}]):  # an earlier turn's malformed tool calls
        turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": calls},
                 {"role": "user", "content": "and?"}]
        malformed = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": turns, "max_tokens": 2},
                               headers=AUTH)
        assert malformed.status_code == 400 and "tool_calls" in malformed.json()["error"]["message"], malformed.text


def test_text_that_is_not_unicode_and_numbers_no_runtime_takes_are_400s(base_url):
    """A lone surrogate (JSON can spell one) was a 500; max_tokens=10**30 broke the quota script."""
    url = base_url[0]
    raw = {"content-type": "application/json", **AUTH}
    for path, body, where in [
        ("/v1/completions", {"model": MODEL, "prompt": "hi \ud800", "max_tokens": 2}, "prompt"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]},
         "messages.0.content"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["\udfff"]}, "stop.0"),
    ]:  # json.dumps escapes a lone surrogate as \\udXXX, as a client's JSON would carry it
        refused = httpx.post(f"{url}{path}", content=json.dumps(body).encode(), headers=raw)
        assert refused.status_code == 400, refused.text
        assert where in refused.json()["error"]["message"] and "lone surrogate" in refused.json()["error"]["message"]
    for field, value in [("max_tokens", 10**30), ("seed", 10**30), ("top_k", 10**12)]:
        refused = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", field: value},
                             headers=AUTH)
        assert refused.status_code == 400 and field in refused.json()["error"]["message"], (field, refused.text)


def test_client_disconnect_frees_blocks_within_a_step(base_url, backend):
    url = base_url[0]
    engine = backend.engine
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{url}/v1/completions", headers=AUTH, json={
            "model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True,
            "temperature": 0, "stream": True,
        }) as response:
            lines = response.iter_lines()
            for _ in range(6):
                next(lines)
            assert engine.kv.num_used > 0
            steps_at_close = engine.steps
    # the connection is closed here
    deadline = time.monotonic() + 10
    while engine.kv.num_used or engine.scheduler.running:
        assert time.monotonic() < deadline, "the aborted request still holds KV blocks"
        time.sleep(0.005)
    assert engine.steps - steps_at_close <= 2


def test_non_streaming_client_that_leaves_cancels_the_request(base_url, backend):
    url, engine = base_url[0], backend.engine

    async def leave_early():
        async with httpx.AsyncClient(base_url=url, timeout=60, headers=AUTH) as http:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(http.post("/v1/completions", json={
                    "model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True}), 1.5)

    asyncio.run(leave_early())
    deadline = time.monotonic() + 10
    while engine.kv.num_used or engine.scheduler.running:
        assert time.monotonic() < deadline, "the abandoned request kept running"
        time.sleep(0.01)


def test_failing_request_does_not_disturb_the_batch(base_url):
    url = base_url[0]

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=60, headers=AUTH) as http:
            long = asyncio.create_task(http.post("/v1/completions", json={
                "model": MODEL, "prompt": "Count:", "max_tokens": 40, "temperature": 0, "ignore_eos": True}))
            await asyncio.sleep(0.2)
            bad = await asyncio.gather(
                http.post("/v1/completions", json={"model": MODEL, "prompt": "x " * 9000}),
                http.post("/v1/completions", json={"model": MODEL, "prompt": [99999999]}),
                http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "bogus", "content": 1}]}),
            )
            return await long, bad

    long, bad = asyncio.run(scenario())
    assert [r.status_code for r in bad] == [400, 400, 400]
    assert long.status_code == 200 and long.json()["usage"]["completion_tokens"] == 40


def test_servegate_serve_cli_bootstraps_a_key_and_answers_the_openai_sdk(tmp_path):
    port, url = free_port(), None
    log = tmp_path / "serve.log"
    with servegate_env() as (env, _), open(log, "w") as out:
        env.pop("SERVEGATE_ADMIN_KEY")  # the first start creates the admin key and prints it once
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--port", str(port)],
                                stdout=out, stderr=out, env={**os.environ, **env})
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, timeout=180, process=proc)
            lines = log.read_text().splitlines()
            key = lines[lines.index(next(x for x in lines if x.startswith("Created tenant `default`"))) + 1]
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
            reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}],
                                                   max_tokens=8)
            assert reply.choices[0].message.content and reply.usage.completion_tokens <= 8
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=f"{url}/v1", api_key="sg_00000000_wrong", max_retries=0).models.list()
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        assert key not in log.read_text().split(key, 1)[1], "the key was printed more than once"
