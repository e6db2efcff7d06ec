"""Runs `/v1/batches` jobs in the background, through the same endpoints clients call.

Each replica runs the batches whose lease it holds (`BatchRecord.runner`, `lease_until`, taken by a
conditional update, renewed while it runs): one replica at a time runs a given batch, and one that
dies hands its batches on when its lease lapses. A line's answer is written once (`BatchResult`'s
key refuses a second), so a replica that takes a batch over, or a gateway restarted, runs only the
lines without one; a graceful stop lets the lines under way finish first. Lines are billed as
requests of the batch's creator at the batch price (`api` "batch"), and yield to interactive
traffic: while any interactive request is in flight or waiting, a replica runs one line at a time.

A line is an ordinary request when it runs: each try reads the creator's key and tenant from the
database (not the directory's copy, up to a refresh interval old), so a revoked key or disabled
tenant stops the batch at its next line (`failed`, naming why) and changed limits and budgets count
from the next line on. Each try has a request id of its own, `<batch>-<line>-<suffix>`: a try cut
short by a crash is billed at its last checkpoint, and its rerun under another id is billed apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

from pydantic import ValidationError
from sqlalchemy import delete, func, or_, update
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from backends.base import BackendError
from gateway import files
from gateway.api import openai, responses
from gateway.api.batches import FINAL, BatchLine, new_file, publish, write_file
from gateway.errors import GatewayError, validation_error
from gateway.service import Gateway
from gateway.settings import BATCH_API
from gateway.tables import BatchRecord, BatchResult, StoredFile
from gateway.tenancy.auth import Principal, read_key_principal, read_tenant, require
from gateway.tenancy.ledger import UNREACHABLE

log = logging.getLogger("servegate.batches")
POLL_S = 1.0  # how often unclaimed batches are looked for
LEASE_S = 30.0  # a replica that stops renewing its lease for this long hands its batches on
RENEW_S = 3.0  # also how often a running batch's counts and status are refreshed
PURGE_S = 60.0  # how often expired responses and files are deleted
RETRY_S = (1.0, 30.0)  # a line refused for lack of capacity or quota waits this long, doubling
RETRIES = 10  # a line the backends keep refusing (503) fails after this many tries
STOP_GRACE_S = 20.0  # a graceful stop waits this long for the lines under way


async def answer(gateway: Gateway, principal: Principal, url: str, body: dict, request_id: str) -> tuple[int, dict]:
    """A line's status and body, as its endpoint answers a client (uploads refuse `stream`), run
    under `request_id` (the ledger's key, and the answer's id)."""
    try:
        if url == "/v1/chat/completions":
            request = openai.ChatCompletionRequest.model_validate(body)
            response = await openai.respond(None, gateway, principal, request, chat=True, api=BATCH_API,
                                            request_id=request_id, **openai.chat_prompt(request))
            return 200, json.loads(response.body)
        if url == "/v1/completions":
            request = openai.CompletionRequest.model_validate(body)
            response = await openai.respond(None, gateway, principal, request, chat=False, api=BATCH_API,
                                            request_id=request_id, **openai.completion_prompt(request))
            return 200, json.loads(response.body)
        if url == "/v1/embeddings":
            return 200, await openai.embed(None, gateway, principal, openai.EmbeddingRequest.model_validate(body),
                                           api=BATCH_API, request_id=request_id)
        return 200, await responses.create_response(gateway, principal, body, api=BATCH_API, response_id=request_id)
    except GatewayError as exc:
        error = exc
    except BackendError as exc:
        error = GatewayError.of(exc)
    except ValidationError as exc:
        error = validation_error(exc.errors())
    return error.status, error.openai_body()


def _output_line(result: BatchResult) -> dict:
    """A line of the output or error file, in OpenAI's shape."""
    if result.status_code == 0:  # never run: the batch expired or was cancelled first
        return {"id": f"batch_req_{result.request_id}", "custom_id": result.custom_id, "response": None,
                "error": result.body}
    return {"id": f"batch_req_{result.request_id}", "custom_id": result.custom_id,
            "response": {"status_code": result.status_code, "request_id": result.request_id, "body": result.body},
            "error": None}


class BatchRunner:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway, self.db, self.settings = gateway, gateway.db, gateway.settings
        self.name = f"replica-{uuid.uuid4().hex[:12]}"
        self.lines_in_flight = 0
        self._running: dict[str, asyncio.Task] = {}
        self._lines: set[asyncio.Task] = set()
        self._stopping = False

    # -- the loop ---------------------------------------------------------------------------
    async def run(self) -> None:
        purged = 0.0
        loop = asyncio.get_running_loop()
        while True:
            if loop.time() - purged > PURGE_S:
                await asyncio.to_thread(purge_expired, self.db)
                purged = loop.time()
            for batch_id in await asyncio.to_thread(self._claim):
                if batch_id not in self._running:
                    task = asyncio.create_task(self._run_batch(batch_id))
                    self._running[batch_id] = task
                    task.add_done_callback(lambda _, key=batch_id: self._running.pop(key, None))
            await asyncio.sleep(POLL_S)

    async def stop(self) -> None:
        """No new line starts; those under way finish (up to a grace period), and this replica's
        leases are handed back so that another takes its batches over at once."""
        self._stopping = True
        if self._lines:
            await asyncio.wait(self._lines, timeout=STOP_GRACE_S)
        for task in [*self._running.values(), *self._lines]:
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*self._running.values(), *self._lines)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self._release)

    def _claim(self) -> list[str]:
        """The unfinished batches this replica holds the lease of, taking the free and lapsed ones."""
        now = datetime.now(UTC)
        with Session(self.db) as session:
            ids = session.exec(select(BatchRecord.id).where(col(BatchRecord.status).not_in(FINAL))).all()
            claimed = []
            for batch_id in ids:
                taken = session.exec(update(BatchRecord).where(
                    BatchRecord.id == batch_id, col(BatchRecord.status).not_in(FINAL),
                    or_(col(BatchRecord.runner).is_(None), BatchRecord.runner == self.name,
                        col(BatchRecord.lease_until) < now),
                ).values(runner=self.name, lease_until=now + timedelta(seconds=LEASE_S)))
                if taken.rowcount == 1:
                    claimed.append(batch_id)
            session.commit()
        return claimed

    def _release(self) -> None:
        with Session(self.db) as session:
            session.exec(update(BatchRecord).where(BatchRecord.runner == self.name, col(BatchRecord.status)
                                                   .not_in(FINAL)).values(runner=None, lease_until=None))
            session.commit()

    # -- one batch --------------------------------------------------------------------------
    async def _run_batch(self, batch_id: str) -> None:
        try:
            await self._run(batch_id)
        except asyncio.CancelledError:
            raise
        except Exception:  # its lease lapses and the batch is taken up again
            log.exception("batch %s stopped on an error; it resumes when its lease is taken again", batch_id)

    async def _run(self, batch_id: str) -> None:
        batch, lines, done = await asyncio.to_thread(self._read, batch_id)
        # `refused`: the line at which the batch's key or tenant was found unable to call, and why
        state = {"status": batch.status, "held": True, "refused": None}
        renewing = asyncio.create_task(self._renew(batch_id, state))
        mine: list[asyncio.Task] = []
        try:
            for number, line in lines:
                if number in done:
                    continue
                if not self._going(batch, state):
                    break
                await self._slot()
                if not self._going(batch, state):
                    break
                task = asyncio.create_task(self._line(batch, number, line, state))
                self.lines_in_flight += 1
                self._lines.add(task)
                task.add_done_callback(self._line_done)
                mine.append(task)
            if mine:
                await asyncio.wait(mine)
        finally:
            renewing.cancel()
        for task in mine:  # a line stopped by the database's absence runs when the batch is taken up again
            if not task.cancelled() and isinstance(task.exception(), UNREACHABLE):
                raise task.exception()
        if self._stopping or not state["held"]:
            return
        if state["status"] == "cancelling":
            await asyncio.to_thread(self._finish, batch_id, "cancelled")
        elif state["refused"] is not None:
            number, refusal = state["refused"]
            await asyncio.to_thread(self._finish, batch_id, "failed", [{
                "code": refusal.code, "message": f"The batch stopped at line {number}: {refusal.message} The lines "
                "answered are in its output.", "line": number}])
        elif datetime.now(UTC) >= batch.expires_at:
            await asyncio.to_thread(self._finish, batch_id, "expired")
        else:
            await asyncio.to_thread(self._finish, batch_id, "completed")

    def _read(self, batch_id: str) -> tuple[BatchRecord, Iterator[tuple[int, BatchLine]], set[int]]:
        """The batch, its input's lines (read as they are consumed, a chunk of the file at a time)
        and the numbers of the lines answered."""
        with Session(self.db) as session:
            batch = session.get(BatchRecord, batch_id)
            source = session.get(StoredFile, batch.input_file_id)
            done = set(session.exec(select(BatchResult.line).where(BatchResult.batch_id == batch_id)).all())
        lines = ((number, BatchLine.model_validate_json(raw))
                 for number, raw in files.lines(files.read(self.db, source), source.size))
        return batch, lines, done

    def _going(self, batch: BatchRecord, state: dict) -> bool:
        """Whether the batch still starts lines, and tries again those refused for capacity or quota."""
        return not self._stopping and state["held"] and state["status"] == "in_progress" \
            and state["refused"] is None and datetime.now(UTC) < batch.expires_at

    def _principal(self, batch: BatchRecord) -> Principal:
        """Who a line runs as, as the database has it now (the directory's copy may be a refresh
        interval old): the key that created the batch (a token-made batch: its tenant, with the
        inference scope), with its current limits. Blocking; raises `GatewayError` as authentication
        does for a key revoked or expired, or a tenant removed or disabled."""
        if batch.key_prefix is None:
            return Principal(read_tenant(self.db, batch.tenant), f"batch:{batch.id}", frozenset({"inference"}))
        return require(read_key_principal(self.db, batch.key_prefix), "inference")

    async def _slot(self) -> None:
        """Wait for room: `batch_concurrency` lines at once, one while interactive requests run."""
        while True:
            members = self.gateway.fleet.members.values()
            interactive = sum(m.admission.in_flight + m.admission.queued for m in members) - self.lines_in_flight
            if self.lines_in_flight < (self.settings.batch_concurrency if interactive <= 0 else 1):
                return
            await asyncio.sleep(0.05)

    def _line_done(self, task: asyncio.Task) -> None:
        self._lines.discard(task)
        self.lines_in_flight -= 1

    async def _line(self, batch: BatchRecord, number: int, line: BatchLine, state: dict) -> None:
        """Run a line as an ordinary request, each try as its key and tenant stand then: one that
        may no longer call stops the batch with the line unanswered. Each try runs under an id of
        its own, the batch's and the line's with a fresh suffix, so the ledger tells apart a try
        that a crash cut short from the one answered."""
        pause = RETRY_S[0]
        for _ in range(RETRIES):
            try:
                principal = await asyncio.to_thread(self._principal, batch)
            except GatewayError as refusal:
                state["refused"] = state["refused"] or (number, refusal)
                return
            request_id = f"{batch.id}-{number}-{uuid.uuid4().hex[:12]}"
            status, body = await answer(self.gateway, principal, line.url, line.body, request_id)
            if status not in (429, 503) or datetime.now(UTC) >= batch.expires_at:
                break
            await asyncio.sleep(pause)  # out of capacity or quota: the line waits, it does not fail
            pause = min(pause * 2, RETRY_S[1])
            if not self._going(batch, state):  # cancelled, refused or stopped meanwhile: left to the batch's end
                return
        result = BatchResult(batch_id=batch.id, line=number, custom_id=line.custom_id, request_id=request_id,
                             status_code=status, body=body)
        await asyncio.to_thread(self._write, result)

    def _write(self, result: BatchResult) -> None:
        with Session(self.db) as session:
            session.add(result)
            try:
                session.commit()
            except IntegrityError:  # answered already, by a replica whose lease lapsed meanwhile
                session.rollback()

    async def _renew(self, batch_id: str, state: dict) -> None:
        """Renew the lease, and read the status (a cancel) and counts, until the batch ends."""
        while True:
            await asyncio.sleep(RENEW_S)
            try:
                state["held"], state["status"] = await asyncio.to_thread(self._renewed, batch_id)
            except Exception as exc:  # the database is away: the lease may lapse, the results are kept
                log.warning("batch %s: lease renewal failed: %s", batch_id, exc)

    def _renewed(self, batch_id: str) -> tuple[bool, str]:
        completed, failed = self._counts(batch_id)
        with Session(self.db) as session:
            held = session.exec(update(BatchRecord).where(BatchRecord.id == batch_id, BatchRecord.runner == self.name)
                                .values(lease_until=datetime.now(UTC) + timedelta(seconds=LEASE_S),
                                        completed=completed, failed=failed)).rowcount == 1
            session.commit()
            status = session.exec(select(BatchRecord.status).where(BatchRecord.id == batch_id)).one()
        return held, status

    def _counts(self, batch_id: str) -> tuple[int, int]:
        """Lines answered 200, and the others: counted by the database, not read out every renewal."""
        answered = func.count().filter(BatchResult.status_code == 200)
        query = select(answered, func.count()).where(BatchResult.batch_id == batch_id)
        with Session(self.db) as session:
            completed, total = session.exec(query).one()
        return completed, total - completed

    def _finish(self, batch_id: str, status: str, errors: list[dict] | None = None) -> None:
        """The batch's end: lines never run are answered as such (expired, cancelled, failed), its
        output and error files written a chunk at a time, then its files, counts and status set in
        one transaction."""
        now = datetime.now(UTC)
        batch, lines, done = self._read(batch_id)
        if status == "completed" and batch.status == "cancelling":  # a cancel that came as the last lines ran
            status = "cancelled"
        reason = {"expired": ("batch_expired", "This request could not be executed before the completion window "
                              "expired."),
                  "cancelled": ("batch_cancelled", "This request was not executed: the batch was cancelled."),
                  "failed": ("batch_failed", "This request was not executed: the batch failed.")}.get(status)
        if reason is not None:
            with Session(self.db) as session:
                for number, line in lines:
                    if number not in done:
                        session.add(BatchResult(batch_id=batch_id, line=number, custom_id=line.custom_id,
                                                request_id=uuid.uuid4().hex, status_code=0,
                                                body={"code": reason[0], "message": reason[1]}))
                        if len(session.new) >= 1000:  # written as they come, not all held
                            session.flush()
                session.commit()
        completed, failed = self._counts(batch_id)
        written = [self._write_results(batch, kind, count) for kind, count in (("output", completed),
                                                                              ("error", failed)) if count]
        with Session(self.db) as session:
            batch = session.get(BatchRecord, batch_id)
            for kind, file in written:
                publish(session, file, now + timedelta(seconds=self.settings.output_retention_s))
                setattr(batch, f"{kind}_file_id", file.id)
            batch.completed, batch.failed = completed, failed
            batch.status, batch.runner, batch.lease_until = status, None, None
            batch.finalizing_at = now
            setattr(batch, f"{status}_at", now)
            if errors:
                batch.errors = errors
            session.add(batch)
            session.commit()
        log.info("batch %s %s: %d answered, %d failed", batch_id, status, completed, failed)

    def _write_results(self, batch: BatchRecord, kind: str, count: int) -> tuple[str, StoredFile]:
        """The batch's output file (the lines answered 200) or error file (the others) in line
        order, written as the answers are read."""
        file = new_file(batch.tenant, f"batch_{kind}", f"{batch.id}_{kind}.jsonl", self.settings)
        file.lines = count
        with Session(self.db, expire_on_commit=False) as session:
            session.add(file)
            session.commit()
        answered = BatchResult.status_code == 200
        query = select(BatchResult).where(BatchResult.batch_id == batch.id, answered if kind == "output" else ~answered)
        with Session(self.db) as session:
            results = session.exec(query.order_by(col(BatchResult.line)).execution_options(yield_per=500))
            file.size = write_file(self.db, file, files.chunked(
                json.dumps(_output_line(r), ensure_ascii=False).encode() + b"\n" for r in results))
        return kind, file


def purge_expired(db) -> None:
    """Stored responses and files past their retention are deleted, files with their bytes. An
    input file stays while a batch that reads it is unfinished, and goes at the first purge after."""
    now = datetime.now(UTC)
    responses.purge_expired(db, now)
    read_by_a_batch = select(BatchRecord.id).where(BatchRecord.input_file_id == StoredFile.id,
                                                   col(BatchRecord.status).not_in(FINAL)).exists()
    expired = (col(StoredFile.expires_at) <= now, ~read_by_a_batch)
    with Session(db) as session:
        rows = session.exec(select(StoredFile).where(*expired)).all()
    for row in rows:
        with Session(db) as session:  # still expired when deleted: a batch created meanwhile extends its input's life
            if session.exec(delete(StoredFile).where(StoredFile.id == row.id, *expired)).rowcount:
                files.delete(session, row)
            session.commit()
