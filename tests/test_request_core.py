"""The request core against live upstreams, as an attacker and an operator would try it: nobody
gets tokens unbilled, a recovered target comes back, no client makes the gateway log an error,
nobody reaches another tenant, a new key works at once."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from contextlib import ExitStack, contextmanager
from types import SimpleNamespace

import httpx
import openai
import pytest
from typer.testing import CliRunner

from advisor.bench import stub
from backends.base import GenerateRequest
from backends.openai_compat import OpenAICompatBackend, OpenAICompatConfig
from backends.vllm import VLLMBackend

from .conftest import (
    ADMIN_KEY,
    AUTH,
    REDIS_URL,
    bearer,
    gateway_app,
    needs_redis,
    openai_upstream,
    serve_app,
    usage_records,
    wait_ready,
)

PIECES = 60  # an upstream answer, one token per piece, streamed every PIECE_S
PIECE_S = 0.02


def piece(text: str | None, finish: str | None = None, usage: dict | None = None) -> bytes:
    choices = [] if text is None else [{"index": 0, "text": text, "finish_reason": finish}]
    return f"data: {json.dumps({'choices': choices, 'usage': usage})}\n\n".encode()


async def answer(count: int = PIECES, die_after: int | None = None, first_after_s: float = 0.0):
    """An upstream's streamed completion without token ids (as every remote runtime sends), its
    usage only at the end; with `die_after`, the connection breaks after that many pieces."""
    await asyncio.sleep(first_after_s)
    for i in range(count):
        if i == die_after:
            raise ConnectionResetError("the upstream died")
        yield piece("tok ")
        await asyncio.sleep(PIECE_S)
    yield piece("", "length")
    yield piece(None, usage={"prompt_tokens": 3, "completion_tokens": count, "total_tokens": count + 3})
    yield b"data: [DONE]\n\n"


def remote(url: str, name: str = "remote") -> OpenAICompatBackend:
    return OpenAICompatBackend(OpenAICompatConfig(base_url=url, model=stub.MODEL, max_context=4096), name=name)


@contextmanager
def gateway_over(upstreams: dict[str, object], tmp_path, **settings):
    """A gateway serving one model per upstream app, named by its key."""
    with ExitStack() as stack:
        urls = {name: stack.enter_context(serve_app(app)) for name, app in upstreams.items()}
        app = gateway_app({name: remote(url, name) for name, url in urls.items()}, tmp_path, **settings)
        url = stack.enter_context(serve_app(app))
        wait_ready(url)
        yield SimpleNamespace(url=url, gateway=app.state.gateway)


def admin(gw, method: str, path: str, key: str = ADMIN_KEY, **kwargs) -> httpx.Response:
    return httpx.request(method, gw.url + path, headers=bearer(key), timeout=30, **kwargs)


def tenant_with_key(gw, scopes: tuple[str, ...] = ("inference",), **limits) -> tuple[str, str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    assert admin(gw, "POST", "/admin/tenants", json={"name": name, **limits}).status_code == 201
    created = admin(gw, "POST", "/admin/keys", json={"tenant": name, "scopes": list(scopes)})
    assert created.status_code == 201, created.text
    return name, created.json()["key"]


def tokens_today(gw, tenant: str) -> int:
    """What the tenant's daily token window holds (the quota store's own count)."""
    day = int(time.time() // 86_400)
    return gw.gateway.quotas.counters[f"tenant:{tenant}", "tpd", day]


def read_pieces(gw, key: str, count: int, path: str = "/v1/completions", body: dict | None = None) -> int:
    """Stream a completion, read `count` pieces of text, then hang up; returns the pieces read."""
    body = body or {"model": "remote", "prompt": "hi", "max_tokens": 500, "stream": True}
    got = 0
    with httpx.stream("POST", gw.url + path, json=body, headers=bearer(key), timeout=30) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data:") and '"tok ' in line:
                got += 1
                if got == count:
                    break
    return got


# -- usage that cannot be dodged ----------------------------------------------------------
def test_a_client_that_hangs_up_mid_stream_is_billed_what_it_received(tmp_path):
    with gateway_over({"remote": openai_upstream(lambda path: answer())}, tmp_path) as gw:
        tenant, key = tenant_with_key(gw, tpm=100_000)
        received = read_pieces(gw, key, 10)
        record = usage_records(gw.url, tenant)[0]
        assert record["status"] == "cancelled" and record["completion_tokens"] >= received == 10
        total = record["prompt_tokens"] + record["completion_tokens"]
        deadline = time.monotonic() + 5
        while tokens_today(gw, tenant) != total:  # the reservation settles to what was billed
            assert time.monotonic() < deadline, (tokens_today(gw, tenant), total)
            time.sleep(0.05)

        # A whole answer bills what the upstream reports; never less than the pieces it sent.
        done = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key).completions.create(
            model="remote", prompt="hi", max_tokens=500)
        assert done.usage.completion_tokens == PIECES
        assert usage_records(gw.url, tenant, 2)[0]["completion_tokens"] == PIECES


def test_an_upstream_that_lies_about_usage_is_billed_from_what_it_sent(tmp_path):
    async def liar():
        async for chunk in answer(count=20):
            yield chunk.replace(b'"completion_tokens": 20', b'"completion_tokens": 0')

    with gateway_over({"remote": openai_upstream(lambda path: liar())}, tmp_path) as gw:
        tenant, key = tenant_with_key(gw)
        done = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key).completions.create(
            model="remote", prompt="hi", max_tokens=500)
        assert done.usage.completion_tokens == 20 and usage_records(gw.url, tenant)[0]["completion_tokens"] == 20


@pytest.mark.parametrize("usage, completion", [
    ({"prompt_tokens": 3, "completion_tokens": 20, "prompt_tokens_details": {"cached_tokens": 10**9}}, 20),
    ({"prompt_tokens": -1000, "completion_tokens": 20, "prompt_tokens_details": {"cached_tokens": -5}}, 20),
    ({"prompt_tokens": "3", "completion_tokens": None, "prompt_tokens_details": {"cached_tokens": 2.5}}, 20),
    ({"prompt_tokens": 3, "completion_tokens": 10**9}, 20),  # more than max_tokens: what was sent
    ({"prompt_tokens": 2**63, "completion_tokens": 2**63, "prompt_tokens_details": {"cached_tokens": 2**63}}, 20),
], ids=["cached-beyond-the-prompt", "negative-counts", "counts-not-integers", "beyond-max-tokens", "int64-overflow"])
def test_an_upstream_whose_usage_is_impossible_is_billed_at_least_what_it_sent(tmp_path, usage, completion, caplog):
    """Cached tokens priced below input ones, more of them than the prompt held, would bill less
    than nothing; a negative count likewise. A count beyond what the request could use (a completion
    past `max_tokens`, a prompt past the gateway's own count) is logged with the backend's name and
    billed from the gateway's own count: what it sent, the prompt as it counted it."""
    async def impossible():
        async for chunk in answer(count=20):
            yield chunk if b'"usage": null' in chunk or b"[DONE]" in chunk else piece(None, usage=usage)

    price = {"input": 1, "cached_input": 0.1, "output": 2}  # USD per million tokens
    with gateway_over({"remote": openai_upstream(lambda path: impossible())}, tmp_path,
                      prices={"remote": price}) as gw:
        tenant, key = tenant_with_key(gw)
        done = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key).completions.create(
            model="remote", prompt="hi", max_tokens=500)
        record = usage_records(gw.url, tenant)[0]
    billed = (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.prompt_tokens_details.cached_tokens)
    assert billed == (record["prompt_tokens"], record["completion_tokens"], record["cached_tokens"])
    assert 1 <= record["prompt_tokens"] < 2**31 and record["completion_tokens"] == completion
    assert 0 <= record["cached_tokens"] <= record["prompt_tokens"]
    if any(isinstance(v, int) and v > 500 for v in (usage["prompt_tokens"], usage["completion_tokens"])):
        assert any("backend remote reported usage" in r.getMessage() for r in caplog.records)
    # every prompt token at the cached price, in nano-dollars ($1 per million tokens is 1,000 a token)
    assert record["cost_nano_usd"] >= record["prompt_tokens"] * 100 + completion * 2_000


def test_an_upstream_that_dies_mid_stream_bills_what_was_sent(tmp_path):
    with gateway_over({"remote": openai_upstream(lambda path: answer(die_after=12))}, tmp_path) as gw:
        tenant, key = tenant_with_key(gw)
        lines = []
        body = {"model": "remote", "prompt": "hi", "max_tokens": 500, "stream": True}
        with httpx.stream("POST", gw.url + "/v1/completions", json=body, headers=bearer(key), timeout=30) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data:")]
        assert sum('"tok ' in line for line in lines) == 12 and '"error"' in lines[-2] and lines[-1] == "data: [DONE]"
        record = usage_records(gw.url, tenant)[0]
        assert record["status"] == "error" and record["completion_tokens"] >= 12
        deadline = time.monotonic() + 5
        while tokens_today(gw, tenant) != record["prompt_tokens"] + record["completion_tokens"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_a_client_that_leaves_a_vllm_chat_is_billed_the_prompt_vllm_counts(tmp_path, vllm_url):
    """Against the real vLLM: a chat stream the client leaves ends without vLLM's usage, so its
    prompt is counted again by vLLM's `/tokenize`: the same count vLLM's usage gives the finished
    request (the reservation's bound, bytes plus a margin per message, billed 109 for its 27)."""
    backend = VLLMBackend(OpenAICompatConfig(base_url=vllm_url, model="smollm2"), name="vllm")
    app = gateway_app({"smollm2": backend}, tmp_path)
    messages = [{"role": "system", "content": "You tell stories."},
                {"role": "user", "content": "Tell a long story about a lighthouse keeper."}]
    with serve_app(app) as url:
        wait_ready(url)
        gw = SimpleNamespace(url=url, gateway=app.state.gateway)
        tenant, key = tenant_with_key(gw)
        body = {"model": "smollm2", "messages": messages, "max_tokens": 300, "stream": True, "ignore_eos": True}
        pieces = 0
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=bearer(key), timeout=60) as r:
            for line in r.iter_lines():
                pieces += line.startswith("data:") and '"content":"' in line and '"content":""' not in line
                if pieces == 10:
                    break
        left = usage_records(url, tenant)[0]
        done = openai.OpenAI(base_url=f"{url}/v1", api_key=key).chat.completions.create(
            model="smollm2", messages=messages, max_tokens=2)
    assert left["status"] == "cancelled" and left["completion_tokens"] >= pieces == 10
    assert left["prompt_tokens"] == done.usage.prompt_tokens


@pytest.mark.parametrize("status, answered", [(400, 400), (500, 502)])
def test_a_request_refused_before_any_answer_bills_nothing(tmp_path, status, answered):
    """An upstream that refuses a request (the client's fault) or fails before answering (its
    own) served nothing: the ledger bills no tokens and no money, and the tenant's token window
    gets its reservation back."""
    price = {"input": 1, "output": 2}  # USD per million tokens
    with gateway_over({"remote": openai_upstream(lambda path: [], status=status)}, tmp_path,
                      prices={"remote": price}) as gw:
        tenant, key = tenant_with_key(gw)
        body = {"model": "remote", "messages": [{"role": "user", "content": "hello " * 200}], "max_tokens": 50}
        refused = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=bearer(key), timeout=30)
        assert refused.status_code == answered
        record = usage_records(gw.url, tenant)[0]
        assert record["status"] == "error"
        assert (record["prompt_tokens"], record["completion_tokens"], record["cost_nano_usd"]) == (0, 0, 0)
        deadline = time.monotonic() + 5
        while tokens_today(gw, tenant) != 0:  # the reservation (prompt + max_tokens) is released
            assert time.monotonic() < deadline, tokens_today(gw, tenant)
            time.sleep(0.05)


# -- the breaker -------------------------------------------------------------------------------
def test_a_recovered_target_ranked_second_gets_traffic_again(tmp_path):
    failing = threading.Event()
    failing.set()

    def flaky(scope_path):
        if failing.is_set():
            raise ConnectionResetError("down")
        return answer(count=2)

    apps = {"a": openai_upstream(lambda path: answer(count=2)), "b": openai_upstream(flaky)}
    with gateway_over(apps, tmp_path, breaker_failures=1, breaker_cooldown_s=0.5, route_seed=3) as gw:
        spec = {"targets": [{"backend": "a", "weight": 9}, {"backend": "b", "weight": 1}]}
        assert admin(gw, "POST", "/admin/routes/chat/deploy", json={"spec": spec}).status_code == 201

        def served_by() -> str:
            reply = httpx.post(gw.url + "/v1/completions", headers=AUTH, timeout=30,
                               json={"model": "chat", "prompt": "hi", "max_tokens": 5})
            assert reply.status_code == 200, reply.text
            return reply.headers["x-servegate-route"].split("backend=")[1].split(";")[0]

        while "b" not in gw.gateway.router.breakers or gw.gateway.router.breakers["b"].opened_at is None:
            served_by()  # b fails over to a until its breaker opens
        failing.clear()  # b recovers
        recovered_at = time.monotonic()
        served = [served_by() for _ in range(200)]
        assert served.count("b") >= 5, served.count("b")
        breaker = gw.gateway.router.breakers["b"]
        assert breaker.opened_at is None and not breaker.probing
        assert time.monotonic() - recovered_at < 60


# -- input limits ---------------------------------------------------------------------------------
@needs_redis
def test_a_huge_max_tokens_is_refused_and_redis_stays_authoritative(tmp_path, caplog):
    with gateway_over({"remote": openai_upstream(lambda path: answer(count=2))}, tmp_path,
                      redis_url=REDIS_URL) as gw:
        tenant, key = tenant_with_key(gw, max_concurrency=2)
        with caplog.at_level(logging.WARNING):
            huge = httpx.post(gw.url + "/v1/completions", headers=bearer(key),
                              json={"model": "remote", "prompt": "hi", "max_tokens": 10**30})
            ok = httpx.post(gw.url + "/v1/completions", headers=bearer(key),
                            json={"model": "remote", "prompt": "hi", "max_tokens": 5})
        assert huge.status_code == 400 and huge.json()["error"]["param"] == "max_tokens"
        assert ok.status_code == 200
        assert not [r for r in caplog.records if "redis" in r.getMessage().lower()]


def test_a_body_over_the_limit_is_a_413_in_each_apis_shape(tmp_path):
    with gateway_over({"remote": openai_upstream(lambda path: answer(count=2))}, tmp_path) as gw:
        big = b'{"model": "remote", "prompt": "' + b"a" * (50 * 1024 * 1024) + b'"}'
        openai_style = httpx.post(gw.url + "/v1/completions", content=big, headers=AUTH, timeout=60)
        assert openai_style.status_code == 413 and "larger than" in openai_style.json()["error"]["message"]
        tgi_style = httpx.post(gw.url + "/generate", content=big, headers=AUTH, timeout=60)
        assert tgi_style.status_code == 413 and set(tgi_style.json()) == {"error", "error_type"}

        def chunked():  # no Content-Length: counted as it arrives
            for _ in range(10):
                yield b"a" * (1024 * 1024)

        streamed = httpx.post(gw.url + "/v1/completions", content=chunked(), headers=AUTH, timeout=60)
        assert streamed.status_code == 413
        small = httpx.post(gw.url + "/v1/completions", headers=AUTH,
                           json={"model": "remote", "prompt": "hi", "max_tokens": 5})
        assert small.status_code == 200


# -- no client makes the gateway log an error --------------------------------------------------
@pytest.fixture
def errors_logged():
    """ERROR records from every logger, uvicorn's own included (it does not propagate)."""
    found: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = found.append
    loggers = [logging.getLogger(), logging.getLogger("uvicorn"), logging.getLogger("uvicorn.error")]
    for logger in loggers:
        logger.addHandler(handler)
    yield found
    for logger in loggers:
        logger.removeHandler(handler)


@pytest.mark.parametrize("path, body", [
    ("/generate_stream", {"inputs": "hi", "parameters": {"max_new_tokens": 50}}),
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 50}}),
    ("/v1/completions", {"model": "remote", "prompt": "hi", "max_tokens": 50, "stream": True}),
])
def test_a_client_that_leaves_before_the_first_token_is_recorded_cancelled_without_an_error_log(
        tmp_path, errors_logged, path, body):
    with gateway_over({"remote": openai_upstream(lambda p: answer(first_after_s=1.5))}, tmp_path) as gw:
        tenant, key = tenant_with_key(gw)
        for _ in range(3):
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(gw.url + path, json=body, headers=bearer(key), timeout=0.3)
        cancelled = usage_records(gw.url, tenant, 3)
        assert [r["status"] for r in cancelled] == ["cancelled"] * 3
        assert all(r["completion_tokens"] == 0 for r in cancelled)
        time.sleep(1.5)  # the upstream's late answers arrive at nobody
        assert not errors_logged, [r.getMessage() for r in errors_logged]


def test_an_upstream_event_too_long_to_read_is_a_502_not_a_gateway_error(tmp_path, errors_logged):
    """An event longer than the adapter reads as one line (llama-server sends megabytes a token
    when asked for a whole vocabulary's log-probabilities) ends the call as the upstream's
    failure, a 502 that says so; the gateway logs no error of its own."""
    huge = piece("x" * 600_000)
    with gateway_over({"remote": openai_upstream(lambda path: [huge])}, tmp_path) as gw:
        tenant, key = tenant_with_key(gw)
        answer = httpx.post(gw.url + "/v1/completions", json={"model": "remote", "prompt": "hi", "max_tokens": 5},
                            headers=bearer(key), timeout=30)
        assert usage_records(gw.url, tenant)[0]["status"] == "error"
    assert answer.status_code == 502 and "an event longer than" in answer.json()["error"]["message"]
    assert not errors_logged, [r.getMessage() for r in errors_logged]


# -- administration ---------------------------------------------------------------------------
def test_a_tenant_administrator_reaches_only_its_own_tenant(tmp_path):
    with gateway_over({"remote": openai_upstream(lambda path: answer(count=2))}, tmp_path) as gw:
        mine, own_admin = tenant_with_key(gw, scopes=("admin",), tpm=1000)
        other, other_key = tenant_with_key(gw)
        other_prefix = other_key.split("_")[1]

        def as_tenant_admin(method: str, path: str, **kwargs) -> httpx.Response:
            return admin(gw, method, path, key=own_admin, **kwargs)

        refused = {
            "rotate another tenant's key": as_tenant_admin("POST", f"/admin/keys/{other_prefix}/rotate"),
            "revoke another tenant's key": as_tenant_admin("POST", f"/admin/keys/{other_prefix}/revoke"),
            "mint a key for another tenant": as_tenant_admin("POST", "/admin/keys", json={"tenant": other}),
            "list another tenant's keys": as_tenant_admin("GET", "/admin/keys", params={"tenant": other}),
            "read another tenant's usage": as_tenant_admin("GET", "/admin/usage", params={"tenant": other}),
            "read another tenant": as_tenant_admin("GET", f"/admin/tenants/{other}"),
        }
        assert {why: r.status_code for why, r in refused.items()} == {why: 404 for why in refused}
        forbidden = {
            "mint an operator key": as_tenant_admin("POST", "/admin/keys",
                                                    json={"tenant": mine, "scopes": ["operator"]}),
            "raise its own limits": as_tenant_admin("PATCH", f"/admin/tenants/{mine}", json={"tpm": 10**6}),
            "create a tenant": as_tenant_admin("POST", "/admin/tenants", json={"name": "x" + mine}),
            "read the audit log": as_tenant_admin("GET", "/admin/audit"),
            "deploy a route": as_tenant_admin("POST", "/admin/routes/x/deploy",
                                              json={"spec": {"targets": [{"backend": "remote"}]}}),
        }
        assert {why: r.status_code for why, r in forbidden.items()} == {why: 403 for why in forbidden}
        over_cap = as_tenant_admin("POST", "/admin/keys", json={"tenant": mine, "tpm": 5000})
        assert over_cap.status_code == 400 and over_cap.json()["error"]["param"] == "tpm"

        # Its own tenant: keys, usage.
        assert [t["name"] for t in as_tenant_admin("GET", "/admin/tenants").json()] == [mine]
        made = as_tenant_admin("POST", "/admin/keys", json={"tenant": mine, "tpm": 500})
        assert made.status_code == 201
        assert {k["tenant"] for k in as_tenant_admin("GET", "/admin/keys").json()} == {mine}
        assert as_tenant_admin("POST", f"/admin/keys/{made.json()['prefix']}/rotate").status_code == 200
        assert as_tenant_admin("GET", "/admin/usage").status_code == 200
        # Untouched: the other tenant's key still works.
        assert httpx.get(gw.url + "/v1/models", headers=bearer(other_key)).status_code == 200


def test_a_key_made_with_the_cli_works_at_its_first_request(tmp_path, monkeypatch):
    from gateway.cli import app

    with gateway_over({"remote": openai_upstream(lambda path: answer(count=2))}, tmp_path, refresh_s=3600) as gw:
        monkeypatch.setenv("SERVEGATE_DATABASE_URL", str(gw.gateway.db.url))
        made = CliRunner().invoke(app, ["tenants", "create", "cli-made"])
        assert made.exit_code == 0, made.output
        created = CliRunner().invoke(app, ["keys", "create", "--tenant", "cli-made", "--json"])
        assert created.exit_code == 0, created.output
        key = json.loads(created.output)["key"]
        first = httpx.post(gw.url + "/v1/completions", headers=bearer(key),
                           json={"model": "remote", "prompt": "hi", "max_tokens": 5})
        assert first.status_code == 200, first.text

        # Garbage keys cost the database one lookup per refresh interval, not one per request.
        directory = gw.gateway.directory
        lookups = []
        read = directory._read_key
        monkeypatch.setattr(directory, "_read_key", lambda prefix: lookups.append(prefix) or read(prefix))
        garbage = key[:-4] + "xxxx"
        fake = "sg_0badf00d_" + "x" * 43
        answers = [httpx.get(gw.url + "/v1/models", headers=bearer(k)).status_code for k in [garbage, fake] * 5]
        assert answers == [401] * 10 and lookups == ["0badf00d"]


def test_metrics_are_open_to_loopback_only_unless_a_scrape_token_is_set(tmp_path):
    with gateway_over({"remote": openai_upstream(lambda path: answer(count=2))}, tmp_path) as gw:
        assert httpx.get(gw.url + "/metrics").status_code == 200

        async def from_afar(app) -> int:
            transport = httpx.ASGITransport(app, client=("203.0.113.7", 40000))
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as far:
                return (await far.get("/metrics")).status_code

    app = gateway_app({}, tmp_path / "far")
    assert asyncio.run(from_afar(app)) == 401
    tokened = gateway_app({}, tmp_path / "tokened", metrics_token="scrape-me")
    with serve_app(tokened) as url:
        assert httpx.get(url + "/metrics").status_code == 401  # a token, once set, is asked of everyone
        assert httpx.get(url + "/metrics", headers=bearer("scrape-me")).status_code == 200
        assert httpx.get(url + "/metrics", headers=bearer("scrape-me-not")).status_code == 401



def recording(app, bodies: list[dict]):
    """`app`, recording each POSTed JSON body."""

    async def wrapper(scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await app(scope, receive, send)
        body = await stub.read_body(receive)
        bodies.append(json.loads(body))

        async def replay():
            return {"type": "http.request", "body": body, "more_body": False}

        await app(scope, replay, send)

    return wrapper


def test_unknown_fields_never_reach_an_upstream_unless_its_backend_takes_them(tmp_path):
    bodies: list[dict] = []
    upstream = recording(openai_upstream(lambda path: answer(count=2)), bodies)
    with gateway_over({"remote": upstream}, tmp_path) as gw:
        def ask(**fields) -> httpx.Response:
            return httpx.post(gw.url + "/v1/completions", headers=AUTH,
                              json={"model": "remote", "prompt": "hi", "max_tokens": 5, **fields})

        for field in ("n_predict", "priority", "lora_path", "best_of"):  # a way around billing, or none known
            refused = ask(**{field: 7})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text
        assert not bodies  # nothing was sent
        assert ask(logprobs=2, user="u1", frequency_penalty=0.5, priority=0).status_code == 200
        assert bodies[-1]["logprobs"] == 2 and bodies[-1]["user"] == "u1" and "priority" not in bodies[-1]
        tgi_style = httpx.post(gw.url + "/generate", headers=AUTH,
                               json={"inputs": "hi", "parameters": {"max_new_tokens": 5, "adapter_id": "x"}})
        assert tgi_style.status_code == 422 and "adapter_id" in tgi_style.json()["error"]

    custom = remote("http://127.0.0.1:9")
    custom.config.extra_fields = ["house_knob"]
    assert custom.admit_extras(GenerateRequest("r", prompt="hi", extra={"house_knob": 1})).extra == {"house_knob": 1}


def test_a_recounted_stream_is_never_billed_below_one_token_per_piece():
    from backends.base import Delta
    from gateway.calls import Received

    received = Received()
    for text in ("Hel", "lo", " world"):
        received.add(Delta(0, text))
    received.add(Delta(0, "!", (7, 8)))  # ids where the backend gives them
    assert received.choice_texts() == ["Hello world"] and received.floor == 5
    assert received.counted(1) == 5 and received.counted(4) == 6  # the tokenizer's count, floored by the pieces


def test_structured_outputs_reach_each_runtime_in_its_own_spelling():
    """vLLM 0.32 reads only `structured_outputs`, SGLang `json_schema`/`regex`/`ebnf`, llama-server
    `json_schema` and GBNF `grammar`: the adapter rewrites, or refuses what its runtime cannot say."""
    from backends.base import InvalidRequest
    from backends.llamacpp import LlamaCppServerBackend, llama_server_config
    from backends.sglang import SGLangBackend
    from backends.tgi import TGIBackend
    from backends.vllm import VLLMBackend

    url = "http://127.0.0.1:9"
    vllm = VLLMBackend(OpenAICompatConfig(base_url=url, model="m"))
    sglang = SGLangBackend(OpenAICompatConfig(base_url=url, model="m"))
    llama = LlamaCppServerBackend(llama_server_config(url, "m"))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}

    def sent(backend, **extra) -> dict:
        return backend.admit_extras(GenerateRequest("r", prompt="hi", extra=extra)).extra

    assert sent(vllm, guided_json=schema) == {"structured_outputs": {"json": schema}}
    assert sent(vllm, guided_choice=["a", "b"], user="u") == {"structured_outputs": {"choice": ["a", "b"]}, "user": "u"}
    assert sent(vllm, structured_outputs={"regex": "a+"}) == {"structured_outputs": {"regex": "a+"}}
    assert sent(sglang, structured_outputs={"json": schema}) == {"json_schema": json.dumps(schema)}
    assert sent(sglang, guided_choice=["a.b", "c"]) == {"regex": r"(a\.b|c)"}
    assert sent(sglang, structured_outputs={"grammar": 'root ::= "x"'}) == {"ebnf": 'root ::= "x"'}
    assert sent(llama, guided_json=schema) == {"json_schema": schema}
    assert sent(llama, structured_outputs={"choice": ["yes", "no"]}) == {"grammar": 'root ::= "yes" | "no"'}
    assert sent(llama, response_format={"type": "json_object"}) == {"response_format": {"type": "json_object"}}
    with pytest.raises(InvalidRequest) as refused:
        sent(llama, structured_outputs={"regex": "a+"})
    assert refused.value.param == "structured_outputs" and "regex" in refused.value.message
    tgi = TGIBackend(OpenAICompatConfig(base_url=url, model="m"))
    tgi.config.runtime = "tgi"  # as its start() sets it
    openai_shaped = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert sent(tgi, response_format=openai_shaped) == {"grammar": {"type": "json", "value": schema}}
    assert sent(tgi, structured_outputs={"regex": "a+"}) == {"grammar": {"type": "regex", "value": "a+"}}
    tgi_shaped = {"type": "json", "value": schema}
    assert sent(vllm, grammar=tgi_shaped) == {"structured_outputs": {"json": schema}}  # a TGI client, moved to vLLM
    chat = GenerateRequest("r", messages=[{"role": "user", "content": "hi"}],
                           extra={"response_format": openai_shaped})
    assert tgi._body(tgi.admit_extras(chat))[1]["response_format"] == tgi_shaped  # TGI's chat route: its own shape
