"""`/v1/files` and `/v1/batches` through the official `openai` SDK: uploads checked line by line, a
batch run in the background, billed at the batch price, cancelled, expired, and resumed after a
restart or a dead replica without a line answered twice."""

from __future__ import annotations

import io
import json
import time
import uuid
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import httpx
import openai
import pytest
from sqlmodel import Session, select

from backends.builtin import BuiltinBackend, EngineConfig
from gateway.tables import BatchRecord, BatchResult, StoredFile

from .conftest import ADMIN_KEY, AUTH, gateway_app, serve_app, usage_records, wait_ready

pytestmark = pytest.mark.slow

PRICE = {"tiny": {"input": "1", "output": "2"}}


def tiny_backend(tiny_model_dir) -> BuiltinBackend:
    return BuiltinBackend(EngineConfig(model=str(tiny_model_dir), dtype="float64", served_name="tiny",
                                       kv_cache_tokens=4096, engine_process=False), "tiny")


def start(tiny_model_dir, home, **settings):
    app = gateway_app({"tiny": tiny_backend(tiny_model_dir)}, home, refresh_s=0.3, prices=PRICE, **settings)
    return app, serve_app(app)


@pytest.fixture(scope="module")
def gw(tiny_model_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("gw")
    app, serving = start(tiny_model_dir, home)
    with serving as url:
        wait_ready(url)
        yield SimpleNamespace(url=url, home=home, db=app.state.gateway.db)


def sdk(url: str, key: str = ADMIN_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def lines(count: int, url: str = "/v1/completions", max_tokens: int = 4) -> bytes:
    rows = []
    for i in range(count):
        body = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0}
        body |= {"prompt": f"Line {i} says"} if url == "/v1/completions" else \
            {"messages": [{"role": "user", "content": f"Line {i}"}]}
        rows.append({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body})
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def finished(client: openai.OpenAI, batch_id: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while (batch := client.batches.retrieve(batch_id)).status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.2)
    return batch


def answers(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_the_sdks_full_flow_answers_every_line_once_billed_at_the_batch_price(gw):
    client = sdk(gw.url)
    source = client.files.create(file=("in.jsonl", io.BytesIO(lines(6) + lines(2, "/v1/chat/completions")
                                                               .replace(b"req-", b"chat-"))), purpose="batch")
    assert source.purpose == "batch" and source.bytes > 0
    with pytest.raises(openai.BadRequestError, match="line 7 of .* calls '/v1/chat/completions'"):
        client.batches.create(input_file_id=source.id, endpoint="/v1/completions", completion_window="24h")
    source = client.files.create(file=("in.jsonl", io.BytesIO(lines(8))), purpose="batch")
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/completions", completion_window="24h",
                                  metadata={"job": "nightly"})
    assert batch.status == "in_progress" and batch.metadata == {"job": "nightly"}
    done = finished(client, batch.id)
    assert done.status == "completed" and done.error_file_id is None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (8, 8, 0)
    output = answers(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in output) == sorted(f"req-{i}" for i in range(8))
    for line in output:
        assert line["response"]["status_code"] == 200 and line["error"] is None
        assert line["response"]["body"]["object"] == "text_completion"
        assert line["response"]["body"]["usage"]["completion_tokens"] >= 1
    records = [r for r in usage_records(gw.url, "default", 8) if r["api"] == "batch"]
    assert len(records) == 8
    for record in records:  # half of PRICE's $1 input and $2 output per million tokens, in nano-dollars
        assert record["cost_nano_usd"] == record["prompt_tokens"] * 500 + record["completion_tokens"] * 1000 > 0
    assert client.batches.list().data[0].id == batch.id


def test_uploads_are_checked_line_by_line(gw):
    good = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "tiny", "prompt": "x"}}
    bad = [good, {**good, "custom_id": "a"}, "not json", {**good, "custom_id": "c", "url": "/v1/moderations"},
           {**good, "custom_id": "d", "body": {"model": "tiny", "prompt": "x", "temperature": 9}},
           {**good, "custom_id": "e", "method": "GET"}, {**good, "custom_id": "f", "body": {**good["body"],
                                                                                           "stream": True}}]
    content = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in bad).encode()
    response = httpx.post(f"{gw.url}/v1/files", headers=AUTH, files={"file": ("x.jsonl", content)},
                          data={"purpose": "batch"})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    for number, words in ((2, "custom_id 'a' is used by an earlier line"), (3, "Invalid JSON"),
                          (4, "'/v1/moderations' is not one batches call"), (5, "temperature"), (6, "method"),
                          (7, "stream must be false")):
        assert f"line {number}: " in message and words in message, (number, message)
    assert "line 1:" not in message
    for content, words in ((b"", "no request lines"), (b"\xff\xfe", "not UTF-8")):
        refused = httpx.post(f"{gw.url}/v1/files", headers=AUTH, files={"file": ("x.jsonl", content)},
                             data={"purpose": "batch"})
        assert refused.status_code == 400 and words in refused.json()["error"]["message"]
    wrong = httpx.post(f"{gw.url}/v1/files", headers=AUTH, files={"file": ("x.jsonl", b"{}")},
                       data={"purpose": "fine-tune"})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "purpose"


def test_files_and_batches_are_their_tenants_own(gw):
    admin = httpx.Client(base_url=gw.url, headers=AUTH, timeout=30)
    name = f"t-{uuid.uuid4().hex[:8]}"
    assert admin.post("/admin/tenants", json={"name": name}).status_code == 201
    other = sdk(gw.url, admin.post("/admin/keys", json={"tenant": name}).json()["key"])
    mine = sdk(gw.url)
    source = mine.files.create(file=("in.jsonl", io.BytesIO(lines(1))), purpose="batch")
    batch = mine.batches.create(input_file_id=source.id, endpoint="/v1/completions", completion_window="24h")
    for attempt in (lambda: other.files.retrieve(source.id), lambda: other.files.content(source.id),
                    lambda: other.files.delete(source.id), lambda: other.batches.retrieve(batch.id),
                    lambda: other.batches.cancel(batch.id),
                    lambda: other.batches.create(input_file_id=source.id, endpoint="/v1/completions",
                                                 completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert other.batches.list().data == [] and other.files.list().data == []
    finished(mine, batch.id)


def test_a_cancelled_batch_answers_each_line_once_run_or_not(gw):
    client = sdk(gw.url)
    source = client.files.create(file=("in.jsonl", io.BytesIO(lines(200, max_tokens=64))), purpose="batch")
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/completions", completion_window="24h")
    while client.batches.retrieve(batch.id).request_counts.completed < 2:
        time.sleep(0.1)
    assert client.batches.cancel(batch.id).status == "cancelling"
    with pytest.raises(openai.BadRequestError, match="cancelling"):
        client.batches.cancel(batch.id)
    done = finished(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    ran, skipped = answers(client, done.output_file_id), answers(client, done.error_file_id)
    assert 2 <= len(ran) < 200 and len(ran) + len(skipped) == 200
    assert sorted(x["custom_id"] for x in ran + skipped) == sorted(f"req-{i}" for i in range(200))
    assert {x["error"]["code"] for x in skipped} == {"batch_cancelled"}
    with pytest.raises(openai.BadRequestError, match="cancelled"):
        client.batches.cancel(batch.id)


def test_a_batch_past_its_window_expires_its_remaining_lines(gw):
    client = sdk(gw.url)
    source = client.files.create(file=("in.jsonl", io.BytesIO(lines(3))), purpose="batch")
    with Session(gw.db) as session:  # created a day ago, never picked up
        session.add(BatchRecord(id=f"batch_{uuid.uuid4().hex}", tenant="default", endpoint="/v1/completions",
                                input_file_id=source.id, total=3, expires_at=datetime.now(UTC) - timedelta(seconds=1)))
        session.commit()
        batch_id = session.exec(select(BatchRecord.id).where(BatchRecord.input_file_id == source.id)).one()
    done = finished(client, batch_id)
    assert done.status == "expired" and done.output_file_id is None
    assert [x["error"]["code"] for x in answers(client, done.error_file_id)] == ["batch_expired"] * 3


def test_a_restart_resumes_a_batch_and_a_dead_replicas_lease_lapses(tiny_model_dir, tmp_path):
    """A gateway stopped halfway lets the lines under way finish and hands the batch on; the next
    one runs only the rest. A replica that died holding a lease (its results half written) is
    taken over once the lease lapses, its answers kept as they are."""
    app, serving = start(tiny_model_dir, tmp_path, batch_concurrency=1)
    with serving as url:
        wait_ready(url)
        client = sdk(url)
        source = client.files.create(file=("in.jsonl", io.BytesIO(lines(24, max_tokens=24))), purpose="batch")
        batch = client.batches.create(input_file_id=source.id, endpoint="/v1/completions", completion_window="24h")
        while client.batches.retrieve(batch.id).request_counts.completed < 6:
            time.sleep(0.05)
    with Session(app.state.gateway.db) as session:
        stopped = session.get(BatchRecord, batch.id)
        stopped = (stopped.status, stopped.runner)
        answered = len(session.exec(select(BatchResult).where(BatchResult.batch_id == batch.id)).all())
        dead = BatchRecord(id=f"batch_{uuid.uuid4().hex}", tenant="default", endpoint="/v1/completions",
                           input_file_id=source.id, total=24, runner="replica-dead",
                           lease_until=datetime.now(UTC) - timedelta(seconds=1),
                           expires_at=datetime.now(UTC) + timedelta(hours=1))
        dead_id = dead.id
        session.add(dead)  # a dead replica's batch: two lines answered, its lease lapsed
        for line in (1, 2):
            session.add(BatchResult(batch_id=dead.id, line=line, custom_id=f"req-{line - 1}",
                                    request_id=f"dead-{line}", status_code=200, body={"ran": "before"}))
        session.commit()
    assert stopped == ("in_progress", None) and 6 <= answered < 24

    app, serving = start(tiny_model_dir, tmp_path, batch_concurrency=2)
    with serving as url:
        wait_ready(url)
        client = sdk(url)
        for batch_id in (batch.id, dead_id):
            done = finished(client, batch_id)
            output = answers(client, done.output_file_id)
            assert done.status == "completed" and len(output) == 24
            assert sorted(o["custom_id"] for o in output) == sorted(f"req-{i}" for i in range(24))
        kept = [o for o in answers(client, client.batches.retrieve(dead_id).output_file_id)
                if o["response"]["request_id"].startswith("dead-")]
        assert [o["response"]["body"] for o in kept] == [{"ran": "before"}] * 2
        runs = [r for r in usage_records(url, "default", 24 + 22, timeout=30) if r["api"] == "batch"]
        assert len(runs) == 24 + 22  # no line run twice: the restart ran only those never answered


def test_one_replica_at_a_time_holds_a_batch(tmp_path):
    from gateway.api.batch_runner import BatchRunner
    from gateway.db import make_engine, upgrade

    db = make_engine(f"sqlite:///{tmp_path}/claims.db")
    upgrade(db)
    with Session(db) as session:
        session.add(BatchRecord(id="batch_1", tenant="default", endpoint="/v1/completions", input_file_id="file-1",
                                total=1, runner="replica-alive", lease_until=datetime.now(UTC) + timedelta(seconds=60),
                                expires_at=datetime.now(UTC) + timedelta(hours=1)))
        session.commit()
    gateway = SimpleNamespace(db=db, settings=None)
    first, second = BatchRunner(gateway), BatchRunner(gateway)
    assert first._claim() == second._claim() == []  # another replica's lease stands
    with Session(db) as session:
        row = session.get(BatchRecord, "batch_1")
        row.lease_until = datetime.now(UTC) - timedelta(seconds=1)  # and lapses
        session.add(row)
        session.commit()
    assert (first._claim(), second._claim(), first._claim()) == (["batch_1"], [], ["batch_1"])


def test_the_migrations_create_what_the_tables_declare(gw):
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext
    from sqlmodel import SQLModel

    with gw.db.connect() as connection:
        differences = compare_metadata(MigrationContext.configure(connection), SQLModel.metadata)
    assert [d for d in differences if "file" in str(d) or "batch" in str(d) or "response" in str(d)] == []
    assert StoredFile.__tablename__ == "file"


def test_a_batch_of_responses_answers_in_the_responses_shape(gw):
    client = sdk(gw.url)
    rows = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses",
             "body": {"model": "tiny", "input": f"Say {i}", "max_output_tokens": 4, "store": False}} for i in range(3)]
    content = "".join(json.dumps(row) + "\n" for row in rows).encode()
    source = client.files.create(file=("r.jsonl", io.BytesIO(content)), purpose="batch")
    done = finished(client, client.batches.create(input_file_id=source.id, endpoint="/v1/responses",
                                                  completion_window="24h").id)
    output = answers(client, done.output_file_id)
    assert done.status == "completed" and sorted(o["custom_id"] for o in output) == ["r0", "r1", "r2"]
    for line in output:
        body = line["response"]["body"]
        assert body["object"] == "response" and body["usage"]["output_tokens"] >= 1
        assert line["response"]["request_id"] == body["id"]
