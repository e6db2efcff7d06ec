"""The TGI-compatible routes through TGI's own clients: `text-generation` and huggingface_hub's
InferenceClient, unchanged, plus the wire format they rely on."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import pytest
import text_generation
from huggingface_hub import InferenceClient
from huggingface_hub import errors as hub_errors

from backends.builtin import BuiltinBackend, EngineConfig

from .conftest import ADMIN_KEY, AUTH, away_from_minute_edge, gateway_app, serve_app, wait_ready

pytestmark = pytest.mark.slow

PROMPT = "The weather today is"


@pytest.fixture(scope="module")
def tgi(tiny_model_dir, tmp_path_factory):
    backends = {name: BuiltinBackend(EngineConfig(model=str(tiny_model_dir), dtype="float64", served_name=name,
                                                  kv_cache_tokens=4096, engine_process=False), name)
                for name in ("tiny", "tiny-b")}
    app = gateway_app(backends, tmp_path_factory.mktemp("tgi"))
    with serve_app(app) as url:
        wait_ready(url)
        # A tenant with one model: TGI's routes at the root serve it, as a TGI server serves its one model.
        httpx.post(f"{url}/admin/tenants", headers=AUTH, json={"name": "tgi-users", "models": ["tiny"]})
        key = httpx.post(f"{url}/admin/keys", headers=AUTH, json={"tenant": "tgi-users"}).json()["key"]
        yield url, key, backends["tiny"]


def test_text_generation_client_generate_and_stream(tgi):
    url, key, _ = tgi
    client = text_generation.Client(url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    full = client.generate(PROMPT, max_new_tokens=8)  # the client always asks for details
    assert full.details.generated_tokens == len(full.details.tokens) <= 8
    assert full.details.finish_reason.value in ("length", "eos_token")
    assert "".join(t.text for t in full.details.tokens) == full.generated_text
    # Greedy by default, as in TGI: the OpenAI route with temperature 0 says the same.
    openai_text = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}).json()["choices"][0]["text"]
    assert full.generated_text == openai_text

    events = list(client.generate_stream(PROMPT, max_new_tokens=8))
    assert "".join(e.token.text for e in events) == full.generated_text
    assert all(e.generated_text is None and e.details is None for e in events[:-1])
    assert events[-1].generated_text == full.generated_text
    assert events[-1].details.generated_tokens == len(events)

    async def in_async():
        aclient = text_generation.AsyncClient(url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        return (await aclient.generate(PROMPT, max_new_tokens=8)).generated_text

    assert asyncio.run(in_async()) == full.generated_text
    sampled = client.generate(PROMPT, max_new_tokens=8, do_sample=True, seed=7, temperature=0.9)
    again = client.generate(PROMPT, max_new_tokens=8, do_sample=True, seed=7, temperature=0.9)
    assert sampled.generated_text == again.generated_text  # the seed is honoured


def test_inference_client_text_generation(tgi):
    url, key, _ = tgi
    client = InferenceClient(base_url=url, api_key=key)
    text = client.text_generation(PROMPT, max_new_tokens=8)
    assert isinstance(text, str) and text
    assert "".join(client.text_generation(PROMPT, max_new_tokens=8, stream=True)) == text
    detailed = client.text_generation(PROMPT, max_new_tokens=8, details=True)
    assert detailed.generated_text == text and detailed.details.generated_tokens <= 8
    full = client.text_generation(PROMPT, max_new_tokens=8, return_full_text=True)
    assert full == PROMPT + text


def test_tgi_clients_raise_their_own_errors_for_422_and_429(tgi):
    url, key, _ = tgi
    headers = {"Authorization": f"Bearer {key}"}
    tgi_client = text_generation.Client(url, headers=headers, timeout=60)
    hub_client = InferenceClient(base_url=url, api_key=key)
    with pytest.raises(text_generation.errors.ValidationError, match="context"):
        tgi_client.generate("hello " * 3000, max_new_tokens=4)
    with pytest.raises(hub_errors.ValidationError, match="context"):
        hub_client.text_generation("hello " * 3000, max_new_tokens=4)

    name = f"limited-{uuid.uuid4().hex[:6]}"
    httpx.post(f"{url}/admin/tenants", headers=AUTH, json={"name": name, "rpm": 1, "models": ["tiny"]})
    limited = httpx.post(f"{url}/admin/keys", headers=AUTH, json={"tenant": name}).json()["key"]
    limited_client = text_generation.Client(url, headers={"Authorization": f"Bearer {limited}"}, timeout=60)
    away_from_minute_edge()  # the three requests below fall in one window
    limited_client.generate(PROMPT, max_new_tokens=2)
    with pytest.raises(text_generation.errors.OverloadedError, match="requests per minute"):
        limited_client.generate(PROMPT, max_new_tokens=2)
    with pytest.raises(hub_errors.OverloadedError):
        InferenceClient(base_url=url, api_key=limited).text_generation(PROMPT, max_new_tokens=2)


def test_wire_format_routes_and_auth(tgi):
    url, key, backend = tgi
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream("POST", f"{url}/generate_stream", headers=headers,
                      json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4, "details": True}}) as response:
        raw = response.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data:{") for e in events) and "[DONE]" not in raw  # TGI's framing
    last = json.loads(events[-1][5:])
    assert last["details"]["finish_reason"] in ("length", "eos_token") and last["details"]["input_length"] > 0

    plain = httpx.post(f"{url}/generate_stream", headers=headers,
                       json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4}}).text.split("\n\n")
    last_plain = json.loads(plain[-2][5:])  # the text ends with a blank line
    assert last_plain["generated_text"] and last_plain["details"] is None  # as TGI: details only when asked for

    compat = httpx.post(f"{url}/", headers=headers, json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4}})
    assert isinstance(compat.json(), list) and compat.json()[0]["generated_text"]
    streamed = httpx.post(f"{url}/", headers=headers,
                          json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4}, "stream": True})
    assert streamed.headers["content-type"].startswith("text/event-stream")

    info = httpx.get(f"{url}/info", headers=headers).json()
    assert info["model_id"] == "tiny" and info["max_total_tokens"] == backend.engine.max_model_len
    tokens = httpx.post(f"{url}/tokenize", headers=headers, json={"inputs": PROMPT}).json()
    assert [t["id"] for t in tokens] == backend.engine.tokenizer.encode(PROMPT)
    assert all(PROMPT[t["start"]:t["stop"]] == t["text"] for t in tokens)

    # With several models, /tgi/{model}/... picks one; the root refuses to guess.
    admin_headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    picked = httpx.post(f"{url}/tgi/tiny-b/generate", headers=admin_headers,
                        json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
    assert picked.status_code == 200
    ambiguous = httpx.post(f"{url}/generate", headers=admin_headers, json={"inputs": PROMPT})
    assert ambiguous.status_code == 422 and ambiguous.json()["error_type"] == "validation"

    unauthenticated = httpx.post(f"{url}/generate", json={"inputs": PROMPT})
    assert unauthenticated.status_code == 401 and set(unauthenticated.json()) == {"error", "error_type"}
    too_many_stops = httpx.post(f"{url}/generate", headers=headers,
                                json={"inputs": PROMPT, "parameters": {"stop": ["a", "b", "c", "d", "e"]}})
    assert too_many_stops.status_code == 422 and "stop" in too_many_stops.json()["error"]


def test_a_tgi_client_that_leaves_cancels_the_generation(tgi):
    url, key, backend = tgi
    engine = backend.engine
    with httpx.stream("POST", f"{url}/generate_stream", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      json={"inputs": PROMPT, "parameters": {"max_new_tokens": 1500}}) as response:
        events = (line for line in response.iter_lines() if line.startswith("data:"))
        for _ in range(4):
            next(events)
        assert engine.kv.num_used > 0
    deadline = time.monotonic() + 10
    while engine.kv.num_used or engine.scheduler.running:
        assert time.monotonic() < deadline, "the abandoned TGI stream still holds KV blocks"
        time.sleep(0.01)


def test_tgi_routes_refuse_lone_surrogates_and_oversized_counts_with_422(tgi):
    url, key, _ = tgi
    headers = {"Authorization": f"Bearer {key}", "content-type": "application/json"}
    surrogate = httpx.post(f"{url}/generate", content=b'{"inputs": "hi \\ud800"}', headers=headers)
    assert surrogate.status_code == 422 and "lone surrogate" in surrogate.json()["error"]
    assert surrogate.json()["error_type"] == "validation"
    huge = httpx.post(f"{url}/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 10**30}},
                      headers=headers)
    assert huge.status_code == 422 and "max_new_tokens" in huge.json()["error"]


def test_a_tgi_clients_grammar_constrains_the_builtin_engine(tgi):
    """TGI's `grammar` parameter (`{"type": "regex" | "json", "value": ...}`) is honoured when the
    backend behind the TGI routes is servegate's own engine, as it would be by TGI itself."""
    import re

    from text_generation.types import Grammar, GrammarType

    url, key, _ = tgi
    client = text_generation.Client(url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    digits = client.generate(PROMPT, max_new_tokens=12, grammar=Grammar(type=GrammarType.Regex, value="[0-9]{3}-[ab]"))
    assert re.fullmatch(r"[0-9]{3}-[ab]", digits.generated_text), digits.generated_text
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    answer = client.generate(PROMPT, max_new_tokens=20, grammar=Grammar(type=GrammarType.Json, value=schema))
    assert isinstance(json.loads(answer.generated_text)["ok"], bool), answer.generated_text
