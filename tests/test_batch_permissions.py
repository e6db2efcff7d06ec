"""A batch's line is an ordinary request when it runs, through the official `openai` SDK: a key
revoked or a tenant disabled mid-batch stops it at the next line (the lines in flight may finish),
a budget lowered or raised counts from the next line, every line is checkpointed from its
reservation on, and a gateway SIGKILLed mid-batch bills each try it cut short what it had
delivered at its last checkpoint (never what it reserved), every line answered once."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import redis
from sqlmodel import Session, select

from advisor.measure.baselines import free_port, servegate_command
from gateway.db import make_engine, upgrade
from gateway.tables import BatchResult, UsageRecord
from gateway.tenancy.tenants import KeyIn, TenantIn, TenantPatch, bootstrap, create_key, create_tenant, update_tenant

from .conftest import ADMIN_KEY, AUTH, gateway_app, serve_app, wait_ready
from .test_batches import answers, finished, sdk, tiny_backend

pytestmark = pytest.mark.slow

PRICE = {"input": "1000", "output": "1000"}  # USD per million tokens: $0.001 a token, $0.0005 at the batch price
NANO_PER_TOKEN = 500_000  # a batch token's price in nano-dollars
CONCURRENCY = 2  # lines a replica runs at once: more than one in flight when a change comes
MAX_TOKENS = 24  # what each line generates (ignore_eos): long enough to be caught mid-run


@pytest.fixture(scope="module")
def gw(tiny_model_dir, tmp_path_factory):
    """A gateway whose directory is never refreshed, nor its open calls checkpointed, in the
    background: what a batch sees of a change made in the database (as by another replica) comes
    from its own reads, and a line's checkpoint from its reservation."""
    home = tmp_path_factory.mktemp("gw")
    app = gateway_app({"tiny": tiny_backend(tiny_model_dir)}, home, refresh_s=3600, checkpoint_s=3600,
                      prices={"tiny": PRICE}, batch_concurrency=CONCURRENCY, usage_flush_s=0.1)
    with serve_app(app) as url:
        wait_ready(url)
        with httpx.Client(base_url=url, headers=AUTH, timeout=30) as admin:
            yield SimpleNamespace(url=url, db=app.state.gateway.db, spool=home / "spool", admin=admin)


def new_tenant(gw, **limits) -> tuple[str, dict]:
    """A tenant of its own, and its key as made (`key`, `prefix`)."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    assert gw.admin.post("/admin/tenants", json={"name": name, **limits}).status_code == 201
    return name, gw.admin.post("/admin/keys", json={"tenant": name}).json()


def submit(client, max_tokens: list[int]):
    """A batch of completions, line i generating `max_tokens[i]` tokens."""
    content = "".join(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions", "body": {
        "model": "tiny", "prompt": f"Line {i} says", "max_tokens": tokens, "temperature": 0, "ignore_eos": True}})
        + "\n" for i, tokens in enumerate(max_tokens)).encode()
    source = client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
    return client.batches.create(input_file_id=source.id, endpoint="/v1/completions", completion_window="24h")


def results(db, batch_id: str) -> list[BatchResult]:
    with Session(db) as session:
        return list(session.exec(select(BatchResult).where(BatchResult.batch_id == batch_id)).all())


def answered_by(db, batch_id: str, count: int, timeout: float = 120) -> list[BatchResult]:
    """The batch's answers, once it has at least `count`."""
    deadline = time.monotonic() + timeout
    while len(found := results(db, batch_id)) < count:
        assert time.monotonic() < deadline, f"only {len(found)} of {count} lines answered"
        time.sleep(0.02)
    return found


def cost(usage: dict) -> int:
    """A line's price in nano-dollars, from its answer's usage."""
    return usage["total_tokens"] * NANO_PER_TOKEN


def batch_records(db, batch_id: str, count: int = 0, timeout: float = 10) -> list[UsageRecord]:
    """The ledger's records of the batch's tries, once the writer has moved `count` of them in."""
    deadline = time.monotonic() + timeout
    while True:
        with Session(db) as session:
            found = session.exec(select(UsageRecord).where(UsageRecord.request_id.startswith(f"{batch_id}-"))).all()
        if len(found) >= count:
            return list(found)
        assert time.monotonic() < deadline, f"only {len(found)} of {count} usage records arrived"
        time.sleep(0.05)


def checkpointed(spool: Path, batch_id: str) -> list[dict]:
    """The batch's tries in the checkpoints of open calls beside the spool."""
    rows = []
    for path in spool.glob("usage-*.open"):
        with contextlib.suppress(FileNotFoundError):  # replaced as it was looked for
            rows += [json.loads(line) for line in path.read_text().splitlines()]
    return [row for row in rows if row["request_id"].startswith(f"{batch_id}-")]


def budget_refusals(gw, tenant: str) -> float:
    metrics = httpx.get(f"{gw.url}/metrics").text
    found = re.search(rf'servegate_quota_rejections_total{{limit="daily_budget",tenant="{tenant}"}} (\S+)', metrics)
    return float(found.group(1)) if found else 0.0


def ended(gw, batch_id: str, timeout: float = 120) -> dict:
    """The batch once it has ended, as the operator's admin API shows it (its key may call no more)."""
    deadline = time.monotonic() + timeout
    while (batch := gw.admin.get(f"/admin/batches/{batch_id}").json())["status"] not in (
            "completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, f"batch still {batch['status']}"
        time.sleep(0.1)
    return batch


def test_a_key_revoked_mid_batch_stops_it_after_the_lines_in_flight(gw):
    _, key = new_tenant(gw)
    batch = submit(sdk(gw.url, key["key"]), [MAX_TOKENS] * 40)
    answered_by(gw.db, batch.id, 4)
    assert gw.admin.post(f"/admin/keys/{key['prefix']}/revoke").status_code == 200
    before = len(results(gw.db, batch.id))
    done = ended(gw, batch.id)
    ran = [r for r in results(gw.db, batch.id) if r.status_code == 200]
    assert done["status"] == "failed" and len(ran) <= before + CONCURRENCY, (done["status"], before, len(ran))
    assert done["request_counts"] == {"total": 40, "completed": len(ran), "failed": 40 - len(ran)}
    [error] = done["errors"]["data"]
    assert error["code"] == "invalid_api_key" and f"The API key {key['prefix']} was revoked" in error["message"]
    assert len(batch_records(gw.db, batch.id, len(ran))) == len(ran)  # no line ran after, unanswered


def test_a_tenant_disabled_mid_batch_stops_it_after_the_lines_in_flight(gw):
    tenant, key = new_tenant(gw)
    batch = submit(sdk(gw.url, key["key"]), [MAX_TOKENS] * 40)
    answered_by(gw.db, batch.id, 4)
    with Session(gw.db) as session:  # as another replica's admin API does: this one's directory never hears of it
        update_tenant(session, "test", tenant, TenantPatch(disabled=True))
    before = len(results(gw.db, batch.id))
    done = ended(gw, batch.id)
    ran = [r for r in results(gw.db, batch.id) if r.status_code == 200]
    assert done["status"] == "failed" and len(ran) <= before + CONCURRENCY, (done["status"], before, len(ran))
    assert {r.body["code"] for r in results(gw.db, batch.id) if r.status_code != 200} == {"batch_failed"}
    [error] = done["errors"]["data"]
    assert error["code"] == "tenant_disabled" and f"The tenant {tenant!r} is disabled" in error["message"], error


def test_a_budget_lowered_mid_batch_is_passed_by_at_most_one_lines_price(gw):
    tenant, key = new_tenant(gw, daily_budget_usd="100")
    client = sdk(gw.url, key["key"])
    batch = submit(client, [MAX_TOKENS] * 40)
    answered_by(gw.db, batch.id, 4)
    answered = results(gw.db, batch.id)
    line = max(cost(r.body["usage"]) for r in answered)
    # room for the lines in flight, less half of one: every line that starts from now on is refused
    budget = Decimal(sum(cost(r.body["usage"]) for r in answered) + line * CONCURRENCY - line // 2) / 10**9
    assert gw.admin.patch(f"/admin/tenants/{tenant}", json={"daily_budget_usd": str(budget)}).status_code == 200
    deadline = time.monotonic() + 60
    while budget_refusals(gw, tenant) < 2:  # a line refused, and refused again as it tries again
        assert time.monotonic() < deadline, "no line was refused for the lowered budget"
        time.sleep(0.05)
    client.batches.cancel(batch.id)
    done = finished(client, batch.id)
    output = answers(client, done.output_file_id)
    assert done.status == "cancelled" and 4 <= len(output) < 40
    records = batch_records(gw.db, batch.id, len(output))
    spent = sum(r.cost_nano_usd for r in records)
    assert spent == sum(cost(o["response"]["body"]["usage"]) for o in output)  # each answered line billed once
    assert spent <= budget * 10**9 + line, (spent, budget, line)


def test_a_budget_raised_mid_batch_from_exhausted_runs_the_lines_again(gw):
    tenant, key = new_tenant(gw, daily_budget_usd="0.05")  # three lines of 29 tokens at $0.0005 a token, not four
    client = sdk(gw.url, key["key"])
    batch = submit(client, [MAX_TOKENS] * 8)
    deadline = time.monotonic() + 60
    while budget_refusals(gw, tenant) == 0:
        assert time.monotonic() < deadline, "the budget never ran out"
        time.sleep(0.05)
    assert len(results(gw.db, batch.id)) < 8
    assert gw.admin.patch(f"/admin/tenants/{tenant}", json={"daily_budget_usd": "100"}).status_code == 200
    done = finished(client, batch.id, timeout=60)
    output = answers(client, done.output_file_id)
    assert done.status == "completed" and len(output) == 8, (done.status, done.request_counts)
    assert all(o["response"]["status_code"] == 200 for o in output)


def test_a_line_is_checkpointed_from_its_reservation_on(gw):
    """Before anything was delivered, and however short the line, a process that died now would
    bill it nothing and release all it reserved."""
    _, key = new_tenant(gw)
    client = sdk(gw.url, key["key"])
    batch = submit(client, [512])
    deadline = time.monotonic() + 30
    while not (rows := checkpointed(gw.spool, batch.id)):  # this gateway's periodic checkpoints are an hour apart
        assert time.monotonic() < deadline, "the line was never checkpointed"
        time.sleep(0.01)
    [row] = rows
    assert re.fullmatch(rf"{batch.id}-1-[0-9a-f]{{12}}", row["request_id"]), row["request_id"]
    assert (row["status"], row["completion_tokens"], row["cost_nano_usd"]) == ("interrupted", 0, 0), row
    assert row["prompt_tokens"] == 0 and row["reservation"]["tokens"] > 512 and row["reservation"]["cost"] > 0
    client.batches.cancel(batch.id)
    assert finished(client, batch.id).status == "cancelled"


def caught_mid_run(rows: list[dict], answered: list[BatchResult], lengths: list[int]) -> bool:
    """Whether the checkpoints hold a try that just started (nothing delivered yet: only its first
    checkpoint, taken as it reserved, holds it) and another well short of its end, both of lines
    not answered yet."""
    done = {result.line for result in answered}
    running = [(row, int(row["request_id"].rsplit("-", 2)[1])) for row in rows]
    running = [(row["completion_tokens"], lengths[number - 1]) for row, number in running if number not in done]
    return any(tokens == 0 for tokens, _ in running) and any(0 < tokens <= length - 32 for tokens, length in running)


@contextlib.contextmanager
def redis_server():
    """A Redis of the test's own: its URL."""
    port = free_port()
    process = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port)
        deadline = time.monotonic() + 10
        while not _pings(client):
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.kill()
        process.wait()


def _pings(client: redis.Redis) -> bool:
    try:
        return client.ping()
    except redis.ConnectionError:
        return False


@pytest.mark.parametrize("store", ["in-process", pytest.param("redis", marks=pytest.mark.skipif(
    not shutil.which("redis-server"), reason="no redis-server to start"))])
def test_a_gateway_sigkilled_mid_batch_bills_cut_short_tries_at_their_checkpoint(tiny_model_dir, tmp_path, store):
    """The tries under way at the kill are billed what their last checkpoint held, a try that had
    just started included (nothing yet), and what they reserved is released: with Redis, the
    windows hold what the ledger billed. The restarted gateway runs their lines again under ids of
    their own, and answers each line once."""
    db_url = f"sqlite:///{tmp_path}/servegate.db"
    db = make_engine(db_url)
    upgrade(db)
    with Session(db) as session:
        bootstrap(session, ADMIN_KEY)
        create_tenant(session, "test", TenantIn(name="killed"))
        key = create_key(session, "test", KeyIn(tenant="killed")).key
    spool = tmp_path / "spool"
    env = {**os.environ, "SERVEGATE_DATABASE_URL": db_url, "SERVEGATE_SPOOL_DIR": str(spool),
           "SERVEGATE_CHECKPOINT_S": "0.25", "SERVEGATE_BATCH_CONCURRENCY": str(CONCURRENCY),
           "SERVEGATE_PRICES": json.dumps({"tiny": PRICE})}

    def start() -> tuple[subprocess.Popen, str]:
        port = free_port()
        command = [*servegate_command(port, str(tiny_model_dir)), "--served-name", "tiny", "--dtype", "float64",
                   "--kv-cache-tokens", "4096", "--no-engine-process"]
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, process=process)
        return process, url

    lengths = [64 + 32 * (i % 3) for i in range(12)]  # lines of unequal length: they start at different times
    with contextlib.ExitStack() as stack:
        if store == "redis":
            env["SERVEGATE_REDIS_URL"] = stack.enter_context(redis_server())
        doomed, url = start()
        try:
            batch = submit(sdk(url, key), lengths)
            answered_by(db, batch.id, 2)
            deadline = time.monotonic() + 60
            while not caught_mid_run(checkpointed(spool, batch.id), results(db, batch.id), lengths):
                assert time.monotonic() < deadline, "no try was in the checkpoints from its reservation on while " \
                    "another was mid-run"
                time.sleep(0.005)
        finally:
            os.kill(doomed.pid, signal.SIGKILL)
            doomed.wait()
        killed_at = time.time()
        partials = {row["request_id"]: row for row in checkpointed(spool, batch.id)}  # what the next start bills

        survivor, url = start()  # takes the dead spool over, and the batch once its lease lapses
        try:
            done = finished(sdk(url, key), batch.id, timeout=180)
            output = answers(sdk(url, key), done.output_file_id)
            windows = {} if store == "in-process" else {name: int(redis.Redis.from_url(
                env["SERVEGATE_REDIS_URL"]).get(f"sg:q:tenant:killed:{name}:{int(time.time() // 86_400)}"))
                for name in ("tpd", "usd-day")}
        finally:
            survivor.terminate()  # its ledger flushed as it stops
            survivor.wait(timeout=30)
    assert done.status == "completed"
    assert sorted(o["custom_id"] for o in output) == sorted(f"req-{i}" for i in range(len(lengths)))
    answers_by_id = {o["response"]["request_id"]: o["response"]["body"]["usage"] for o in output}
    records = {r.request_id: r for r in batch_records(db, batch.id)}
    for request_id in records:  # every try is its line's: the batch's id, its number, a suffix
        assert re.fullmatch(rf"{batch.id}-\d+-[0-9a-f]{{12}}", request_id), request_id
    for request_id, usage in answers_by_id.items():
        record = records[request_id]
        assert (record.status, record.prompt_tokens, record.completion_tokens) == (
            "ok", usage["prompt_tokens"], usage["completion_tokens"]), record
    # a try in the checkpoints is billed what they held, unless it finished as the kill came
    cut_short = {request_id: row for request_id, row in partials.items() if records[request_id].status != "ok"}
    assert any(row["completion_tokens"] == 0 for row in cut_short.values()), "no try had just started"
    assert any(row["completion_tokens"] > 0 for row in cut_short.values()), "no try was cut short mid-run"
    for request_id, row in cut_short.items():
        record = records[request_id]
        assert (record.status, record.prompt_tokens, record.completion_tokens, record.cost_nano_usd) == (
            "interrupted", row["prompt_tokens"], row["completion_tokens"], row["cost_nano_usd"]), record
        assert request_id not in answers_by_id and record.prompt_tokens + record.completion_tokens < \
            row["reservation"]["tokens"]  # what it delivered, not what it reserved
    # the rest: tries that finished as the kill came, their answers not yet written: billed whole, run again
    unwritten = [r for r in records.values() if r.request_id not in answers_by_id and r.request_id not in cut_short]
    assert all(r.status == "ok" and r.finished_at.timestamp() <= killed_at for r in unwritten), unwritten
    tokens = sum(r.prompt_tokens + r.completion_tokens for r in records.values())
    assert tokens == sum(u["total_tokens"] for u in answers_by_id.values()) + sum(
        row["prompt_tokens"] + row["completion_tokens"] for row in cut_short.values()) + sum(
        r.prompt_tokens + r.completion_tokens for r in unwritten)
    if store == "redis":  # nothing left reserved: the windows hold what the ledger billed
        assert windows == {"tpd": tokens, "usd-day": sum(r.cost_nano_usd for r in records.values())}, windows
