"""Three `servegate serve` replicas sharing Redis and PostgreSQL under a steady mixed load, with
faults injected while it runs: one replica SIGKILLed with streams open, Redis paused for 5 s,
Redis restarted empty, PostgreSQL restarted. Afterwards every token a client received is in the
ledger (less, for a stream cut by the kill, at most one checkpoint interval of it), no budget is
passed by more than one request's reservation, no tenant is refused a concurrency slot longer
than the lease after the fault, and no request outside a fault's window gets a 5xx. The report
(delivered against billed per tenant, the survivors' p99 latency during each fault) is printed
at the end of the run."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import glob
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from decimal import Decimal

import httpx
import pytest
from sqlalchemy import text
from sqlmodel import Session, select

from advisor.measure import stub as bench_stub
from advisor.measure.baselines import free_port, servegate_command
from gateway.db import make_engine, upgrade
from gateway.operations.telemetry import percentile
from gateway.tables import UsageRecord
from gateway.tenancy.tenants import KeyIn, TenantIn, create_key, create_tenant

from . import conftest
from .conftest import POSTGRES_URL, bearer, needs_postgres, serve_app, wait_ready
from .upstreams import piece

PIECE_S = 0.02  # the stub upstream's pace: 50 tokens a second
CHECKPOINT_S, LEASE_S = 0.5, 3.0
BOUND = int(CHECKPOINT_S / PIECE_S) + 3  # tokens of a stream the kill may take off its bill
PRICE = {"input": 1000, "output": 1000}  # USD per million tokens: $0.001 a token
BUDGET = Decimal("0.4")
LOAD_S = 46.0
# When each fault starts and how long after it errors are the fault's (seconds from the load's start).
FAULTS = {"replica SIGKILLed": (10.0, 6.0), "Redis paused 5 s": (18.0, 9.0), "Redis restarted empty": (30.0, 6.0),
          "PostgreSQL restarted": (38.0, 6.0)}

pytestmark = [pytest.mark.slow, needs_postgres,
              pytest.mark.skipif(not shutil.which("redis-server"), reason="no redis-server to start and fault"),
              pytest.mark.skipif(not (shutil.which("pg_ctlcluster") and glob.glob("/etc/postgresql/*/main")),
                                 reason="no PostgreSQL cluster this test may restart (pg_ctlcluster)")]


async def slow_stream(count: int):
    for _ in range(count):
        yield piece("tok ")
        await asyncio.sleep(PIECE_S)
    yield piece("", "length")
    yield piece(None, usage={"prompt_tokens": 3, "completion_tokens": count, "total_tokens": count + 3})
    yield b"data: [DONE]\n\n"


async def stub(scope, receive, send):
    """An OpenAI-compatible upstream streaming `max_tokens` pieces at PIECE_S each."""
    if scope["type"] != "http":
        return
    if scope["method"] == "GET":
        return await bench_stub.app(scope, receive, send)
    count = int(json.loads(await bench_stub.read_body(receive)).get("max_tokens") or 8)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    async for chunk in slow_stream(count):
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


class RedisServer:
    """A Redis of the test's own, to pause and to restart empty."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                         "--appendonly", "no"], stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True).stdout != b"PONG\n":
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


@dataclasses.dataclass
class Sent:
    tenant: str
    replica: int
    started: float  # seconds from the load's start
    ended: float = 0.0
    status: int | None = None  # None: the connection broke
    request_id: str | None = None
    delivered: int = 0  # tokens the client received (pieces with text)
    concurrency_refused: bool = False
    long: bool = False  # a stream kept open across the kill (left out of the latency figures)


def test_three_replicas_through_a_kill_a_redis_pause_an_empty_redis_and_a_postgres_restart(tiny_model_dir,
                                                                                          tmp_path):
    schema = f"sg_{uuid.uuid4().hex[:12]}"
    admin_db = make_engine(POSTGRES_URL)
    with admin_db.begin() as connection:
        connection.execute(text(f"CREATE SCHEMA {schema}"))
    db_url = f"{POSTGRES_URL}?options=-csearch_path%3D{schema}"
    db = make_engine(db_url)
    upgrade(db)
    limits = {"steady": {"rpm": 10_000, "tpm": 10_000_000}, "tight": {"rpm": 30},
              "pair": {"max_concurrency": 2}, "budget": {"daily_budget_usd": BUDGET}}
    keys = {}
    with Session(db) as session:
        for name, tenant_limits in limits.items():
            create_tenant(session, "test", TenantIn(name=name, **tenant_limits))
            keys[name] = create_key(session, "test", KeyIn(tenant=name)).key
    redis_server = RedisServer()
    redis_server.start()
    cluster = glob.glob("/etc/postgresql/*/main")[0].split("/")[3]
    replicas: list[subprocess.Popen] = []
    try:
        with serve_app(stub) as upstream:
            config = tmp_path / "servegate.yaml"
            config.write_text(json.dumps({"backends": [
                {"name": "stub", "kind": "openai", "url": upstream, "model": "stub"},
                {"name": "tiny", "kind": "builtin", "model": str(tiny_model_dir), "served_name": "tiny",
                 "options": {"kv_cache_tokens": 2048, "dtype": "float32"}}]}))
            env = {**os.environ, "SERVEGATE_DATABASE_URL": db_url, "SERVEGATE_REDIS_URL": redis_server.url,
                   "SERVEGATE_SPOOL_DIR": str(tmp_path / "spool"), "SERVEGATE_USAGE_FLUSH_S": "0.2",
                   "SERVEGATE_CHECKPOINT_S": str(CHECKPOINT_S), "SERVEGATE_RECOVER_S": "1",
                   "SERVEGATE_QUOTA_LEASE_S": str(LEASE_S), "SERVEGATE_REFRESH_S": "1",
                   "SERVEGATE_PRICES": json.dumps({"stub": PRICE, "tiny": PRICE})}
            ports = [free_port() for _ in range(3)]
            for port in ports:
                replicas.append(subprocess.Popen([*servegate_command(port), "--config", str(config)], env=env,
                                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            for port, process in zip(ports, replicas):  # every backend loaded, the engine too
                wait_ready(f"http://127.0.0.1:{port}", timeout=300, process=process)
                deadline = time.monotonic() + 300
                while set(httpx.get(f"http://127.0.0.1:{port}/ready").json()["models"].values()) != {"ready"}:
                    assert time.monotonic() < deadline, "the engine never loaded"
                    time.sleep(0.2)
            sent = asyncio.run(_load([f"http://127.0.0.1:{p}" for p in ports], keys, replicas, redis_server, cluster))
            time.sleep(CHECKPOINT_S + 4)  # the survivors recover the dead replica's spool, flush and settle
    finally:
        for process in replicas:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
        for process in replicas:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=30)
        redis_server.stop()
        subprocess.run(["pg_ctlcluster", cluster, "main", "start"], capture_output=True)  # if its restart failed
    with Session(db) as session:
        rows = {r.request_id: r for r in session.exec(select(UsageRecord)).all()}
    with admin_db.begin() as connection:
        connection.execute(text(f"DROP SCHEMA {schema} CASCADE"))
    _check(sent, rows)


async def _load(urls, keys, replicas, redis_server, cluster) -> list[Sent]:
    start = time.monotonic()
    now = lambda: time.monotonic() - start  # noqa: E731
    sent: list[Sent] = []
    dead: set[int] = set()

    async def one(http: httpx.AsyncClient, tenant: str, replica: int, body: dict, path: str) -> Sent:
        record = Sent(tenant, replica, now(), long=body.get("max_tokens", 0) > 100)
        sent.append(record)
        try:
            if body.get("stream"):
                async with http.stream("POST", urls[replica] + path, json=body, headers=bearer(keys[tenant])) as r:
                    record.status = r.status_code
                    if r.status_code == 200:
                        async for line in r.aiter_lines():
                            if line.startswith("data: {"):
                                chunk = json.loads(line[6:])
                                record.request_id = chunk.get("id", record.request_id)
                                if any((c.get("delta") or {}).get("content") or c.get("text")
                                       for c in chunk.get("choices") or ()):
                                    record.delivered += 1
                    else:
                        await r.aread()
                        record.concurrency_refused = "concurrent requests" in r.text
            else:
                r = await http.post(urls[replica] + path, json=body, headers=bearer(keys[tenant]))
                record.status = r.status_code
                if r.status_code == 200:
                    record.request_id = r.json()["id"]
                    record.delivered = r.json()["usage"]["completion_tokens"]
                else:
                    record.concurrency_refused = "concurrent requests" in r.text
        except httpx.HTTPError:
            record.status = None  # the replica died under it
            dead.add(replica)
        record.ended = now()
        return record

    async def worker(tenant: str, number: int, bodies: list[tuple[str, dict]], pinned: int | None = None) -> None:
        """Requests one after another, over the live replicas in turn (or on `pinned` while it lives)."""
        async with httpx.AsyncClient(timeout=60) as http:
            turn = number
            while now() < LOAD_S:
                live = [i for i in range(len(urls)) if i not in dead]
                replica = pinned if pinned in live else live[turn % len(live)]
                path, body = bodies[turn % len(bodies)]
                done = await one(http, tenant, replica, body, path)
                turn += 1
                if done.status not in (200, None):
                    await asyncio.sleep(0.1)

    stream = ("/v1/completions", {"model": "stub", "prompt": "hi", "max_tokens": 60, "stream": True})
    whole = ("/v1/completions", {"model": "stub", "prompt": "hi", "max_tokens": 20})
    engine = ("/v1/chat/completions", {"model": "tiny", "max_tokens": 8, "stream": True, "ignore_eos": True,
                                       "messages": [{"role": "user", "content": "Count with me"}]})
    engine_whole = ("/v1/completions", {"model": "tiny", "prompt": "Count with me", "max_tokens": 8})
    long_stream = ("/v1/completions", {"model": "stub", "prompt": "hi", "max_tokens": 400, "stream": True})
    workers = [worker("steady", i, [stream, engine, whole, engine_whole]) for i in range(3)]
    workers += [worker("steady", i, [long_stream], pinned=0) for i in range(2)]  # open at the kill
    workers += [worker("tight", 0, [whole]), worker("budget", 0, [whole])]
    workers += [worker("pair", 0, [stream], pinned=0), worker("pair", 1, [stream])]  # a slot left on the dead one

    async def faults() -> None:
        async def at(moment: float) -> None:
            await asyncio.sleep(max(moment - now(), 0))

        await at(FAULTS["replica SIGKILLed"][0])
        os.kill(replicas[0].pid, signal.SIGKILL)
        await at(FAULTS["Redis paused 5 s"][0])
        redis_server.process.send_signal(signal.SIGSTOP)
        await asyncio.sleep(5)
        redis_server.process.send_signal(signal.SIGCONT)
        await at(FAULTS["Redis restarted empty"][0])
        redis_server.stop()
        redis_server.start()
        await at(FAULTS["PostgreSQL restarted"][0])
        await asyncio.to_thread(subprocess.run, ["pg_ctlcluster", cluster, "main", "restart"], check=True)

    await asyncio.gather(faults(), *workers)
    return sent


def _in_fault(moment: float) -> str | None:
    return next((name for name, (begin, span) in FAULTS.items() if begin <= moment <= begin + span), None)


def _check(sent: list[Sent], rows: dict[str, UsageRecord]) -> None:
    report = [f"{len(sent)} requests; faults at {', '.join(f'{n} {b:g} s' for n, (b, _) in FAULTS.items())}"]
    delivered_by, billed_by, short = {}, {}, []
    for record in sent:
        if not record.delivered:
            continue
        row = rows.get(record.request_id)
        delivered_by[record.tenant] = delivered_by.get(record.tenant, 0) + record.delivered
        if row is None:  # a stream the kill cut before any checkpoint held it: within the bound
            assert record.status is None and record.delivered <= BOUND, f"{record} left no ledger row"
            short.append(record.delivered)
            continue
        billed_by[record.tenant] = billed_by.get(record.tenant, 0) + row.completion_tokens
        if row.status == "interrupted":
            assert row.completion_tokens >= record.delivered - BOUND, (record, row.completion_tokens)
        elif record.status == 200 and record.ended and row.status == "ok":
            assert row.completion_tokens >= record.delivered, (record, row.completion_tokens)
        short.append(max(record.delivered - row.completion_tokens, 0))
    for tenant in sorted(delivered_by):
        report.append(f"{tenant}: delivered {delivered_by[tenant]} completion tokens, billed "
                      f"{billed_by.get(tenant, 0)}")
    interrupted = [r for r in rows.values() if r.status == "interrupted"]
    report.append(f"streams cut by the kill and billed at their checkpoint: {len(interrupted)}; the most a stream's "
                  f"bill fell short of what it delivered: {max(short, default=0)} tokens (bound {BOUND})")
    assert interrupted, "no stream was open at the kill"

    budget_cost = sum(r.cost_nano_usd for r in rows.values() if r.tenant == "budget")
    one_request = (18 + 20) * 10**6  # the budget tenant's reservation: its prompt bound and max_tokens, in nano-dollars
    report.append(f"budget: ${budget_cost / 1e9:.6f} spent of ${BUDGET} (one reservation: ${one_request / 1e9:.6f})")
    assert budget_cost <= BUDGET * 10**9 + one_request

    kill = FAULTS["replica SIGKILLed"][0]
    refused = [r for r in sent if r.tenant == "pair" and r.concurrency_refused]
    late = [r for r in refused if not kill <= r.started <= kill + LEASE_S + 2]
    report.append(f"pair refused a concurrency slot {len(refused)} times, the last "
                  f"{max((r.started - kill for r in refused), default=0):.1f} s after the kill (lease {LEASE_S:g} s)")
    assert not late, f"refused a concurrency slot outside the lease after the kill: {late[:3]}"

    errors = [r for r in sent if r.status is not None and r.status >= 500 and _in_fault(r.started) is None]
    assert not errors, f"5xx outside the fault windows: {errors[:3]}"
    for name, (begin, span) in FAULTS.items():
        during = [r.ended - r.started for r in sent
                  if r.replica != 0 and r.status == 200 and not r.long and begin <= r.started <= begin + span]
        p99 = percentile(during, 99)
        report.append(f"{name}: {len(during)} answered by the survivors, p99 latency "
                      f"{'-' if p99 is None else f'{p99:.2f} s'}")
    quiet = [r.ended - r.started for r in sent if r.status == 200 and not r.long and _in_fault(r.started) is None]
    report.append(f"outside the faults: {len(quiet)} answered, p99 latency {percentile(quiet, 99):.2f} s")
    conftest.REPORTS["fault run: three replicas, Redis and PostgreSQL"] = report
