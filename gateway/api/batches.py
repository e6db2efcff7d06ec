"""OpenAI's /v1/files and /v1/batches: JSONL uploads checked line by line, batch jobs over them,
and their output and error files. `gateway/api/batch_runner.py` runs the jobs."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy import and_, delete, func, or_, update
from sqlmodel import Session, col, select

from backends.base import InvalidRequest
from gateway import files
from gateway.api.deps import GatewayDep, InferencePrincipal
from gateway.api.openai import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from gateway.api.responses import Metadata
from gateway.errors import GatewayError
from gateway.settings import Settings
from gateway.tables import BatchRecord, StoredFile, Tenant

router = APIRouter(prefix="/v1", tags=["openai"])

# What a batch's lines may call, and the body each is checked against on upload (a Responses body
# is checked by its endpoint when it runs: its shape is open-ended).
ENDPOINTS: dict[str, type[BaseModel] | None] = {
    "/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
    "/v1/embeddings": EmbeddingRequest, "/v1/responses": None,
}
FINAL = ("completed", "failed", "expired", "cancelled")
LISTED_ERRORS = 20  # line errors named in an upload's refusal


def _not_found(kind: str, id_: str) -> GatewayError:
    return GatewayError(404, f"No {kind} with id {id_!r}.", "invalid_request_error", code=f"{kind}_not_found",
                        param=f"{kind}_id")


def _moment(at: datetime | None) -> int | None:
    return None if at is None else int(at.timestamp())


# -- files ------------------------------------------------------------------------------------
class BatchLine(BaseModel):
    model_config = ConfigDict(extra="forbid")

    custom_id: Annotated[str, Field(min_length=1, max_length=512)]
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


LINE_ENVELOPE_BYTES = 4096  # what a line holds around its body: custom_id, method, url
WRITE_DEADLINE = timedelta(hours=1)  # a file still being written this long after it began was left by a dead process


def check_lines(lines: Iterable[tuple[int, bytes | None]], max_lines: int, max_body: int) -> int:
    """The number of a batch input's lines, each a JSON request to an endpoint batches may call
    with a body that endpoint takes (of at most `max_body` bytes) and a custom_id of its own; else
    InvalidRequest naming each bad line's number. Reads the lines as they come, holding none."""
    count, errors, seen = 0, [], set()
    for number, raw in lines:
        count += 1
        if count > max_lines:
            raise InvalidRequest(f"the file holds more than the {max_lines} lines a batch takes", param="file")
        try:
            line = _checked(raw, max_body, seen)
        except (ValidationError, ValueError) as exc:
            errors.append(f"line {number}: {_first_error(exc)}")
            continue
        seen.add(line.custom_id)
    if errors:
        more = f" (and {len(errors) - LISTED_ERRORS} more)" if len(errors) > LISTED_ERRORS else ""
        raise InvalidRequest("; ".join(errors[:LISTED_ERRORS]) + more, param="file")
    if not count:
        raise InvalidRequest("the file holds no request lines", param="file")
    return count


def _checked(raw: bytes | None, max_body: int, seen: set[str]) -> BatchLine:
    too_large = f"its body is larger than the {max_body} bytes a request body may hold"
    if raw is None:
        raise ValueError(f"the line is longer than {max_body + LINE_ENVELOPE_BYTES} bytes: {too_large}")
    try:
        text = raw.decode()
    except UnicodeDecodeError as exc:
        raise ValueError(f"the line is not UTF-8 text (byte {exc.start})") from None
    line = BatchLine.model_validate_json(text)
    if len(raw) > max_body:  # the line is over the cap: is its body, sent alone?
        if len(json.dumps(line.body, separators=(",", ":"), ensure_ascii=False).encode()) > max_body:
            raise ValueError(too_large)
    if line.url not in ENDPOINTS:
        raise ValueError(f"url {line.url!r} is not one batches call ({', '.join(ENDPOINTS)})")
    if line.custom_id in seen:
        raise ValueError(f"custom_id {line.custom_id!r} is used by an earlier line")
    if (model := ENDPOINTS[line.url]) is not None:
        model.model_validate(line.body)
    elif not isinstance(line.body.get("input"), (str, list)):
        raise ValueError("body.input must be a string or a list of items")
    if line.body.get("stream"):
        raise ValueError("body.stream must be false: a batch's answers are written to its output file")
    return line


def _first_error(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return f"{where}: {first['msg']}" if where else first["msg"]
    return str(exc)


def file_json(row: StoredFile) -> dict:
    return {"id": row.id, "object": "file", "bytes": row.size, "created_at": _moment(row.created_at),
            "expires_at": _moment(row.expires_at), "filename": row.filename, "purpose": row.purpose,
            "status": "processed", "status_details": None}


def _unexpired(now: datetime):
    return or_(col(StoredFile.expires_at).is_(None), col(StoredFile.expires_at) > now)


def _readable(now: datetime):
    """A file whose bytes are all written and that has not expired."""
    return and_(StoredFile.status == "processed", _unexpired(now))


def _read_file(db, tenant: str, file_id: str) -> StoredFile:
    query = select(StoredFile).where(StoredFile.id == file_id, StoredFile.tenant == tenant,
                                     _readable(datetime.now(UTC)))
    with Session(db) as session:
        row = session.exec(query).first()
    if row is None:
        raise _not_found("file", file_id)
    return row


def lock_tenant(session: Session, tenant: str) -> None:
    """Holds the tenant's row until the session's transaction ends, so that checking what the
    tenant has (its files' bytes, its unfinished batches) and adding to it is one step for
    concurrent requests: a write that changes nothing takes PostgreSQL's row lock and SQLite's
    write lock alike."""
    session.exec(update(Tenant).where(Tenant.name == tenant).values(name=Tenant.name))


def new_file(tenant: str, purpose: str, filename: str, settings: Settings) -> StoredFile:
    """The row of a file about to be written: counted against its tenant's quota, shown to no one,
    and purged as a dead process's leftover unless `publish` marks it written first."""
    now = datetime.now(UTC)
    directory = None if settings.file_store_dir is None else str(settings.file_store_dir.absolute())
    return StoredFile(id=f"file-{uuid.uuid4().hex}", tenant=tenant, purpose=purpose, filename=filename[:255],
                      status="writing", directory=directory, created_at=now, expires_at=now + WRITE_DEADLINE)


def write_file(db, row: StoredFile, chunks: Iterable[bytes]) -> int:
    """Writes the bytes of a file whose row is in the database; the number written. A failure
    deletes the file, row and bytes."""
    try:
        return files.write(db, row, chunks)
    except BaseException:
        with Session(db) as session:
            session.exec(delete(StoredFile).where(StoredFile.id == row.id))
            files.delete(session, row)
            session.commit()
        raise


def publish(session: Session, row: StoredFile, expires_at: datetime | None) -> None:
    """Marks a file written, in the caller's transaction: from then on its tenant sees it."""
    row.status, row.expires_at = "processed", expires_at
    session.exec(update(StoredFile).where(StoredFile.id == row.id).values(
        status=row.status, size=row.size, lines=row.lines, expires_at=expires_at))


def _store_upload(gateway, tenant: str, upload: UploadFile, lifetime_s: float) -> StoredFile:
    """Checks an upload's lines, then writes it, both read a chunk at a time from where Starlette
    spooled it (a temporary file)."""
    settings = gateway.settings
    if upload.size > settings.file_max_bytes:
        raise GatewayError(413, f"The file is {upload.size} bytes, more than the {settings.file_max_bytes} a file may "
                           "hold.", "invalid_request_error", code="file_too_large", param="file")
    upload.file.seek(0)
    longest = settings.max_body_bytes + LINE_ENVELOPE_BYTES
    count = check_lines(files.lines(files.chunks_of(upload.file), longest), settings.batch_max_lines,
                        settings.max_body_bytes)
    row = new_file(tenant, "batch", upload.filename or "input.jsonl", settings)
    row.size, row.lines = upload.size, count
    with Session(gateway.db, expire_on_commit=False) as session:
        lock_tenant(session, tenant)
        used = session.exec(select(func.coalesce(func.sum(StoredFile.size), 0)).where(
            StoredFile.tenant == tenant, _unexpired(row.created_at))).one()
        if used + row.size > settings.file_quota_bytes:
            raise GatewayError(400, f"The file's {row.size} bytes would exceed the storage quota of tenant {tenant!r}: "
                               f"its files hold {used} bytes of the {settings.file_quota_bytes} allowed. Delete files "
                               "or let them expire first.", "invalid_request_error", code="file_quota_exceeded",
                               param="file")
        session.add(row)
        session.commit()
    upload.file.seek(0)
    write_file(gateway.db, row, files.chunks_of(upload.file))
    with Session(gateway.db) as session:
        publish(session, row, row.created_at + timedelta(seconds=lifetime_s))
        session.commit()
    return row


@router.post("/files")
async def upload_file(
    principal: InferencePrincipal, gateway: GatewayDep, file: Annotated[UploadFile, File()],
    purpose: Annotated[str, Form()],
    expires_anchor: Annotated[Literal["created_at"] | None, Form(alias="expires_after[anchor]")] = None,
    expires_seconds: Annotated[int | None, Form(alias="expires_after[seconds]", ge=3600, le=30 * 86400)] = None,
):
    """A batch input, kept until `expires_after` seconds after its creation (OpenAI's bounds: an
    hour to 30 days), else `input_retention_s`."""
    if purpose != "batch":
        raise InvalidRequest(f"purpose {purpose!r} is not accepted: files here are batch inputs (purpose 'batch')",
                             param="purpose")
    if (expires_anchor is None) != (expires_seconds is None):
        raise InvalidRequest("expires_after needs both its anchor ('created_at') and its seconds",
                             param="expires_after")
    lifetime_s = gateway.settings.input_retention_s if expires_seconds is None else expires_seconds
    row = await asyncio.to_thread(_store_upload, gateway, principal.tenant.name, file, lifetime_s)
    return file_json(row)


@router.get("/files")
async def list_files(principal: InferencePrincipal, gateway: GatewayDep, purpose: str | None = None,
                     limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000):
    def read() -> list[StoredFile]:
        query = select(StoredFile).where(StoredFile.tenant == principal.tenant.name, _readable(datetime.now(UTC)))
        if purpose is not None:
            query = query.where(StoredFile.purpose == purpose)
        with Session(gateway.db) as session:
            return list(session.exec(query.order_by(col(StoredFile.created_at).desc()).limit(limit)))

    rows = await asyncio.to_thread(read)
    return {"object": "list", "data": [file_json(r) for r in rows], "has_more": len(rows) == limit}


@router.get("/files/{file_id}")
async def get_file(file_id: str, principal: InferencePrincipal, gateway: GatewayDep):
    return file_json(await asyncio.to_thread(_read_file, gateway.db, principal.tenant.name, file_id))


@router.get("/files/{file_id}/content")
async def file_content(file_id: str, principal: InferencePrincipal, gateway: GatewayDep):
    row = await asyncio.to_thread(_read_file, gateway.db, principal.tenant.name, file_id)
    return StreamingResponse(files.read(gateway.db, row), media_type="application/jsonl",
                             headers={"Content-Length": str(row.size)})


@router.delete("/files/{file_id}")
async def delete_file(file_id: str, principal: InferencePrincipal, gateway: GatewayDep):
    tenant = principal.tenant.name

    def remove() -> None:
        row = _read_file(gateway.db, tenant, file_id)
        with Session(gateway.db) as session:
            lock_tenant(session, tenant)  # a batch created meanwhile on this file is seen below
            running = session.exec(select(func.count()).select_from(BatchRecord).where(
                BatchRecord.input_file_id == file_id, col(BatchRecord.status).not_in(FINAL))).one()
            if running:
                raise InvalidRequest(f"file {file_id!r} is the input of a batch still running", param="file_id")
            if not session.exec(delete(StoredFile).where(StoredFile.id == file_id)).rowcount:
                raise _not_found("file", file_id)
            files.delete(session, row)
            session.commit()

    await asyncio.to_thread(remove)
    return {"id": file_id, "object": "file", "deleted": True}


# -- batches ----------------------------------------------------------------------------------
class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: Literal["24h"] = "24h"
    metadata: Metadata | None = None


def batch_json(row: BatchRecord) -> dict:
    return {
        "id": row.id, "object": "batch", "endpoint": row.endpoint, "errors": {"object": "list", "data": row.errors}
        if row.errors else None, "input_file_id": row.input_file_id, "completion_window": row.completion_window,
        "status": row.status, "output_file_id": row.output_file_id, "error_file_id": row.error_file_id,
        "created_at": _moment(row.created_at), "expires_at": _moment(row.expires_at),
        **{f"{moment}_at": _moment(getattr(row, f"{moment}_at")) for moment in (
            "in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")},
        "request_counts": {"total": row.total, "completed": row.completed, "failed": row.failed},
        "metadata": row.labels,
    }


def read_batch(db, tenant: str, batch_id: str) -> BatchRecord:
    with Session(db) as session:
        row = session.get(BatchRecord, batch_id)
    if row is None or row.tenant != tenant:
        raise _not_found("batch", batch_id)
    return row


@router.post("/batches")
async def create_batch(body: BatchCreate, principal: InferencePrincipal, gateway: GatewayDep):
    if body.endpoint not in ENDPOINTS:
        raise InvalidRequest(f"endpoint {body.endpoint!r} is not one batches call ({', '.join(ENDPOINTS)})",
                             param="endpoint")
    tenant, settings = principal.tenant.name, gateway.settings

    def create() -> BatchRecord:
        source = _read_file(gateway.db, tenant, body.input_file_id)
        if source.purpose != "batch":
            raise InvalidRequest(f"file {source.id!r} is a batch's {source.purpose}, not an input",
                                 param="input_file_id")
        for number, raw in files.lines(files.read(gateway.db, source), source.size):
            if (url := json.loads(raw)["url"]) != body.endpoint:
                raise InvalidRequest(f"line {number} of {source.id!r} calls {url!r}, not the batch's endpoint "
                                     f"{body.endpoint!r}", param="input_file_id")
        now = datetime.now(UTC)
        expires = now + timedelta(hours=24)
        with Session(gateway.db) as session:
            lock_tenant(session, tenant)  # batches created at once count each other
            active = session.exec(select(func.count()).select_from(BatchRecord).where(
                BatchRecord.tenant == tenant, col(BatchRecord.status).not_in(FINAL))).one()
            if active >= settings.batch_active_per_tenant:
                raise GatewayError(429, f"The tenant {tenant!r} has {active} batches unfinished, its limit; create "
                                   "more once some finish or are cancelled.", "rate_limit_exceeded",
                                   code="batch_limit_exceeded")
            # The input is kept at least as long as the batch may run: an input about to expire gets the
            # batch's end as its own (a write to its row, which a purge under way sees).
            session.exec(update(StoredFile).where(StoredFile.id == source.id, _readable(now),
                                                 col(StoredFile.expires_at) < expires).values(expires_at=expires))
            if session.exec(select(StoredFile.id).where(StoredFile.id == source.id, _readable(now))).first() is None:
                raise _not_found("file", source.id)  # deleted or expired since it was read above
            row = BatchRecord(id=f"batch_{uuid.uuid4().hex}", tenant=tenant, key_prefix=principal.key_prefix,
                              endpoint=body.endpoint, input_file_id=source.id, completion_window="24h",
                              status="in_progress", total=source.lines, labels=body.metadata, created_at=now,
                              in_progress_at=now, expires_at=expires)
            session.add(row)
            session.commit()
            session.refresh(row)
        return row

    return batch_json(await asyncio.to_thread(create))


@router.get("/batches/{batch_id}")
async def get_batch(batch_id: str, principal: InferencePrincipal, gateway: GatewayDep):
    return batch_json(await asyncio.to_thread(read_batch, gateway.db, principal.tenant.name, batch_id))


def mark_cancelling(session: Session, batch_id: str) -> BatchRecord:
    """Move a batch to `cancelling` in the caller's transaction (committed by the caller): its
    runner takes no more lines, those running finish, and it ends `cancelled` with what was done.
    A batch finished or already cancelling refuses. The client's cancel and the admin API's share it."""
    now = datetime.now(UTC)
    moved = session.exec(update(BatchRecord).where(
        BatchRecord.id == batch_id, col(BatchRecord.status).not_in((*FINAL, "cancelling")),
    ).values(status="cancelling", cancelling_at=now)).rowcount  # conditional: a runner may be finishing it
    row = session.get(BatchRecord, batch_id)
    if not moved:
        raise InvalidRequest(f"batch {batch_id!r} is {row.status}: it cannot be cancelled", param="batch_id")
    return row


@router.post("/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, principal: InferencePrincipal, gateway: GatewayDep):
    """The batch stops taking lines; those running finish, and it ends `cancelled` with what was done."""

    def cancel() -> BatchRecord:
        read_batch(gateway.db, principal.tenant.name, batch_id)
        with Session(gateway.db) as session:
            row = mark_cancelling(session, batch_id)
            session.commit()
            session.refresh(row)
        return row

    return batch_json(await asyncio.to_thread(cancel))


@router.get("/batches")
async def list_batches(principal: InferencePrincipal, gateway: GatewayDep, after: str | None = None,
                       limit: Annotated[int, Query(ge=1, le=100)] = 20):
    def read() -> list[BatchRecord]:
        mine = BatchRecord.tenant == principal.tenant.name  # another tenant's batch is no cursor: as if unknown
        query = select(BatchRecord).where(mine)
        with Session(gateway.db) as session:
            if after is not None and (cursor := session.exec(select(BatchRecord.created_at).where(
                    BatchRecord.id == after, mine)).first()) is not None:
                query = query.where(BatchRecord.created_at < cursor)
            return list(session.exec(query.order_by(col(BatchRecord.created_at).desc()).limit(limit + 1)))

    rows = await asyncio.to_thread(read)
    data = [batch_json(r) for r in rows[:limit]]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit}
