"""Quota stores, in process and on a real Redis, and two gateway processes sharing one Redis."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from decimal import Decimal

import httpx
import pytest
import pytest_asyncio
from sqlmodel import Session

from advisor.measure.baselines import free_port, servegate_command, server_process
from gateway.db import make_engine, upgrade
from gateway.tenancy.quotas import MemoryQuotaStore, QuotaExceeded, QuotaLimits, RedisQuotaStore, Scope
from gateway.tenancy.tenants import KeyIn, TenantIn, bootstrap, create_key, create_tenant

from .conftest import ADMIN_KEY, AUTH, REDIS_URL, away_from_minute_edge, needs_redis, serve_app


@pytest_asyncio.fixture(params=["memory", pytest.param("redis", marks=needs_redis)], loop_scope="function")
async def store(request):
    made = MemoryQuotaStore() if request.param == "memory" else RedisQuotaStore(REDIS_URL)
    yield made
    await made.close()


def scope(**limits) -> Scope:
    return Scope(f"tenant:{uuid.uuid4().hex}", QuotaLimits(**limits))


async def test_token_reservations_settle_to_actual_use(store):
    tenant = scope(tpm=100)
    first = await store.reserve((tenant,), 60)
    with pytest.raises(QuotaExceeded) as refused:
        await store.reserve((tenant,), 50)
    assert refused.value.limit == "tpm" and 1 <= refused.value.retry_after <= 60
    await store.reserve((tenant,), 40)  # the refusal charged nothing
    await store.settle(first, 10)  # 50 of the 60 come back
    await store.settle(first, 10)  # settling twice changes nothing
    await store.reserve((tenant,), 50)
    with pytest.raises(QuotaExceeded):
        await store.reserve((tenant,), 1)
    daily = scope(tokens_per_day=100)
    await store.reserve((daily,), 100)
    with pytest.raises(QuotaExceeded) as spent:
        await store.reserve((daily,), 1)
    assert spent.value.limit == "tokens_per_day" and "tokens per day limit 100" in spent.value.message


async def test_concurrency_slots_and_every_scope_checked(store):
    tenant, key = scope(max_concurrency=2), scope(rpm=2)
    a = await store.reserve((tenant, key), 1)
    await store.reserve((tenant, key), 1)
    with pytest.raises(QuotaExceeded) as busy:
        await store.reserve((tenant,), 1)
    assert busy.value.limit == "max_concurrency" and busy.value.scope == tenant.name
    await store.settle(a, 1)
    with pytest.raises(QuotaExceeded) as by_key:  # a slot is free, but the key's rpm is spent
        await store.reserve((tenant, key), 1)
    assert by_key.value.scope == key.name and by_key.value.limit == "rpm"
    await store.reserve((tenant,), 1)


async def test_budgets_reserve_what_a_request_may_cost_and_each_threshold_is_crossed_once(store):
    tenant = scope(daily_budget=1000, monthly_budget=5000)  # nano-dollars
    first = await store.reserve((tenant,), 10, cost=600)
    with pytest.raises(QuotaExceeded) as refused:  # 600 reserved + 500 would pass the budget
        await store.reserve((tenant,), 10, cost=500)
    assert refused.value.limit == "daily_budget" and refused.value.budget
    assert "of its daily budget of $0.000001 spent or reserved" in refused.value.message
    assert 1 <= refused.value.retry_after <= 86_400
    assert await store.settle(first, 5, cost=500) == []  # 100 of the 600 come back; 500 spent
    crossings = []
    for cost in (300, 200):  # 800 spent: 80% of the day; 1000: 100%
        held = await store.reserve((tenant,), 10, cost=cost)
        crossings += await store.settle(held, 10, cost=cost)
        assert await store.settle(held, 10, cost=cost) == []  # settling twice changes nothing
    day = time.strftime("%Y-%m-%d", time.gmtime())
    assert [(c.budget, c.window, c.percent, c.spent, c.limit) for c in crossings] == [
        ("daily_budget", day, 80, 800, 1000), ("daily_budget", day, 100, 1000, 1000)]
    with pytest.raises(QuotaExceeded) as spent:
        await store.reserve((tenant,), 1, cost=1)
    assert spent.value.limit == "daily_budget"
    free = await store.reserve((tenant,), 1, cost=0)  # an unpriced model costs nothing
    assert await store.settle(free, 1, cost=0) == []
    assert (await store.settle(await store.reserve((scope(monthly_budget=1250),), 1, cost=1250), 1, cost=1250))[0] \
        .window == time.strftime("%Y-%m", time.gmtime())


async def test_redis_unreachable_falls_back_to_limits_in_process():
    store = RedisQuotaStore("redis://127.0.0.1:1/0")
    tenant = scope(rpm=1)
    held = await store.reserve((tenant,), 5)
    assert held.local
    with pytest.raises(QuotaExceeded):
        await store.reserve((tenant,), 5)
    await store.settle(held, 1)
    await store.close()


@needs_redis
@pytest.mark.slow
def test_two_gateway_processes_sharing_redis_admit_exactly_the_limit(tiny_model_dir, tmp_path):
    db_url = f"sqlite:///{tmp_path}/servegate.db"
    upgrade(make_engine(db_url))
    with Session(make_engine(db_url)) as session:
        name = f"shared-{uuid.uuid4().hex[:8]}"
        create_tenant(session, "test", TenantIn(name=name, rpm=10, tpm=10_000))
        key = create_key(session, "test", KeyIn(tenant=name)).key
    env = {"SERVEGATE_DATABASE_URL": db_url, "SERVEGATE_REDIS_URL": REDIS_URL,
           "SERVEGATE_SPOOL_DIR": str(tmp_path / "spool"), "SERVEGATE_ADMIN_KEY": "sg-unused-admin-key"}
    command = [*servegate_command(0, str(tiny_model_dir)), "--served-name", "tiny", "--kv-cache-tokens", "2048"]
    ports = [free_port(), free_port()]
    with server_process(_on_port(command, ports[0]), f"http://127.0.0.1:{ports[0]}", "/ready", env=env) as a, \
            server_process(_on_port(command, ports[1]), f"http://127.0.0.1:{ports[1]}", "/ready", env=env) as b:
        away_from_minute_edge(margin=15)

        async def burst():
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
                return await asyncio.gather(*(http.post(f"{(a, b)[i % 2]}/v1/completions", json={
                    "model": "tiny", "prompt": "hi", "max_tokens": 1}) for i in range(50)))

        replies = asyncio.run(burst())
    statuses = [r.status_code for r in replies]
    # 25 requests reached each process; with limits held per process, 20 would have passed.
    assert statuses.count(200) == 10 and statuses.count(429) == 40


@needs_redis
@pytest.mark.slow
def test_a_daily_budget_of_one_dollar_stops_at_exactly_one_dollar_across_two_replicas(tiny_model_dir, tmp_path):
    """Four prompt tokens and six completion tokens at $25,000 per million cost $0.25, reserved and
    spent alike: of ten requests at once, split over two gateway processes sharing Redis, exactly
    four are served, the ledger holds exactly $1.00, and one alert each for 80% and 100% is sent."""
    alerts = []

    async def webhook(scope, receive, send):
        body = b""
        while (message := await receive())["type"] == "http.request":
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        alerts.append(json.loads(body))
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    db_url = f"sqlite:///{tmp_path}/servegate.db"
    upgrade(make_engine(db_url))
    name = f"budget-{uuid.uuid4().hex[:8]}"
    with Session(make_engine(db_url)) as session:
        bootstrap(session, ADMIN_KEY)
        create_tenant(session, "test", TenantIn(name=name, daily_budget_usd=Decimal("1.00")))
        key = create_key(session, "test", KeyIn(tenant=name)).key
    command = [*servegate_command(0, str(tiny_model_dir)), "--served-name", "tiny", "--kv-cache-tokens", "2048"]
    ports = [free_port(), free_port()]
    with serve_app(webhook) as hook:
        env = {"SERVEGATE_DATABASE_URL": db_url, "SERVEGATE_REDIS_URL": REDIS_URL,
               "SERVEGATE_SPOOL_DIR": str(tmp_path / "spool"), "SERVEGATE_ADMIN_KEY": ADMIN_KEY,
               "SERVEGATE_USAGE_FLUSH_S": "0.1", "SERVEGATE_BUDGET_WEBHOOK_URL": hook,
               "SERVEGATE_PRICES": json.dumps({"tiny": {"input": 25_000, "output": 25_000}})}
        with server_process(_on_port(command, ports[0]), f"http://127.0.0.1:{ports[0]}", "/ready", env=env) as a, \
                server_process(_on_port(command, ports[1]), f"http://127.0.0.1:{ports[1]}", "/ready", env=env) as b:
            if time.time() % 86_400 > 86_400 - 120:  # keep the day's window for the whole test
                time.sleep(86_400 - time.time() % 86_400 + 1)
            body = {"model": "tiny", "prompt": [1, 2, 3, 4], "max_tokens": 6, "ignore_eos": True}
            headers = {"Authorization": f"Bearer {key}"}
            too_dear = httpx.post(f"{a}/v1/completions", headers=headers, json=body | {"max_tokens": 40})
            assert too_dear.status_code == 400 and too_dear.json()["error"]["code"] == "budget_exceeded"

            async def burst():
                async with httpx.AsyncClient(headers=headers, timeout=60) as http:
                    return await asyncio.gather(*(http.post(f"{(a, b)[i % 2]}/v1/completions", json=body)
                                                  for i in range(10)))

            replies = asyncio.run(burst())
            assert sorted(r.status_code for r in replies) == [200] * 4 + [429] * 6
            assert all(r.json()["usage"]["total_tokens"] == 10 for r in replies if r.status_code == 200)
            refused = next(r for r in replies if r.status_code == 429)
            assert refused.json()["error"]["code"] == "insufficient_quota" and int(refused.headers["retry-after"]) > 0
            deadline = time.monotonic() + 15
            while (totals := httpx.get(f"{a}/admin/usage", params={"tenant": name}, headers=AUTH).json()["totals"]
                   )["requests"] < 4 or len(alerts) < 2:
                assert time.monotonic() < deadline, (totals, alerts)
                time.sleep(0.1)
            time.sleep(0.5)  # an alert sent twice would have arrived by now
    assert totals == {"requests": 4, "prompt_tokens": 16, "completion_tokens": 24, "cached_tokens": 0, "cost_usd": "1"}
    day = time.strftime("%Y-%m-%d", time.gmtime())
    assert sorted((x["percent"], x["scope"], x["window"], x["spent_usd"], x["budget_usd"]) for x in alerts) == [
        (80, f"tenant:{name}", day, "1", "1"), (100, f"tenant:{name}", day, "1", "1")]


def _on_port(command: list[str], port: int) -> list[str]:
    command = list(command)
    command[command.index("--port") + 1] = str(port)
    return command
