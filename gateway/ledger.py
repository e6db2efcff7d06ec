"""The usage ledger: one record per request, never lost once its response has completed.

`record()` appends a JSON line to this process's spool file before the last byte of the
response is sent; a background writer moves the spool into the database in batches. Inserts
are idempotent on the request id, so replaying a spool after a crash cannot double-count.
A process killed with SIGKILL leaves its spool behind, locked by nobody; the next gateway
process (any replica sharing the spool directory) takes it over and ingests it. `write()`
reaches the kernel at once, which survives the death of the process; the writer's `fsync`
each flush bounds what a power loss could take to one flush interval.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import threading
import uuid
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import Engine
from sqlalchemy.dialects import postgresql, sqlite

from .models import UsageRecord

log = logging.getLogger("servegate.ledger")
ROTATE_BYTES = 1 << 20
DATETIME_FIELDS = ("started_at", "finished_at")


class UsageLedger:
    def __init__(self, engine: Engine, spool_dir: Path, flush_s: float = 0.5) -> None:
        self.engine, self.flush_s = engine, flush_s
        self.spool_dir = Path(spool_dir).expanduser()
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.spool_dir / f"usage-{uuid.uuid4().hex}.jsonl"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # marks the spool as owned by a live process
        self.offset = 0  # bytes of the spool already in the database
        self.lock = threading.Lock()
        self._closed = False

    def record(self, fields: dict) -> None:
        """Append one usage record; returns once the kernel holds it."""
        line = json.dumps(fields, default=_jsonable, separators=(",", ":")).encode() + b"\n"
        with self.lock:
            os.write(self.fd, line)

    # -- the writer -----------------------------------------------------------------------
    def flush(self) -> int:
        """Move new spool lines into the database; returns how many records were written."""
        with self.lock:
            size = os.fstat(self.fd).st_size
        if size == self.offset:
            return 0
        os.fsync(self.fd)
        data = os.pread(self.fd, size - self.offset, self.offset)
        complete = data[: data.rfind(b"\n") + 1]
        records = _parse(complete)
        self.insert(records)
        self.offset += len(complete)
        with self.lock:  # start the spool afresh once it is all in the database
            if self.offset >= ROTATE_BYTES and os.fstat(self.fd).st_size == self.offset:
                os.ftruncate(self.fd, 0)
                self.offset = 0
        return len(records)

    def insert(self, records: list[dict]) -> None:
        if not records:
            return
        dialect = self.engine.dialect.name
        insert = {"sqlite": sqlite.insert, "postgresql": postgresql.insert}[dialect]
        statement = insert(UsageRecord).on_conflict_do_nothing(index_elements=["request_id"])
        with self.engine.begin() as connection:
            connection.execute(statement, records)

    def recover_orphans(self) -> int:
        """Ingest and delete the spools of gateway processes that are gone."""
        recovered = 0
        for path in sorted(self.spool_dir.glob("usage-*.jsonl")):
            if path == self.path:
                continue
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # its process is alive
                os.close(fd)
                continue
            try:
                records = _parse(path.read_bytes())
                self.insert(records)
                recovered += len(records)
                path.unlink()
            finally:
                os.close(fd)
        if recovered:
            log.info("recovered %d usage records from spools of stopped gateway processes", recovered)
        return recovered

    async def run(self) -> None:
        await asyncio.to_thread(self.recover_orphans)
        while True:
            await asyncio.sleep(self.flush_s)
            try:
                await asyncio.to_thread(self.flush)
            except Exception as exc:  # the spool keeps the records; the next flush retries
                log.warning("usage flush failed, will retry: %s", exc)

    def close(self) -> None:
        """Flush what can be flushed and remove the spool if the database has it all."""
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
            if os.fstat(self.fd).st_size == self.offset:
                self.path.unlink()
        except Exception as exc:
            log.warning("usage spool %s kept for the next start: %s", self.path, exc)
        os.close(self.fd)


def _jsonable(value):
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"cannot serialize {type(value).__name__}")


def _parse(data: bytes) -> list[dict]:
    records = []
    for line in data.splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line torn by a crash mid-write: its response never completed
            continue
        for name in DATETIME_FIELDS:
            record[name] = datetime.fromisoformat(record[name]).astimezone(UTC)
        records.append(record)
    return records
