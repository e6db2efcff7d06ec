"""The gateway under hostile input and faults, one test per incident: nothing heavy on the event
loop, every number from outside bounded, a ledger no record can stop, reservations that cover
what becomes prompt tokens, budgets that outlive a restart, slots that are leases, streams billed
after a crash, dates at the edges of time, and the smaller findings."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import threading
import time
import uuid
from types import SimpleNamespace

import httpx
import pytest
import redis
from sqlmodel import Session, select

from advisor.measure.baselines import free_port, servegate_command
from backends.base import GenerateRequest
from backends.builtin.backend import BuiltinBackend
from backends.builtin.config import EngineConfig
from gateway.db import make_engine, upgrade
from gateway.tables import UsageRecord
from gateway.tenancy.ledger import QUARANTINE, UsageLedger
from gateway.tenancy.quotas import QuotaExceeded, QuotaLimits, RedisQuotaStore, Scope
from gateway.tenancy.tenants import KeyIn, TenantIn, bootstrap, create_key, create_tenant

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
from .test_ledger import record
from .upstreams import answer, gateway_over, piece, remote, tenant_with_key

PRICE = {"input": 1000, "output": 1000}  # USD per million tokens: a token costs $0.001


@pytest.fixture(scope="module")
def engine_gw(tiny_model_dir, tmp_path_factory):
    """A gateway on the built-in engine (a thread of this process, its tokenizer reachable)."""
    home = tmp_path_factory.mktemp("engine-gw")
    backend = BuiltinBackend(EngineConfig(model=str(tiny_model_dir), dtype="float64", served_name="tiny",
                                          kv_cache_tokens=4096, engine_process=False), "tiny")
    app = gateway_app({"tiny": backend}, home, refresh_s=0.3)
    with serve_app(app) as url:
        wait_ready(url)
        yield SimpleNamespace(url=url, gateway=app.state.gateway, backend=backend)


def new_tenant(gw, **limits) -> tuple[str, str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    assert httpx.post(f"{gw.url}/admin/tenants", headers=AUTH, json={"name": name, **limits}).status_code == 201
    return name, httpx.post(f"{gw.url}/admin/keys", headers=AUTH, json={"tenant": name}).json()["key"]


class Probe:
    """`/health` asked every 20 ms on a thread of its own while something else runs: the slowest answer."""

    def __init__(self, url: str) -> None:
        self.url, self.slowest, self._stop = url, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=60) as http:
            while not self._stop.is_set():
                started = time.monotonic()
                answered = http.get(f"{self.url}/health").status_code == 200
                self.slowest = max(self.slowest, time.monotonic() - started if answered else float("inf"))
                time.sleep(0.02)

    def __enter__(self) -> Probe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


# -- 1 and 2: nothing heavy on the event loop, nothing counted for a tenant over its quota ---------
@pytest.mark.slow
def test_tokenize_is_charged_to_quotas_and_a_text_past_the_context_is_refused_untokenized(engine_gw):
    _, key = new_tenant(engine_gw, rpm=2)
    tokenize = f"{engine_gw.url}/tokenize"
    spans = httpx.post(tokenize, headers=bearer(key), json={"inputs": "Hello world"})
    assert spans.status_code == 200 and [t["text"] for t in spans.json()][:2] == ["Hello", " world"]
    huge = "lorem ipsum " * 400_000  # 4.8 MB, far past the model's context of 2,048 tokens
    with Probe(engine_gw.url) as probe:
        with httpx.Client(timeout=120) as http:
            refused = http.post(tokenize, headers=bearer(key), json={"inputs": huge})
    assert refused.status_code == 422 and "context" in refused.json()["error"], refused.text[:300]
    assert probe.slowest < 1.0, f"/health waited {probe.slowest:.2f} s while the text was refused"
    assert httpx.post(tokenize, headers=bearer(key), json={"inputs": "hi"}).status_code == 200
    over = httpx.post(tokenize, headers=bearer(key), json={"inputs": "hi"})  # the minute's third
    assert over.status_code == 429 and "requests per minute" in over.json()["error"]


@pytest.mark.slow
def test_a_large_prompt_over_its_tenants_quota_is_refused_before_it_is_tokenized(engine_gw, monkeypatch):
    _, key = new_tenant(engine_gw, rpm=1)
    chat = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(f"{engine_gw.url}/v1/chat/completions", headers=bearer(key), json=chat).status_code == 200
    tokenizer, encoded = engine_gw.backend.tokenizer, []
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: encoded.append(1) or type(tokenizer).encode(
        tokenizer, *a, **k))
    large = dict(chat, messages=[{"role": "user", "content": "words and " * 8_000}])  # 80 KB, within the context
    refused = httpx.post(f"{engine_gw.url}/v1/chat/completions", headers=bearer(key), json=large, timeout=60)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert not encoded, "the prompt was tokenized for a tenant already over its quota"


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize", "/generate"])
def test_a_large_body_from_a_caller_over_quota_is_refused_before_it_is_read(engine_gw, path):
    """Headers declaring 5 MB and no body at all: the refusal comes from the headers alone."""
    import socket

    _, key = new_tenant(engine_gw, rpm=1)
    assert httpx.post(f"{engine_gw.url}/tokenize", headers=bearer(key), json={"inputs": "hi"}).status_code == 200
    host, port = engine_gw.url.removeprefix("http://").split(":")
    for token, status in ((key, 429), ("sg_00000000_" + "x" * 43, 401)):
        with socket.create_connection((host, int(port)), timeout=5) as connection:
            connection.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
                               "Content-Type: application/json\r\nContent-Length: 5000000\r\n\r\n".encode())
            head = connection.recv(4096).decode()
        assert head.startswith(f"HTTP/1.1 {status}"), head[:200]


# -- 3: one impossible figure from an upstream, or in a spool, stops nothing ----------------------------
@pytest.mark.slow
@pytest.mark.parametrize("with_redis", [False, pytest.param(True, marks=needs_redis)], ids=["in-process", "redis"])
def test_an_upstream_reporting_2_to_the_63_prompt_tokens_poisons_no_later_request(tmp_path, with_redis):
    reports = iter([2**63] + [3] * 5)

    async def usage_from_reports():
        prompt = next(reports)
        async for chunk in answer(count=4):
            yield piece(None, usage={"prompt_tokens": prompt, "completion_tokens": 4}) if b'"usage": {' in chunk \
                else chunk

    settings = {"redis_url": REDIS_URL} if with_redis else {}
    with gateway_over({"remote": openai_upstream(lambda path: usage_from_reports())}, tmp_path,
                      usage_flush_s=0.1, **settings) as gw:
        tenant, key = tenant_with_key(gw, tpm=100_000)
        for _ in range(6):
            reply = httpx.post(f"{gw.url}/v1/completions", headers=bearer(key),
                               json={"model": "remote", "prompt": "hi", "max_tokens": 10})
            assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] < 100
        records = usage_records(gw.url, tenant, 6)
        assert len(records) == 6 and all(r["prompt_tokens"] < 100 for r in records)
        assert httpx.get(f"{gw.url}/ready").status_code == 200
        if with_redis:  # the settlements landed: the day's window holds what the ledger billed
            day = int(time.time() // 86_400)
            held = int(redis.Redis.from_url(REDIS_URL).get(f"sg:q:tenant:{tenant}:tpd:{day}"))
            assert held == sum(r["prompt_tokens"] + r["completion_tokens"] for r in records)


def test_a_spool_record_the_database_refuses_is_quarantined_and_the_rest_flows(tmp_path):
    db = make_engine(f"sqlite:///{tmp_path}/db.sqlite")
    upgrade(db)
    crashed = UsageLedger(db, tmp_path / "spool")
    crashed.record(record("before"))
    crashed.record(record("poisoned") | {"prompt_tokens": 2**63})  # as an earlier version spooled it
    crashed.record(record("after"))
    os.close(crashed.fd)  # its process died: the spool is an orphan
    survivor = UsageLedger(db, tmp_path / "spool")
    assert survivor.recover_orphans().records == 2
    with Session(db) as session:
        assert sorted(session.exec(select(UsageRecord.request_id)).all()) == ["after", "before"]
    kept = [json.loads(line) for line in (tmp_path / "spool" / QUARANTINE).read_text().splitlines()]
    assert [json.loads(k["line"])["request_id"] for k in kept] == ["poisoned"] and "prompt_tokens" in kept[0]["reason"]
    assert survivor.quarantined == 1
    survivor.record(record("later"))
    assert survivor.flush() == 1


@pytest.mark.slow
def test_a_dead_ledger_writer_turns_ready_unready_until_it_is_restarted(engine_gw, monkeypatch):
    gateway = engine_gw.gateway
    died = threading.Event()

    def dies() -> int:
        died.set()
        raise RuntimeError("the writer's bug")

    monkeypatch.setattr(gateway.ledger, "flush", dies)
    assert died.wait(10)
    deadline = time.monotonic() + 5
    while (ready := httpx.get(f"{engine_gw.url}/ready")).status_code == 200:
        assert time.monotonic() < deadline, "ready stayed 200 with the writer dead"
        time.sleep(0.02)
    assert "usage ledger writer" in ready.json()["down"] and "the writer's bug" in ready.text
    monkeypatch.undo()
    deadline = time.monotonic() + 10
    while httpx.get(f"{engine_gw.url}/ready").status_code != 200:
        assert time.monotonic() < deadline, "the writer was never restarted"
        time.sleep(0.1)
    assert httpx.get(f"{engine_gw.url}/metrics").text.count("servegate_usage_quarantined_records") >= 1


def test_numbers_a_runtime_reports_are_bounded_before_use():
    from backends.base import UpstreamError, reported_count
    from backends.openai_compat import error_from_body

    figures = (4096, "4096", -1, 2**63, float("nan"), float("inf"), "9" * 5000, True, None, 1500.0)
    assert [reported_count(v) for v in figures] == [4096, 4096, 0, 0, 0, 0, 0, 0, 0, 1500]
    # an error event's code of 5,000 digits (int() refuses past 4,300) is no HTTP status
    assert isinstance(error_from_body({"error": {"message": "x", "code": "9" * 5000}}), UpstreamError)


# -- 4: what becomes prompt tokens is reserved -----------------------------------------------------
@pytest.mark.slow
def test_tools_and_template_arguments_count_in_a_remote_backends_reservation(tmp_path):
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": "Looks a thing up. " * 5,
                                               "parameters": {"type": "object", "properties": {
                                                   "query": {"type": "string", "description": "what to find"}}}}}
             for i in range(40)]
    messages = [{"role": "user", "content": "hi"}]
    extra = {"tools": tools, "chat_template_kwargs": {"enable_thinking": True}}
    counted = asyncio.run(remote("http://127.0.0.1:9").count_prompt_tokens(
        GenerateRequest("r", messages=messages, extra=extra)))
    assert counted >= len(json.dumps(tools)), counted
    with gateway_over({"remote": openai_upstream(lambda path: answer(count=2))}, tmp_path) as gw:
        _, key = tenant_with_key(gw, tpm=4000)  # the model's context (4,096) caps a reservation's prompt
        refused = httpx.post(f"{gw.url}/v1/chat/completions", headers=bearer(key),
                             json={"model": "remote", "messages": messages, "tools": tools, "max_tokens": 10})
        assert refused.status_code == 400 and "more than tenant" in refused.json()["error"]["message"]


# -- 5: budgets outlive a restart without Redis, and Redis restarted empty -----------------------------
@pytest.mark.slow
@pytest.mark.parametrize("store", ["in-process", pytest.param("redis", marks=needs_redis)])
def test_a_spent_budget_stays_spent_across_a_restart(tmp_path, store):
    settings = {"prices": {"remote": PRICE}, "usage_flush_s": 0.1}
    if store == "redis":
        settings["redis_url"] = REDIS_URL.rsplit("/", 1)[0] + "/9"  # a database of its own, emptied below
    body = {"model": "remote", "prompt": "hi", "max_tokens": 10}
    with gateway_over({"remote": openai_upstream(lambda path: answer(count=10))}, tmp_path, **settings) as gw:
        tenant, key = tenant_with_key(gw, daily_budget_usd="0.05")  # a request: ~13 tokens, $0.013
        served = 0
        while (reply := httpx.post(f"{gw.url}/v1/completions", headers=bearer(key), json=body)).status_code == 200:
            served += 1
        assert reply.status_code == 429 and reply.json()["error"]["code"] == "insufficient_quota" and served >= 2
        usage_records(gw.url, tenant, served)  # in the database
        if store == "redis":  # Redis restarted without persistence
            redis.Redis.from_url(settings["redis_url"]).flushdb()
    with gateway_over({"remote": openai_upstream(lambda path: answer(count=10))}, tmp_path, **settings) as gw:
        again = httpx.post(f"{gw.url}/v1/completions", headers=bearer(key), json=body)
        assert again.status_code == 429 and again.json()["error"]["code"] == "insufficient_quota", again.text


# -- 6: slots are leases; settlements land ---------------------------------------------------------
@pytest.mark.slow
@needs_redis
async def test_a_dead_replicas_slot_frees_after_its_lease_and_a_live_one_keeps_its_own():
    scope = Scope(f"tenant:{uuid.uuid4().hex}", QuotaLimits(max_concurrency=1))
    dead = RedisQuotaStore(REDIS_URL, lease_s=1.0)
    await dead.reserve((scope,), 1)  # then it dies: nobody renews that lease
    other = RedisQuotaStore(REDIS_URL, lease_s=1.0)
    with pytest.raises(QuotaExceeded):
        await other.reserve((scope,), 1)
    await asyncio.sleep(1.2)
    held = await other.reserve((scope,), 1)  # reclaimed within the lease, not the old 15 minutes
    renewing = asyncio.create_task(other.run())
    try:
        await asyncio.sleep(2.5)  # past two leases: renewed meanwhile
        with pytest.raises(QuotaExceeded):
            await dead.reserve((scope,), 1)
        await other.settle(held, 1)
        await dead.reserve((scope,), 1)
    finally:
        renewing.cancel()
        await dead.close()
        await other.close()


@needs_redis
async def test_a_settlement_that_cannot_reach_redis_is_retried_until_it_lands_once():
    scope = Scope(f"tenant:{uuid.uuid4().hex}", QuotaLimits(tpm=1000, max_concurrency=1))
    store = RedisQuotaStore(REDIS_URL)
    held = await store.reserve((scope,), 900)
    real, failures = store._settle_script, [redis.exceptions.TimeoutError("Timeout reading from socket")] * 2

    async def blip(**kwargs):
        if failures:
            raise failures.pop()
        return await real(**kwargs)

    store._settle_script = blip
    await store.settle(held, 100)
    await store.settle(dataclasses.replace(held, settled=False), 100)  # a retry of one that landed: a no-op
    window = f"sg:q:{scope.name}:tpm:{held.minute}"
    assert int(await store.redis.get(window)) == 100  # 800 of the 900 came back, once
    await store.reserve((scope,), 900)  # and the slot is free
    await store.close()


# -- 7: streams open at SIGKILL are billed -----------------------------------------------------------
@pytest.mark.slow
def test_streams_open_at_sigkill_are_billed_what_they_delivered(tmp_path):
    async def slow(count: int = 400):
        for _ in range(count):
            yield piece("tok ")
            await asyncio.sleep(0.02)
        yield piece("", "length")
        yield piece(None, usage={"prompt_tokens": 3, "completion_tokens": count, "total_tokens": count + 3})
        yield b"data: [DONE]\n\n"

    db_url = f"sqlite:///{tmp_path}/servegate.db"
    upgrade(make_engine(db_url))
    with Session(make_engine(db_url)) as session:
        bootstrap(session, ADMIN_KEY)
        create_tenant(session, "test", TenantIn(name="streams"))
        key = create_key(session, "test", KeyIn(tenant="streams")).key
    with serve_app(openai_upstream(lambda path: slow())) as upstream:
        config = tmp_path / "servegate.yaml"
        config.write_text(json.dumps({"backends": [{"name": "remote", "kind": "openai", "url": upstream,
                                                    "model": "stub"}]}))
        env = {**os.environ, "SERVEGATE_DATABASE_URL": db_url, "SERVEGATE_SPOOL_DIR": str(tmp_path / "spool"),
               "SERVEGATE_CHECKPOINT_S": "0.25"}

        def start(port: int) -> subprocess.Popen:
            command = [*servegate_command(port), "--config", str(config)]
            process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wait_ready(f"http://127.0.0.1:{port}", process=process)
            return process

        port = free_port()
        doomed = start(port)
        delivered: dict[str, int] = {}

        async def read(http: httpx.AsyncClient) -> None:
            async with http.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json={
                    "model": "stub", "prompt": "hi", "max_tokens": 400, "stream": True}) as response:
                try:
                    async for line in response.aiter_lines():
                        if '"tok ' in line:
                            request_id = json.loads(line[5:])["id"]
                            delivered[request_id] = delivered.get(request_id, 0) + 1
                except httpx.HTTPError:
                    return  # cut off by the kill

        async def load() -> None:
            async with httpx.AsyncClient(headers=bearer(key), timeout=60) as http:
                readers = [asyncio.create_task(read(http)) for _ in range(5)]
                while sum(delivered.values()) < 5 * 60:
                    await asyncio.sleep(0.01)
                os.kill(doomed.pid, signal.SIGKILL)
                await asyncio.gather(*readers)

        asyncio.run(load())
        doomed.wait()
        survivor = start(free_port())  # takes the dead process's spool over
        try:
            deadline = time.monotonic() + 20
            while len(rows := _rows(db_url, "streams")) < 5:
                assert time.monotonic() < deadline, f"{len(rows)} of 5 interrupted streams billed"
                time.sleep(0.2)
        finally:
            survivor.terminate()
            survivor.wait(timeout=30)
    for row in rows:  # billed what it delivered, less at most one checkpoint interval (0.25 s: ~13 pieces)
        assert row.status == "interrupted" and delivered[row.request_id] - 15 <= row.completion_tokens, (
            row.request_id, delivered[row.request_id], row.completion_tokens)
        assert row.completion_tokens <= delivered[row.request_id] + 15


def _rows(db_url: str, tenant: str) -> list[UsageRecord]:
    with Session(make_engine(db_url)) as session:
        return list(session.exec(select(UsageRecord).where(UsageRecord.tenant == tenant)).all())


# -- 8: dates at the edges of time ---------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("path", ["/admin/usage", "/admin/usage/series", "/admin/usage/series.csv"])
@pytest.mark.parametrize("param, value", [("since", "0001-01-01T00:00:00+00:01"),
                                          ("until", "9999-12-31T23:59:59-14:00")])
def test_usage_dates_outside_utcs_years_are_refused_by_name(engine_gw, path, param, value):
    reply = httpx.get(f"{engine_gw.url}{path}", headers=AUTH, params={param: value})
    assert reply.status_code == 400 and param in reply.text and "9999" in reply.text, reply.text


# -- 9: the smaller findings ------------------------------------------------------------------------
@pytest.mark.slow
def test_the_smaller_findings(engine_gw, tmp_path):
    assert httpx.get(f"{engine_gw.url}/docs").status_code == 404  # no third-party scripts on the console's origin
    assert httpx.get(f"{engine_gw.url}/redoc").status_code == 404
    assert httpx.get(f"{engine_gw.url}/openapi.json").status_code == 200
    name, _ = new_tenant(engine_gw)
    created = httpx.post(f"{engine_gw.url}/admin/keys", headers=AUTH, json={"tenant": name})
    rotated = httpx.post(f"{engine_gw.url}/admin/keys/{created.json()['prefix']}/rotate", headers=AUTH)
    assert created.headers["cache-control"] == rotated.headers["cache-control"] == "no-store"
    odd = httpx.post(f"{engine_gw.url}/v1/chat/completions", headers=AUTH, json={
        "model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi", "house_secret": 1}]})
    assert odd.status_code == 400 and "house_secret" in odd.text
    async def recorded(path):
        yield piece("ok", "stop")
        yield b"data: [DONE]\n\n"

    upstream = openai_upstream(lambda path: recorded(path))
    with gateway_over({"remote": upstream}, tmp_path) as gw:
        gw.gateway.fleet["remote"].backend.config.extra_fields = ["chat_template_kwargs"]
        chat = {"model": "remote", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
        swapped = httpx.post(f"{gw.url}/v1/chat/completions", headers=AUTH, json=chat | {
            "chat_template_kwargs": {"chat_template": "{{ raise_exception('mine') }}"}})
        assert swapped.status_code == 400 and swapped.json()["error"]["param"] == "chat_template_kwargs.chat_template"
        thinking = httpx.post(f"{gw.url}/v1/chat/completions", headers=AUTH, json=chat | {
            "chat_template_kwargs": {"enable_thinking": False}})
        assert thinking.status_code == 200, thinking.text
