"""Quota stores, in process and on a real Redis, and two gateway processes sharing one Redis."""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import pytest
import pytest_asyncio
from sqlmodel import Session

from advisor.bench.baselines import free_port, servegate_command, server_process
from gateway.db import make_engine, upgrade
from gateway.quotas import MemoryQuotaStore, QuotaExceeded, QuotaLimits, RedisQuotaStore, Scope
from gateway.tenancy import KeyIn, TenantIn, create_key, create_tenant

from .conftest import REDIS_URL, needs_redis


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
        if time.time() % 60 > 45:  # keep the burst inside one one-minute window
            time.sleep(61 - time.time() % 60)

        async def burst():
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
                return await asyncio.gather(*(http.post(f"{(a, b)[i % 2]}/v1/completions", json={
                    "model": "tiny", "prompt": "hi", "max_tokens": 1}) for i in range(50)))

        replies = asyncio.run(burst())
    statuses = [r.status_code for r in replies]
    # 25 requests reached each process; with limits held per process, 20 would have passed.
    assert statuses.count(200) == 10 and statuses.count(429) == 40


def _on_port(command: list[str], port: int) -> list[str]:
    command = list(command)
    command[command.index("--port") + 1] = str(port)
    return command
