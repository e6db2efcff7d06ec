"""The usage ledger: spooled before the response ends, batched into the database, recovered
after a crash, never counted twice."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from datetime import UTC, datetime

import httpx
import pytest
from sqlmodel import Session, select

from advisor.measure.baselines import free_port, servegate_command
from gateway.db import make_engine, upgrade
from gateway.tables import UsageRecord
from gateway.tenancy.ledger import UsageLedger

from .conftest import ADMIN_KEY, wait_ready


def record(request_id: str) -> dict:
    now = datetime.now(UTC)
    return {"request_id": request_id, "tenant": "t", "key_prefix": "abcd1234", "model": "m", "backend": "b",
            "route": "m", "api": "openai", "stream": False, "prompt_tokens": 3, "completion_tokens": 4,
            "cached_tokens": 0, "ttft_ms": 1.0, "latency_ms": 2.0, "status": "ok", "error_type": None,
            "started_at": now, "finished_at": now}


def stored_ids(db) -> list[str]:
    with Session(db) as session:
        return sorted(session.exec(select(UsageRecord.request_id)).all())


def test_orphaned_spools_are_recovered_once_and_torn_lines_skipped(tmp_path):
    db = make_engine(f"sqlite:///{tmp_path}/db.sqlite")
    upgrade(db)
    crashed = UsageLedger(db, tmp_path / "spool")
    for i in range(3):
        crashed.record(record(f"r{i}"))
    crashed.flush()  # r0..r2 in the database
    crashed.record(record("r3"))
    os.write(crashed.fd, b'{"request_id": "torn", "ten')  # the process died mid-write
    os.close(crashed.fd)  # its lock goes with it, as when the process dies

    survivor = UsageLedger(db, tmp_path / "spool")
    assert survivor.recover_orphans().records == 4  # replayed whole: r0..r2 again, and r3
    assert stored_ids(db) == ["r0", "r1", "r2", "r3"]
    assert not crashed.path.exists()
    assert survivor.recover_orphans().records == 0
    survivor.close()
    assert not survivor.path.exists()  # everything in the database: the spool is removed


def test_a_live_processs_spool_is_left_alone(tmp_path):
    db = make_engine(f"sqlite:///{tmp_path}/db.sqlite")
    upgrade(db)
    alive = UsageLedger(db, tmp_path / "spool")
    alive.record(record("mine"))
    assert UsageLedger(db, tmp_path / "spool").recover_orphans().records == 0
    assert alive.flush() == 1 and stored_ids(db) == ["mine"]


@pytest.mark.slow
def test_sigkill_during_load_loses_no_completed_request(tiny_model_dir, tmp_path):
    db_url = f"sqlite:///{tmp_path}/servegate.db"
    env = {**os.environ, "SERVEGATE_DATABASE_URL": db_url, "SERVEGATE_SPOOL_DIR": str(tmp_path / "spool"),
           "SERVEGATE_ADMIN_KEY": ADMIN_KEY,
           "SERVEGATE_USAGE_FLUSH_S": "3600"}  # nothing reaches the database before the kill: only the spool
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [*servegate_command(port, str(tiny_model_dir)), "--served-name", "tiny", "--kv-cache-tokens", "4096"]

    def start() -> subprocess.Popen:
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_ready(url, process=process)
        return process

    gateway = start()
    completed: list[str] = []

    async def load():
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                                     timeout=60) as http:
            async def one(i: int) -> None:
                try:
                    reply = await http.post("/v1/completions", json={
                        "model": "tiny", "prompt": f"request {i}", "max_tokens": 4 + i % 40, "ignore_eos": True})
                except httpx.TransportError:
                    return  # cut off by the kill: its response never completed
                if reply.status_code == 200:
                    completed.append(reply.json()["id"])

            tasks = [asyncio.create_task(one(i)) for i in range(200)]
            while len(completed) < 40:
                await asyncio.sleep(0.01)
            os.kill(gateway.pid, signal.SIGKILL)  # mid-load: dozens of requests are in flight
            await asyncio.gather(*tasks)

    asyncio.run(load())
    gateway.wait()
    db = make_engine(db_url)
    assert len(completed) >= 40 and len(stored_ids(db)) == 0  # so far, every record is in the spool only

    restarted = start()  # a new process takes the dead one's spool over
    try:
        deadline = time.monotonic() + 20
        while not set(completed) <= set(stored_ids(db)):
            assert time.monotonic() < deadline, f"{len(set(completed) - set(stored_ids(db)))} records lost"
            time.sleep(0.2)
    finally:
        restarted.terminate()
        restarted.wait(timeout=30)
    assert len(stored_ids(db)) == len(set(stored_ids(db)))


@pytest.mark.slow
def test_sigterm_drains_open_streams_and_flushes_their_usage(tmp_path):
    """SIGTERM while 20 streams are open: the gateway stops taking connections, every stream runs
    to its end, and every usage record is in the database when the process exits (its periodic
    flush is an hour away: only the shutdown's flush can have put them there)."""
    db_url = f"sqlite:///{tmp_path}/servegate.db"
    env = {**os.environ, "SERVEGATE_DATABASE_URL": db_url, "SERVEGATE_SPOOL_DIR": str(tmp_path / "spool"),
           "SERVEGATE_ADMIN_KEY": ADMIN_KEY, "SERVEGATE_USAGE_FLUSH_S": "3600"}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    gateway = subprocess.Popen(servegate_command(port), env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    wait_ready(url, timeout=180, process=gateway)

    async def streams() -> tuple[list[dict], int]:
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                                     timeout=120) as http:
            started = asyncio.Event()
            opened: list[str] = []

            async def one(i: int) -> dict:
                body = {"model": "SmolLM2-135M-Instruct", "prompt": f"Tell story {i}:", "max_tokens": 48,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                events = []
                async with http.stream("POST", "/v1/completions", json=body) as reply:
                    async for line in reply.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                            if len(events) == 1:
                                opened.append(i)
                                if len(opened) == 20:
                                    started.set()
                return {"status": reply.status_code, "events": events}

            tasks = [asyncio.create_task(one(i)) for i in range(20)]
            await asyncio.wait_for(started.wait(), 120)
            finished_before = sum(t.done() for t in tasks)
            gateway.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            async with httpx.AsyncClient(base_url=url) as late:  # no new request is taken any more
                with pytest.raises(httpx.ConnectError):
                    await late.get("/health")
            return list(await asyncio.gather(*tasks)), finished_before

    try:
        results, finished_before = asyncio.run(streams())
        # uvicorn shuts down, then re-raises the signal it caught: a clean end reads -SIGTERM
        assert gateway.wait(timeout=120) in (0, -signal.SIGTERM)
    finally:
        if gateway.poll() is None:
            gateway.kill()
    assert finished_before == 0  # the signal came while all 20 were streaming
    ids = set()
    for result in results:
        assert result["status"] == 200 and result["events"][-1] == "[DONE]"
        usage = json.loads(result["events"][-2])["usage"]
        assert usage["completion_tokens"] == 48
        ids.add(json.loads(result["events"][0])["id"])
    stored = {r.request_id: r for r in Session(make_engine(db_url)).exec(select(UsageRecord)).all()}
    assert ids <= set(stored) and all(stored[i].completion_tokens == 48 for i in ids)
