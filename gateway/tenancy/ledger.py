"""The usage ledger: one record per request, never lost once its response has completed, and
never stopped by one record.

`record()` appends a JSON line to this process's spool file before the last byte of the
response is sent; a background writer moves the spool into the database in batches. Inserts
are idempotent on the request id, so replaying a spool after a crash cannot double-count.
A process killed with SIGKILL leaves its spool behind, locked by nobody; the next gateway
process (any replica sharing the spool directory) takes it over and ingests it. `write()`
reaches the kernel at once, which survives the death of the process; the writer's `fsync`
each flush bounds what a power loss could take to one flush interval.

Calls still open are checkpointed beside the spool: each as it takes its reservation (`opened()`,
appended), then all every interval (`checkpoint()`: the file rewritten whole, atomically). Whoever
takes over a dead process's spool bills each open call what it had delivered at its last
checkpoint, as an `interrupted` record, unless its final record made it, and releases what it
reserved: no call that reserved is left out, however short.

A record the database refuses for what it holds (a number out of range, a field too long), or
that does not parse, is quarantined: appended to `quarantine.jsonl` in the spool directory with
the reason, logged and counted, and the records after it flow on. A database that cannot be
reached is no record's fault: the batch waits in the spool for the next flush.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import math
import os
import threading
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import Engine, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import InterfaceError, OperationalError

from backends.base import MAX_TOKENS
from gateway.tables import UsageRecord
from gateway.tenancy.quotas import DAY, MINUTE, Spent, month_of

log = logging.getLogger("servegate.ledger")
ROTATE_BYTES = 1 << 20
DATETIME_FIELDS = ("started_at", "finished_at")
TOKEN_FIELDS = ("prompt_tokens", "completion_tokens", "cached_tokens")
MAX_COST = 2**63 - 1  # nano-dollars: the column is a BIGINT
QUARANTINE = "quarantine.jsonl"
# The database is unreachable or busy: no record's fault, the batch waits for the next flush.
UNREACHABLE = (OperationalError, InterfaceError)


class Refused(ValueError):
    """A record the ledger will not store, and why."""


class Torn(Refused):
    """A line that is not JSON: a write a crash cut short."""


@dataclass(frozen=True)
class Recovered:
    """What a dead process left: records ingested, and the calls it had open, each as billed (its
    final record where it made it, else its last checkpoint, `interrupted`) with what it had
    reserved, to be settled (a settlement that landed before the process died is not repeated)."""

    records: int
    open_calls: list[dict]


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
        self.quarantined = 0  # records refused since this process started
        self._checkpointed = False  # the checkpoint file holds open calls
        self._closed = False

    def record(self, fields: dict) -> None:
        """Append one usage record; returns once the kernel holds it."""
        line = _line(fields)
        with self.lock:
            os.write(self.fd, line)

    def opened(self, call: dict) -> None:
        """A call's first checkpoint, appended as it takes its reservation (a line, as `record`)."""
        with open(_open_path(self.path), "ab") as checkpoints:
            checkpoints.write(_line(call))
        self._checkpointed = True

    def checkpoint(self, open_calls: list[dict]) -> None:
        """What each open call has used so far, replacing the checkpoints whole. Called on the same
        thread as `opened`: one appended while this rewrite was under way would be lost with the
        file it replaces."""
        path = _open_path(self.path)
        if not open_calls:
            if self._checkpointed:
                path.unlink(missing_ok=True)
                self._checkpointed = False
            return
        partial = path.with_suffix(".tmp")
        partial.write_bytes(b"".join(_line(fields) for fields in open_calls))
        partial.replace(path)  # atomic: a reader sees the old checkpoints or the new ones
        self._checkpointed = True

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
        written = self.store(complete.splitlines(), torn_ok=False)
        self.offset += len(complete)
        with self.lock:  # start the spool afresh once it is all in the database
            if self.offset >= ROTATE_BYTES and os.fstat(self.fd).st_size == self.offset:
                os.ftruncate(self.fd, 0)
                self.offset = 0
        return written

    def store(self, lines: list[bytes], *, torn_ok: bool = True) -> int:
        """Insert the records these spool lines hold, quarantining those refused; returns how many
        were stored. Raises only where the database cannot be reached. `torn_ok`: a line that is
        not JSON is a write torn by a crash (its response never completed), skipped silently."""
        records = []
        for line in lines:
            try:
                records.append(parse(line))
            except Torn as torn:
                if not torn_ok:
                    self.quarantine(line, str(torn))
            except Refused as refused:
                self.quarantine(line, str(refused))
        try:
            self._insert(records)
            return len(records)
        except UNREACHABLE:
            raise
        except Exception:  # one of them is refused: find it, and let the others in
            stored = 0
            for record in records:
                try:
                    self._insert([record])
                    stored += 1
                except UNREACHABLE:
                    raise
                except Exception as exc:
                    self.quarantine(_line(record), f"the database refused it: {type(exc).__name__}: "
                                                   f"{str(exc).splitlines()[0][:300]}")
            return stored

    def _insert(self, records: list[dict]) -> None:
        if not records:
            return
        dialect = self.engine.dialect.name
        insert = {"sqlite": sqlite.insert, "postgresql": postgresql.insert}[dialect]
        statement = insert(UsageRecord).on_conflict_do_nothing(index_elements=["request_id"])
        with self.engine.begin() as connection:
            connection.execute(statement, records)

    def quarantine(self, line: bytes, reason: str) -> None:
        """Keep a refused record aside, with why, for an operator to look at."""
        try:
            request_id = json.loads(line).get("request_id")
        except (ValueError, AttributeError):
            request_id = None
        entry = json.dumps({"reason": reason, "at": datetime.now(UTC).isoformat(),
                            "line": line.decode(errors="replace").rstrip("\n")}) + "\n"
        with open(self.spool_dir / QUARANTINE, "a", encoding="utf-8") as kept:
            kept.write(entry)
        self.quarantined += 1
        log.error("usage record quarantined: %s", reason, extra={"request_id": str(request_id)[:64]})

    def recover_orphans(self) -> Recovered:
        """Ingest and delete the spools of gateway processes that are gone, and bill the calls
        they had open at their last checkpoint."""
        recovered, open_calls = 0, []
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
                spooled = path.read_bytes().splitlines()
                recovered += self.store(spooled)
                checkpoint = _open_path(path)
                if checkpoint.exists():  # after the final records: those of calls that did finish win
                    lines = checkpoint.read_bytes().splitlines()
                    self.store(lines)
                    open_calls += _as_billed([json.loads(line) for line in lines if _valid(line)], spooled)
                    checkpoint.unlink()
                path.unlink()
            finally:
                os.close(fd)
        if recovered or open_calls:
            log.info("recovered %d usage records and %d open calls from spools of stopped gateway processes",
                     recovered, len(open_calls))
        return Recovered(recovered, open_calls)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            try:
                await asyncio.to_thread(self.flush)
            except UNREACHABLE as exc:  # the spool keeps the records; the next flush retries
                log.warning("usage flush failed, will retry: %s", str(exc).splitlines()[0])

    def close(self) -> None:
        """Flush what can be flushed and remove the spool if the database has it all."""
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
            _open_path(self.path).unlink(missing_ok=True)  # every call has ended, its final record written
            if os.fstat(self.fd).st_size == self.offset:
                self.path.unlink()
        except Exception as exc:
            log.warning("usage spool %s kept for the next start: %s", self.path, exc)
        os.close(self.fd)


def spent(engine: Engine, now: float) -> list[Spent]:
    """What each tenant, key and adapter used in the current windows (`quotas.COUNTERS`: this minute's
    requests and tokens, today's tokens and cost, this month's cost), by the ledger: sums in the
    database, a query per window and scope kind."""
    moment = datetime.fromtimestamp(now, UTC)
    minute, day, month = int(now // MINUTE), int(now // DAY), month_of(now)
    tokens = UsageRecord.prompt_tokens + UsageRecord.completion_tokens
    cost = func.sum(UsageRecord.cost_nano_usd)
    windows = (  # since, then (counter key, window, the sum) for each counter of that window
        (datetime.fromtimestamp(minute * MINUTE, UTC), (("rpm", minute, func.count()),
                                                         ("tpm", minute, func.sum(tokens)))),
        (datetime.fromtimestamp(day * DAY, UTC), (("tpd", day, func.sum(tokens)), ("usd-day", day, cost))),
        (datetime(moment.year, moment.month, 1, tzinfo=UTC), (("usd-month", month, cost),)),
    )
    found = []
    with engine.connect() as connection:
        for since, counters in windows:
            for kind, column in (("tenant", UsageRecord.tenant), ("key", UsageRecord.key_prefix),
                                 ("adapter", UsageRecord.adapter)):
                query = select(column, *(total for _, _, total in counters)).where(
                    UsageRecord.started_at >= since, column.is_not(None)).group_by(column)
                for name, *totals in connection.execute(query):
                    found += [Spent(f"{kind}:{name}", key, window, int(total or 0))
                              for (key, window, _), total in zip(counters, totals)]
    return found


def _as_billed(checkpoints: list[dict], spooled: list[bytes]) -> list[dict]:
    """Each checkpointed call as the ledger bills it: by its final record where that made it into the
    spool (its settlement may not have), else by its checkpoint; with what it reserved."""
    finals = {}
    for line in spooled:
        with contextlib.suppress(ValueError, AttributeError):  # torn or refused: stored as such already
            record = json.loads(line)
            finals[record.get("request_id")] = record
    return [finals.get(call["request_id"], call) | {"reservation": call.get("reservation")} for call in checkpoints]


def _open_path(spool: Path) -> Path:
    """Where a spool's open streams are checkpointed."""
    return spool.with_suffix(".open")


def _line(fields: dict) -> bytes:
    return json.dumps(fields, default=_jsonable, separators=(",", ":")).encode() + b"\n"


def _jsonable(value):
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"cannot serialize {type(value).__name__}")


def _valid(line: bytes) -> bool:
    try:
        parse(line)
        return True
    except Refused:
        return False


def parse(line: bytes) -> dict:
    """One spool line as a database row, every figure checked against its column; raises
    `Refused` naming what is wrong. Lines of every earlier version parse (fields they lack take
    the column's default; fields the table no longer has are dropped)."""
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise Torn(f"not JSON: {exc}") from None
    if not isinstance(record, dict) or not isinstance(record.get("request_id"), str):
        raise Refused("not a usage record (no request_id)")
    row = {name: record[name] for name in UsageRecord.model_fields if name in record}
    for name in TOKEN_FIELDS:
        _whole(row, name, MAX_TOKENS)
    _whole(row, "cost_nano_usd", MAX_COST)
    for name in ("ttft_ms", "latency_ms"):
        value = row.get(name)
        if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise Refused(f"{name} = {value!r} is not a duration")
    for name in DATETIME_FIELDS:
        try:
            row[name] = datetime.fromisoformat(row[name]).astimezone(UTC)
        except (KeyError, TypeError, ValueError, OverflowError):
            raise Refused(f"{name} = {row.get(name)!r} is not a date") from None
    return row


def _whole(row: dict, name: str, most: int) -> None:
    value = row.get(name, 0)
    if not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= most):
        raise Refused(f"{name} = {str(value)[:40]} is outside [0, {most}]")
