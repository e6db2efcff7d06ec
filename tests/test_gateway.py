"""The multi-tenant gateway on a real socket: keys, tenant isolation, quotas, usage, admin API."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from types import SimpleNamespace

import httpx
import jwt
import openai
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from backends.builtin import BuiltinBackend, EngineConfig
from gateway.db import make_engine
from gateway.tenancy.keys import hash_key, key_prefix

from .conftest import ADMIN_KEY, AUTH, away_from_minute_edge, bearer, gateway_app, serve_app, usage_records, wait_ready

pytestmark = pytest.mark.slow

PROMPT = "Count with me:"


def tiny_backend(tiny_model_dir, name: str = "tiny") -> BuiltinBackend:
    return BuiltinBackend(EngineConfig(model=str(tiny_model_dir), dtype="float64", served_name=name,
                                       kv_cache_tokens=4096, engine_process=False), name)  # tests read its engine


@pytest.fixture(scope="module")
def gw(tiny_model_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("gw")
    backends = {name: tiny_backend(tiny_model_dir, name) for name in ("tiny", "tiny-b")}
    app = gateway_app(backends, home, refresh_s=0.3)
    with serve_app(app) as url:
        wait_ready(url)
        yield SimpleNamespace(url=url, home=home, gateway=app.state.gateway, backends=backends)


def admin(gw, method: str, path: str, **kwargs) -> httpx.Response:
    return httpx.request(method, gw.url + path, headers=AUTH, timeout=30, **kwargs)


def tenant_with_key(gw, **tenant) -> tuple[str, str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    created = admin(gw, "POST", "/admin/tenants", json={"name": name, **tenant})
    assert created.status_code == 201, created.text
    key = admin(gw, "POST", "/admin/keys", json={"tenant": name})
    assert key.status_code == 201, key.text
    return name, key.json()["key"]


def client(gw, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)


def prefix(key: str) -> str:
    return key.split("_")[1]


def test_tenant_isolation_and_keys_at_rest(gw, caplog):
    a, key_a = tenant_with_key(gw, models=["tiny"])
    b, key_b = tenant_with_key(gw, models=["tiny-b"])
    ca = client(gw, key_a)
    assert [m.id for m in ca.models.list().data] == ["tiny"]
    with caplog.at_level(logging.INFO):
        ca.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.NotFoundError) as other:  # B's model does not exist, as far as A can tell
        ca.completions.create(model="tiny-b", prompt=PROMPT, max_tokens=2)
    assert "does not exist or you do not have access" in other.value.message
    assert "Available: tiny." in other.value.message
    client(gw, key_b).completions.create(model="tiny-b", prompt=PROMPT, max_tokens=2)

    # No inference key reaches admin routes, B's usage included.
    for method, path in [("GET", f"/admin/usage?tenant={b}"), ("GET", "/admin/tenants"), ("GET", "/admin/keys"),
                         ("POST", f"/admin/keys/{prefix(key_b)}/revoke"), ("GET", "/admin/audit")]:
        refused = httpx.request(method, gw.url + path, headers=bearer(key_a))
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "insufficient_scope", path
    assert httpx.get(f"{gw.url}/admin/tenants").status_code == 401
    assert httpx.get(f"{gw.url}/v1/models", headers={"x-api-key": key_a}).status_code == 200  # as Azure clients send
    assert httpx.get(f"{gw.url}/v1/models", headers={"api-key": key_a}).status_code == 200
    assert httpx.get(f"{gw.url}/v1/models", headers=bearer(key_a[:-1] + "x")).status_code == 401

    # The database holds hashes and prefixes only; logs hold neither keys nor prompts.
    stored = b"".join(p.read_bytes() for p in gw.home.glob("servegate.db*"))
    assert key_a.encode() not in stored and key_b.encode() not in stored and prefix(key_a).encode() in stored
    logged = " ".join(str(vars(r)) for r in caplog.records)
    assert "request finished" in logged and a in logged
    assert key_a not in logged and PROMPT not in logged


def test_revoked_and_expired_keys_stop_within_the_refresh_interval(gw, monkeypatch):
    from typer.testing import CliRunner

    from gateway.cli import app

    _, key = tenant_with_key(gw)
    assert client(gw, key).models.list().data
    # Revoked through the CLI, straight in the database, as from another machine.
    monkeypatch.setenv("SERVEGATE_DATABASE_URL", str(gw.gateway.db.url))
    result = CliRunner().invoke(app, ["keys", "revoke", prefix(key)])
    assert result.exit_code == 0, result.output
    revoked_at = time.monotonic()
    while httpx.get(f"{gw.url}/v1/models", headers=bearer(key)).status_code != 401:
        assert time.monotonic() - revoked_at < 0.3 + 1.0, "a revoked key still works after the refresh interval"
        time.sleep(0.05)

    name = f"t-{uuid.uuid4().hex[:8]}"
    admin(gw, "POST", "/admin/tenants", json={"name": name})
    short = admin(gw, "POST", "/admin/keys", json={"tenant": name, "expires_in_days": 1.5 / 86400}).json()["key"]
    assert httpx.get(f"{gw.url}/v1/models", headers=bearer(short)).status_code == 200
    time.sleep(1.6)
    expired = httpx.get(f"{gw.url}/v1/models", headers=bearer(short))
    assert expired.status_code == 401 and "expired" in expired.json()["error"]["message"]


def test_a_database_outage_does_not_reject_cached_keys(gw):
    _, key = tenant_with_key(gw)
    directory = gw.gateway.directory
    healthy = directory.engine
    directory.engine = make_engine("postgresql+psycopg://postgres@127.0.0.1:1/unreachable")
    try:
        loaded = directory.loaded_at
        time.sleep(1.0)  # several refreshes fail meanwhile
        assert directory.loaded_at == loaded
        reply = client(gw, key).completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
        assert reply.usage.completion_tokens == 2
    finally:
        directory.engine = healthy


def test_jwt_bearer_tokens_name_their_tenant(tiny_model_dir, tmp_path):
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public = private.public_key().public_bytes(serialization.Encoding.PEM,
                                               serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    app = gateway_app({"tiny": tiny_backend(tiny_model_dir)}, tmp_path, jwt_public_key=public, jwt_audience="sg",
                      jwt_issuer="idp", jwt_operator_scope="platform-operator")
    with serve_app(app) as url:
        wait_ready(url)

        def token(**claims) -> str:
            claims = {"sub": "alice", "aud": "sg", "iss": "idp", "exp": int(time.time()) + 60, **claims}
            return jwt.encode(claims, private, algorithm="RS256")

        ok = httpx.get(f"{url}/v1/models", headers=bearer(token(tenant="default")))
        assert ok.status_code == 200 and [m["id"] for m in ok.json()["data"]] == ["tiny"]
        for bad, why in [(token(tenant="nobody"), "Unknown tenant"), (token(), "claim"),
                         (token(tenant="default", exp=int(time.time()) - 10), "expired"),
                         (token(tenant="default", aud="other"), "Audience"),
                         (token(tenant="default", aud=None), '"aud"'),
                         (jwt.encode({"tenant": "default", "aud": "sg", "exp": int(time.time()) + 60}, private,
                                     algorithm="RS256"), '"iss"'),
                         (token(tenant="default", iss="another-idp"), "issuer"),
                         (jwt.PyJWS().encode(json.dumps({"tenant": "default", "aud": "sg", "iss": {"not": "a string"},
                                                         "exp": int(time.time()) + 60}).encode(), private,
                                             algorithm="RS256"), "Issuer"),
                         (jwt.encode({"tenant": "default", "aud": "sg", "exp": int(time.time()) + 60},
                                     rsa.generate_private_key(public_exponent=65537, key_size=2048),
                                     algorithm="RS256"), "Signature")]:
            refused = httpx.get(f"{url}/v1/models", headers=bearer(bad))
            assert refused.status_code == 401 and why in refused.json()["error"]["message"], why
        admin_route = httpx.get(f"{url}/admin/tenants", headers=bearer(token(tenant="default")))
        assert admin_route.status_code == 403  # a token's scopes default to inference
        for scope in (7, [["admin"]], {"admin": True}):  # a claim of the wrong type is the token's fault
            refused = httpx.get(f"{url}/v1/models", headers=bearer(token(tenant="default", scope=scope)))
            assert refused.status_code == 401 and "scope" in refused.json()["error"]["message"], scope
        # `admin` in a token administers its own tenant; only the configured scope makes an operator.
        for scope in ("admin", "admin operator"):
            tenant_admin = bearer(token(tenant="default", scope=scope))
            assert httpx.post(f"{url}/admin/tenants", json={"name": "x"}, headers=tenant_admin).status_code == 403
            assert [t["name"] for t in httpx.get(f"{url}/admin/tenants", headers=tenant_admin).json()] == ["default"]
        operator = bearer(token(tenant="default", scope="platform-operator"))
        assert httpx.post(f"{url}/admin/tenants", json={"name": "made-by-sso"}, headers=operator).status_code == 201


def test_jwt_signing_keys_come_from_a_jwks_url(tiny_model_dir, tmp_path):
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(private.public_key())) | {"kid": "k1", "use": "sig"}
    document = json.dumps({"keys": [jwk]}).encode()

    async def jwks(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": document})

    with serve_app(jwks) as idp:
        app = gateway_app({"tiny": tiny_backend(tiny_model_dir)}, tmp_path, jwt_jwks_url=f"{idp}/jwks.json",
                          jwt_audience="sg", jwt_issuer="idp")
        with serve_app(app) as url:
            wait_ready(url)
            claims = {"tenant": "default", "aud": "sg", "iss": "idp", "exp": int(time.time()) + 60}
            good = jwt.encode(claims, private, algorithm="RS256", headers={"kid": "k1"})
            assert httpx.get(f"{url}/v1/models", headers=bearer(good)).status_code == 200
            unknown = jwt.encode(claims, private, algorithm="RS256", headers={"kid": "rotated-away"})
            refused = httpx.get(f"{url}/v1/models", headers=bearer(unknown))
            assert refused.status_code == 401 and "unknown signing key" in refused.json()["error"]["message"]


def test_rpm_admits_exactly_the_limit_out_of_50_concurrent(gw):
    name, key = tenant_with_key(gw, rpm=10)
    away_from_minute_edge()

    async def burst():
        async with httpx.AsyncClient(base_url=gw.url, headers=bearer(key), timeout=60) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json={
                "model": "tiny", "prompt": PROMPT, "max_tokens": 1}) for _ in range(50)))

    replies = asyncio.run(burst())
    statuses = [r.status_code for r in replies]
    assert statuses.count(200) == 10 and statuses.count(429) == 40
    refused = next(r for r in replies if r.status_code == 429)
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and "requests per minute limit 10" in error["message"]
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    metrics = httpx.get(f"{gw.url}/metrics").text
    assert f'servegate_quota_rejections_total{{limit="rpm",tenant="{name}"}} 40.0' in metrics
    assert (f'servegate_requests_total{{adapter="",backend="tiny",model="tiny",status="ok",tenant="{name}"}} 10.0'
            in metrics)


def test_tokens_per_minute_are_reserved_in_flight_and_returned_on_disconnect(gw):
    prompt_tokens = len(gw.backends["tiny"].engine.tokenizer.encode(PROMPT))
    limit = 2 * prompt_tokens + 300
    name, key = tenant_with_key(gw, tpm=limit)
    away_from_minute_edge()
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True}
    with httpx.Client(base_url=gw.url, headers=bearer(key), timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as first:
            events = (line for line in first.iter_lines() if line.startswith("data:"))
            for _ in range(5):
                next(events)
            # The stream has produced a few tokens, but holds its whole reservation.
            second = http.post("/v1/completions", json=body)
            assert second.status_code == 429 and "tokens per minute" in second.json()["error"]["message"]
        # The client left: the unused part of its reservation comes back.
        deadline = time.monotonic() + 5
        while (third := http.post("/v1/completions", json=body)).status_code == 429:
            assert time.monotonic() < deadline, "the cancelled stream's reservation was not returned"
            time.sleep(0.1)
        assert third.status_code == 200
        too_big = http.post("/v1/completions", json=body | {"max_tokens": limit})
        assert too_big.status_code == 400 and "lower max_tokens" in too_big.json()["error"]["message"]
    records = usage_records(gw.url, name, 2)
    cancelled = next(r for r in records if r["status"] == "cancelled")
    used = sum(r["prompt_tokens"] + r["completion_tokens"] for r in records)
    assert 5 <= cancelled["completion_tokens"] < 200 and used <= limit


def test_a_client_that_leaves_mid_stream_frees_kv_and_is_recorded_as_cancelled(gw):
    name, key = tenant_with_key(gw)
    engine = gw.backends["tiny"].engine
    with httpx.Client(base_url=gw.url, headers=bearer(key), timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "Tell me a long story"}],
            "max_tokens": 1500, "ignore_eos": True, "stream": True,
        }) as response:
            received = 0
            for line in response.iter_lines():
                received += line.startswith("data:")
                if received == 8:
                    break
            assert engine.kv.num_used > 0
    deadline = time.monotonic() + 10
    while engine.kv.num_used or engine.scheduler.running:
        assert time.monotonic() < deadline, "the abandoned stream still holds KV blocks"
        time.sleep(0.01)
    (record,) = usage_records(gw.url, name, 1)
    assert record["status"] == "cancelled" and record["stream"] and record["ttft_ms"] > 0
    assert 7 <= record["completion_tokens"] < 1500 and record["prompt_tokens"] > 0


def test_request_limits_disabled_tenants_and_scopes(gw):
    name, key = tenant_with_key(gw, max_tokens_per_request=5)
    c = client(gw, key)
    with pytest.raises(openai.BadRequestError) as over:
        c.completions.create(model="tiny", prompt=PROMPT, max_tokens=6)
    assert over.value.code == "max_tokens_exceeded"
    capped = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"ignore_eos": True})
    assert capped.usage.completion_tokens == 5  # no max_tokens asked: the tenant's cap applies
    assert admin(gw, "PATCH", f"/admin/tenants/{name}", json={"disabled": True}).json()["disabled"]
    with pytest.raises(openai.PermissionDeniedError):
        c.models.list()
    admin_only = admin(gw, "POST", "/admin/keys", json={"tenant": name, "scopes": ["admin"]}).json()["key"]
    assert httpx.get(f"{gw.url}/v1/models", headers=bearer(admin_only)).status_code == 403


def test_admin_api_manages_tenants_and_keys_with_an_audit_trail(gw):
    name, key = tenant_with_key(gw, rpm=5)
    assert admin(gw, "POST", "/admin/tenants", json={"name": name}).status_code == 409
    assert admin(gw, "POST", "/admin/tenants", json={"name": "bad name!"}).status_code == 400
    assert admin(gw, "GET", "/admin/tenants/no-such").status_code == 404
    patched = admin(gw, "PATCH", f"/admin/tenants/{name}", json={"rpm": 7, "models": ["tiny"]}).json()
    assert patched["rpm"] == 7 and patched["models"] == ["tiny"] and patched["tier"] == "standard"
    assert admin(gw, "PATCH", f"/admin/tenants/{name}", json={"rpm": None}).json()["rpm"] is None
    budget = admin(gw, "PATCH", f"/admin/tenants/{name}", json={"daily_budget_usd": "12.3456789012"})
    assert budget.status_code == 400 and "9 decimal places" in budget.json()["error"]["message"]  # nano-dollars
    budget = admin(gw, "PATCH", f"/admin/tenants/{name}", json={"daily_budget_usd": "12.5", "monthly_budget_usd": 300})
    assert (budget.json()["daily_budget_usd"], budget.json()["monthly_budget_usd"]) == ("12.5", "300")
    assert admin(gw, "GET", f"/admin/tenants/{name}").json()["daily_budget_usd"] == "12.5"  # exact, from the database
    admin(gw, "PATCH", f"/admin/tenants/{name}", json={"daily_budget_usd": None, "monthly_budget_usd": None})

    rotated = admin(gw, "POST", f"/admin/keys/{prefix(key)}/rotate").json()
    assert rotated["tenant"] == name and rotated["key"] != key
    assert httpx.get(f"{gw.url}/v1/models", headers=bearer(key)).status_code == 401  # this replica: at once
    assert httpx.get(f"{gw.url}/v1/models", headers=bearer(rotated["key"])).status_code == 200
    listed = admin(gw, "GET", "/admin/keys", params={"tenant": name}).json()
    assert {k["prefix"] for k in listed} == {prefix(key), rotated["prefix"]} and "key" not in listed[0]
    assert admin(gw, "POST", f"/admin/keys/{rotated['prefix']}/revoke").json()["revoked_at"]
    assert admin(gw, "POST", f"/admin/keys/{rotated['prefix']}/revoke").status_code == 409

    audit = [e for e in admin(gw, "GET", "/admin/audit").json() if e["target"] in (name, prefix(key))]
    actions = [e["action"] for e in reversed(audit)]
    assert actions == ["tenant.create", "key.create", *["tenant.update"] * 4, "key.rotate"]
    first_update = next(e for e in reversed(audit) if e["action"] == "tenant.update")
    assert first_update["before"]["rpm"] == 5 and first_update["after"]["rpm"] == 7
    chosen = next(k["prefix"] for k in admin(gw, "GET", "/admin/keys", params={"tenant": "default"}).json()
                  if k["name"] == "bootstrap admin")
    assert first_update["actor"] == chosen  # the admin key that made the change
    # a key an operator chose is listed under a random prefix, not the start of its unsalted hash
    assert chosen != hash_key(ADMIN_KEY)[:8] and key_prefix(ADMIN_KEY) is None


def test_backpressure_refuses_with_503_when_the_queue_is_full_or_too_slow(tiny_model_dir, tmp_path):
    app = gateway_app({"tiny": tiny_backend(tiny_model_dir)}, tmp_path, max_in_flight=1, max_queued=1,
                      queue_timeout_s=0.5)
    with serve_app(app) as url:
        wait_ready(url)

        async def crowd():
            async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=60) as http:
                body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 20, "ignore_eos": True}
                first = asyncio.create_task(http.post("/v1/completions", json=body | {"max_tokens": 1500}))
                await asyncio.sleep(0.3)
                queued = asyncio.create_task(http.post("/v1/completions", json=body))
                await asyncio.sleep(0.1)
                scraped = (await http.get("/metrics")).text
                full = await http.post("/v1/completions", json=body)
                return await first, await queued, full, scraped

        first, queued, full, scraped = asyncio.run(crowd())
    assert "\nservegate_saturation 2.0\n" in scraped  # one in flight and one queued, on one slot
    assert first.status_code == 200
    assert queued.status_code == 503 and "no capacity freed within 0.5 s" in queued.json()["error"]["message"]
    assert full.status_code == 503 and "saturated" in full.json()["error"]["message"]
    assert queued.headers["retry-after"] and full.json()["error"]["code"] == "overloaded"


def test_a_chat_prompt_is_templated_and_tokenized_once_per_request(gw, monkeypatch):
    """The quota reservation counts the prompt's tokens; the engine then generates from those same
    ids, handed to it in the request, instead of templating and tokenizing the messages again."""
    _, key = tenant_with_key(gw)
    backend = gw.backends["tiny"]
    tokenizer = backend.tokenizer
    calls, original = [], tokenizer.apply_chat_template
    monkeypatch.setattr(tokenizer, "apply_chat_template", lambda *a, **k: calls.append(1) or original(*a, **k))
    reply = client(gw, key).chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                                    max_tokens=2)
    assert reply.usage.prompt_tokens > 0 and len(calls) == 1  # the ids travel in the request (`tokenized`)


def test_usage_over_time_per_key_with_percentiles_csv_and_tenant_isolation(gw):
    """The console's charts: requests, errors, tokens and TTFT p50/p95 per minute and key, the same
    as CSV; a tenant's administrator sees only its own tenant's series."""
    name, key = tenant_with_key(gw)
    second = admin(gw, "POST", "/admin/keys", json={"tenant": name, "scopes": ["inference", "admin"]}).json()["key"]
    away_from_minute_edge()
    for used, count in ((key, 3), (second, 2)):
        for _ in range(count):
            client(gw, used).completions.create(model="tiny", prompt="Hello", max_tokens=3,
                                                extra_body={"ignore_eos": True})
    usage_records(gw.url, name, count=5)
    series = admin(gw, "GET", "/admin/usage/series", params={"tenant": name, "bucket": "minute", "by": "key"}).json()
    assert series["bucket"] == "minute" and series["by"] == "key" and not series["truncated"]
    lines = {line["group"]: line["points"] for line in series["series"]}
    assert {k: sum(p["requests"] for p in points) for k, points in lines.items()} == {prefix(key): 3, prefix(second): 2}
    (point,) = lines[prefix(key)]
    assert point["completion_tokens"] == 9 and point["errors"] == 0 and point["at"].endswith(":00Z")
    assert 0 < point["ttft_p50_ms"] <= point["ttft_p95_ms"]
    csv_text = admin(gw, "GET", "/admin/usage/series.csv", params={"tenant": name, "bucket": "minute", "by": "key"})
    assert csv_text.headers["content-type"].startswith("text/csv")
    rows = csv_text.text.strip().splitlines()
    assert rows[0].startswith("key,at,requests,errors,prompt_tokens,completion_tokens,cost_usd,ttft_p50_ms")
    assert sorted(row.split(",")[0] for row in rows[1:]) == sorted([prefix(key), prefix(second)])
    own = httpx.get(f"{gw.url}/admin/usage/series", headers=bearer(second), params={"by": "tenant"}).json()
    assert [line["group"] for line in own["series"]] == [name]  # the tenant admin's reach: its own tenant
    assert httpx.get(f"{gw.url}/admin/usage/series", headers=bearer(second),
                     params={"tenant": "default"}).status_code == 404
    assert httpx.get(f"{gw.url}/admin/backends", headers=bearer(second)).status_code == 403
    me = httpx.get(f"{gw.url}/admin/me", headers=bearer(second)).json()
    assert me == {"subject": prefix(second), "tenant": name, "scopes": ["admin", "inference"], "operator": False}
    assert httpx.get(f"{gw.url}/admin/me", headers=bearer(key)).status_code == 403  # inference only
    assert admin(gw, "GET", "/admin/me").json()["operator"] is True


def test_backends_and_a_missing_canary_as_the_console_reads_them(gw):
    backends = admin(gw, "GET", "/admin/backends").json()
    assert {b["name"] for b in backends} == {"tiny", "tiny-b"}
    tiny = next(b for b in backends if b["name"] == "tiny")
    assert tiny["health"] == "ready" and tiny["runtime"] == "builtin" and not tiny["breaker_open"]
    assert 0 <= tiny["kv_usage"] <= 1 and tiny["in_flight"] == 0 and tiny["saturation"] == 0
    missing = admin(gw, "GET", "/admin/routes/nowhere/canary")
    assert missing.status_code == 404 and "runs no canary" in missing.json()["error"]["message"]
