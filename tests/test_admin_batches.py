"""Batches and stored responses in the admin API and the CLI: an operator sees every tenant's, a
tenant's administrator its own (another tenant's ids and names are not found), a cancel moves a
running batch to `cancelling` as the client's cancel does and the runner ends it `cancelled`, a
stored response is listed without its text and deleted, and both changes are audited. Gateways run
in process over a fake backend; batches are created with the official `openai` SDK."""

from __future__ import annotations

import asyncio
import io
import json
import uuid
from datetime import UTC, datetime, timedelta

import httpx
import openai
import pytest
from sqlmodel import Session, select
from typer.testing import CliRunner

from backends.base import Backend, Capabilities, Delta, Finish, Health, Load, Usage
from gateway.cli import app as cli
from gateway.db import make_engine, upgrade
from gateway.tables import AuditLog, BatchRecord, StoredFile, StoredResponse

from .conftest import AUTH, running, tenant

SECRET = "the prompt nobody else may read"


class Echo(Backend):
    """Answers every request with two tokens."""

    name = "echo"

    async def generate(self, request):
        yield Delta(0, "hi ", token_ids=(1,))
        yield Delta(0, "there", token_ids=(2,), finish_reason="stop")
        yield Finish(("stop",), Usage(3, 2))

    async def capabilities(self) -> Capabilities:
        return Capabilities(runtime="fake", version="1", model="echo", max_context=4096, prefix_caching=False)

    async def health(self) -> Health:
        return Health.READY

    async def load(self) -> Load:
        return Load()


def sdk(client: httpx.AsyncClient, headers: dict[str, str]) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://gateway/v1", api_key=headers["Authorization"].split()[1],
                              http_client=client, max_retries=0)


def lines(count: int) -> bytes:
    return "".join(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
                               "body": {"model": "echo", "prompt": f"{SECRET} {i}", "max_tokens": 4}}) + "\n"
                   for i in range(count)).encode()


def held_elsewhere(db, tenant: str, source: str, total: int, created: datetime, key_prefix: str = "elsewhere") -> str:
    """A batch in progress whose lease another replica holds: this gateway's runner leaves it alone."""
    batch_id = f"batch_{uuid.uuid4().hex}"
    with Session(db) as session:
        session.add(BatchRecord(id=batch_id, tenant=tenant, key_prefix=key_prefix, endpoint="/v1/completions",
                                input_file_id=source, total=total, completed=1, runner="replica-elsewhere",
                                lease_until=datetime.now(UTC) + timedelta(hours=1), created_at=created,
                                in_progress_at=created, expires_at=created + timedelta(hours=24)))
        session.commit()
    return batch_id


def store_response(db, tenant: str, created: datetime, expires_in: timedelta = timedelta(days=30)) -> str:
    response_id = f"resp_{uuid.uuid4().hex}"
    output = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": SECRET}]}]
    body = {"id": response_id, "object": "response", "status": "completed", "model": "echo", "output": output,
            "usage": {"input_tokens": 7, "output_tokens": 2, "total_tokens": 9}}
    with Session(db) as session:
        session.add(StoredResponse(id=response_id, tenant=tenant, key_prefix="abcd1234", model="echo",
                                   messages=[{"role": "user", "content": SECRET}, {"role": "assistant",
                                                                                  "content": SECRET}],
                                   input_items=[{"type": "message", "role": "user", "content": SECRET}], body=body,
                                   created_at=created, expires_at=created + expires_in))
        session.commit()
    return response_id


async def finished(client: openai.AsyncOpenAI, batch_id: str, timeout: float = 30):
    deadline = asyncio.get_running_loop().time() + timeout
    while (batch := await client.batches.retrieve(batch_id)).status not in ("completed", "failed", "expired",
                                                                               "cancelled"):
        assert asyncio.get_running_loop().time() < deadline, f"batch still {batch.status}"
        await asyncio.sleep(0.1)
    return batch


def audited(db, action: str) -> list[AuditLog]:
    with Session(db) as session:
        return list(session.exec(select(AuditLog).where(AuditLog.action == action).order_by(AuditLog.id)))


async def test_batches_per_tenant_for_operators_and_tenant_administrators_and_an_audited_cancel(tmp_path):
    async with running({"echo": Echo()}, tmp_path) as client:
        db = client.gateway.db
        acme, globex = await tenant(client, "acme", ("admin", "inference")), await tenant(client, "globex")
        acme_sdk, globex_sdk = sdk(client, acme), sdk(client, globex)
        source = await acme_sdk.files.create(file=("in.jsonl", io.BytesIO(lines(3))), purpose="batch")
        done = await finished(acme_sdk, (await acme_sdk.batches.create(
            input_file_id=source.id, endpoint="/v1/completions", completion_window="24h")).id)
        assert done.status == "completed" and done.request_counts.completed == 3
        theirs = await globex_sdk.files.create(file=("in.jsonl", io.BytesIO(lines(2))), purpose="batch")
        now = datetime.now(UTC)
        prefix = acme["Authorization"].split("_")[1]
        acme_running = held_elsewhere(db, "acme", source.id, 3, now + timedelta(seconds=1), prefix)
        globex_running = held_elsewhere(db, "globex", theirs.id, 2, now + timedelta(seconds=2))

        # The operator: every tenant's, newest first, with the replica holding each lease.
        listed = (await client.get("/admin/batches", headers=AUTH)).json()
        assert [b["id"] for b in listed] == [globex_running, acme_running, done.id]
        first = listed[0]
        assert (first["tenant"], first["status"], first["runner"], first["finished_at"]) == \
            ("globex", "in_progress", "replica-elsewhere", None)
        assert first["request_counts"] == {"total": 2, "completed": 1, "failed": 0}
        assert first["lease_until"] > now.timestamp() and first["input_file_id"] == theirs.id
        finished_row = listed[2]
        assert finished_row["tenant"] == "acme" and finished_row["output_file_id"] == done.output_file_id
        assert finished_row["finished_at"] == finished_row["completed_at"] is not None
        assert finished_row["key_prefix"] == prefix
        assert [b["id"] for b in (await client.get("/admin/batches", params={"tenant": "acme", "status": "completed"},
                                                   headers=AUTH)).json()] == [done.id]
        assert (await client.get("/admin/batches", params={"status": "sleeping"}, headers=AUTH)).status_code == 400
        assert len((await client.get("/admin/batches", params={"limit": 1}, headers=AUTH)).json()) == 1

        # acme's administrator: its own tenant's only, without the operators' lease fields.
        mine = (await client.get("/admin/batches", headers=acme)).json()
        assert [b["id"] for b in mine] == [acme_running, done.id]
        assert all("runner" not in b and "lease_until" not in b for b in mine)
        assert [b["id"] for b in (await client.get("/admin/batches", params={"tenant": "acme"},
                                                   headers=acme)).json()] == [acme_running, done.id]
        assert (await client.get("/admin/batches", params={"tenant": "globex"}, headers=acme)).status_code == 404
        shown = await client.get(f"/admin/batches/{acme_running}", headers=acme)
        assert shown.status_code == 200 and shown.json()["status"] == "in_progress"
        assert shown.headers["cache-control"] == "no-store"
        for method, path in (("GET", f"/admin/batches/{globex_running}"),
                             ("POST", f"/admin/batches/{globex_running}/cancel"),
                             ("GET", "/admin/batches/batch_nonesuch")):
            hidden = await client.request(method, path, headers=acme)
            assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "not_found", (method, path)
        assert (await client.get(f"/admin/batches/{globex_running}", headers=AUTH)).json()["status"] == "in_progress"
        assert (await client.get("/admin/batches", headers=globex)).status_code == 403  # no admin scope

        # A cancel, as the client's: cancelling now, refused once it is cancelling or finished; audited.
        cancelled = await client.post(f"/admin/batches/{acme_running}/cancel", headers=acme)
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelling"
        assert cancelled.json()["cancelling_at"] is not None
        assert (await acme_sdk.batches.retrieve(acme_running)).status == "cancelling"  # what its client sees
        for again in (acme_running, done.id):
            refused = await client.post(f"/admin/batches/{again}/cancel", headers=acme)
            assert refused.status_code == 400 and "cannot be cancelled" in refused.json()["error"]["message"]
        assert (await client.post(f"/admin/batches/{globex_running}/cancel", headers=AUTH)).json()["status"] == \
            "cancelling"
        operator = (await client.get("/admin/me", headers=AUTH)).json()["subject"]
        entries = audited(db, "batch.cancel")
        assert [(e.target, e.actor, e.before["status"], e.after["status"], e.after["tenant"]) for e in entries] == [
            (acme_running, prefix, "in_progress", "cancelling", "acme"),
            (globex_running, operator, "in_progress", "cancelling", "globex")]
        by_client = held_elsewhere(db, "acme", source.id, 3, datetime.now(UTC), prefix)
        assert (await acme_sdk.batches.cancel(by_client)).status == "cancelling"  # the client's cancel: the same move
        with pytest.raises(openai.BadRequestError, match="cannot be cancelled"):
            await acme_sdk.batches.cancel(by_client)
        assert len(audited(db, "batch.cancel")) == 2  # a client's cancel of its own batch is no admin's change

        # Its lease lapses: this replica's runner takes it and ends it cancelled, its lines unrun.
        with Session(db) as session:
            row = session.get(BatchRecord, acme_running)
            row.lease_until = datetime.now(UTC) - timedelta(seconds=1)
            session.add(row)
            session.commit()
        ended = await finished(acme_sdk, acme_running)
        assert ended.status == "cancelled" and ended.error_file_id is not None
        listed = {b["id"]: b for b in (await client.get("/admin/batches", headers=AUTH)).json()}
        assert listed[acme_running]["finished_at"] == listed[acme_running]["cancelled_at"] is not None
        assert listed[acme_running]["runner"] is None


async def test_stored_responses_listed_without_their_text_and_deleted_per_tenant(tmp_path):
    async with running({"echo": Echo()}, tmp_path) as client:
        db = client.gateway.db
        acme = await tenant(client, "acme", ("admin", "inference"))
        now = datetime.now(UTC)
        older = store_response(db, "acme", now - timedelta(minutes=2))
        newer = store_response(db, "acme", now - timedelta(minutes=1))
        theirs = store_response(db, "globex", now)
        store_response(db, "acme", now - timedelta(days=31))  # expired, not yet purged

        listed = await client.get("/admin/responses", headers=AUTH)
        assert listed.status_code == 200 and SECRET not in listed.text
        assert [r["id"] for r in listed.json()] == [theirs, newer, older]
        row = listed.json()[1]
        assert row == {"id": newer, "object": "response", "tenant": "acme", "key_prefix": "abcd1234", "model": "echo",
                       "created_at": int((now - timedelta(minutes=1)).timestamp()),
                       "expires_at": int((now - timedelta(minutes=1) + timedelta(days=30)).timestamp()),
                       "status": "completed", "usage": {"input_tokens": 7, "output_tokens": 2, "total_tokens": 9}}
        assert [r["id"] for r in (await client.get("/admin/responses", params={"tenant": "acme", "limit": 1},
                                                   headers=AUTH)).json()] == [newer]

        mine = await client.get("/admin/responses", headers=acme)
        assert [r["id"] for r in mine.json()] == [newer, older] and SECRET not in mine.text
        assert (await client.get("/admin/responses", params={"tenant": "globex"}, headers=acme)).status_code == 404
        assert (await client.delete(f"/admin/responses/{theirs}", headers=acme)).status_code == 404
        assert (await client.delete("/admin/responses/resp_nonesuch", headers=AUTH)).status_code == 404

        deleted = await client.delete(f"/admin/responses/{newer}", headers=acme)
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True
        assert (await client.delete(f"/admin/responses/{newer}", headers=acme)).status_code == 404
        with Session(db) as session:  # gone for its client too: /v1/responses reads these rows
            assert session.get(StoredResponse, newer) is None and session.get(StoredResponse, older) is not None
        assert (await client.delete(f"/admin/responses/{theirs}", headers=AUTH)).status_code == 200
        assert [r["id"] for r in (await client.get("/admin/responses", headers=AUTH)).json()] == [older]
        entries = audited(db, "response.delete")
        assert [(e.target, e.before["tenant"], e.after) for e in entries] == [(newer, "acme", None),
                                                                              (theirs, "globex", None)]
        assert SECRET not in json.dumps([e.before for e in entries])


def test_the_cli_lists_shows_and_cancels_batches_and_lists_and_deletes_responses(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path}/servegate.db"
    monkeypatch.setenv("SERVEGATE_DATABASE_URL", url)
    monkeypatch.setenv("COLUMNS", "240")  # the tables' every column, uncut
    db = make_engine(url)
    upgrade(db)
    now = datetime.now(UTC)
    with Session(db) as session:
        session.add(StoredFile(id="file-in", tenant="acme", purpose="batch", filename="in.jsonl", size=1, lines=3))
        session.add(BatchRecord(id="batch_done", tenant="acme", key_prefix="k1", endpoint="/v1/completions",
                                input_file_id="file-in", status="completed", total=3, completed=2, failed=1,
                                output_file_id="file-out", error_file_id="file-err", created_at=now,
                                completed_at=now + timedelta(seconds=5), expires_at=now + timedelta(hours=24)))
        session.commit()
    running = held_elsewhere(db, "globex", "file-in", 3, now + timedelta(seconds=1))
    acme = store_response(db, "acme", now)
    globex = store_response(db, "globex", now + timedelta(seconds=1))
    run = CliRunner().invoke

    listed = run(cli, ["batches", "list"])
    assert listed.exit_code == 0, listed.output
    assert listed.output.index(running) < listed.output.index("batch_done")  # newest first
    assert "3/3, 1 failed" in listed.output and "1/3" in listed.output
    as_json = json.loads(run(cli, ["batches", "list", "--json"]).output)
    assert [b["id"] for b in as_json] == [running, "batch_done"] and as_json[0]["runner"] == "replica-elsewhere"
    assert [b["id"] for b in json.loads(run(cli, ["batches", "list", "--tenant", "acme", "--json"]).output)] == \
        ["batch_done"]
    assert [b["id"] for b in json.loads(run(cli, ["batches", "list", "--status", "in_progress",
                                                 "--json"]).output)] == [running]
    bad = run(cli, ["batches", "list", "--status", "sleeping"])
    assert bad.exit_code == 2 and "one of" in bad.output

    shown = run(cli, ["batches", "show", "batch_done"])
    assert shown.exit_code == 0 and "2 completed, 1 failed, 3 in all" in shown.output
    assert "file-out" in shown.output and "file-err" in shown.output
    assert json.loads(run(cli, ["batches", "show", running, "--json"]).output)["tenant"] == "globex"
    assert run(cli, ["batches", "show", "batch_nonesuch"]).exit_code == 2

    cancelled = run(cli, ["batches", "cancel", running])
    assert cancelled.exit_code == 0 and f"batch {running} of tenant globex is cancelling" in cancelled.output
    again = run(cli, ["batches", "cancel", running])
    assert again.exit_code == 2 and "cannot be cancelled" in again.output
    assert run(cli, ["batches", "cancel", "batch_done"]).exit_code == 2

    responses = run(cli, ["responses", "list"])
    assert responses.exit_code == 0 and acme in responses.output and globex in responses.output
    assert SECRET not in responses.output
    assert [r["id"] for r in json.loads(run(cli, ["responses", "list", "--tenant", "acme", "--json"]).output)] == \
        [acme]
    deleted = run(cli, ["responses", "delete", acme])
    assert deleted.exit_code == 0 and f"deleted response {acme} of tenant acme" in deleted.output
    assert run(cli, ["responses", "delete", acme]).exit_code == 2
    assert [r["id"] for r in json.loads(run(cli, ["responses", "list", "--json"]).output)] == [globex]

    with Session(db) as session:
        entries = [(a.action, a.target) for a in session.exec(select(AuditLog).order_by(AuditLog.id))]
        actors = {a.actor for a in session.exec(select(AuditLog))}
    assert entries == [("batch.cancel", running), ("response.delete", acme)]
    assert all(actor.startswith("cli:") for actor in actors)
