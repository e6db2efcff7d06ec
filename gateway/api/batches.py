"""OpenAI's /v1/files and /v1/batches: JSONL uploads checked line by line, batch jobs over them,
and their output and error files. `gateway/api/batch_runner.py` runs the jobs."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy import func, update
from sqlmodel import Session, col, select

from backends.base import InvalidRequest
from gateway.api.deps import GatewayDep, InferencePrincipal
from gateway.api.openai import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from gateway.api.responses import Metadata
from gateway.errors import GatewayError
from gateway.tables import BatchRecord, StoredFile

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


def check_lines(content: bytes, max_lines: int) -> list[BatchLine]:
    """A batch input's lines, each a JSON request to an endpoint batches may call with a body that
    endpoint takes and a custom_id of its own; else InvalidRequest naming each bad line's number."""
    try:
        text = content.decode()
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"the file is not UTF-8 text (byte {exc.start})", param="file") from None
    rows = [(number, raw) for number, raw in enumerate(text.splitlines(), 1) if raw.strip()]
    if not rows:
        raise InvalidRequest("the file holds no request lines", param="file")
    if len(rows) > max_lines:
        raise InvalidRequest(f"the file holds {len(rows)} lines, more than the {max_lines} a batch takes",
                             param="file")
    lines, errors, seen = [], [], set()
    for number, raw in rows:
        try:
            line = BatchLine.model_validate_json(raw)
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
        except (ValidationError, ValueError) as exc:
            errors.append(f"line {number}: {_first_error(exc)}")
            continue
        seen.add(line.custom_id)
        lines.append(line)
    if errors:
        more = f" (and {len(errors) - LISTED_ERRORS} more)" if len(errors) > LISTED_ERRORS else ""
        raise InvalidRequest("; ".join(errors[:LISTED_ERRORS]) + more, param="file")
    return lines


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


def _read_file(db, tenant: str, file_id: str) -> StoredFile:
    with Session(db) as session:
        row = session.get(StoredFile, file_id)
    if row is None or row.tenant != tenant or (row.expires_at is not None and row.expires_at <= datetime.now(UTC)):
        raise _not_found("file", file_id)
    return row


@router.post("/files")
async def upload_file(principal: InferencePrincipal, gateway: GatewayDep, file: Annotated[UploadFile, File()],
                      purpose: Annotated[str, Form()]):
    if purpose != "batch":
        raise InvalidRequest(f"purpose {purpose!r} is not accepted: files here are batch inputs (purpose 'batch')",
                             param="purpose")
    content = await file.read()
    lines = await asyncio.to_thread(check_lines, content, gateway.settings.batch_max_lines)
    row = StoredFile(id=f"file-{uuid.uuid4().hex}", tenant=principal.tenant.name, purpose=purpose,
                     filename=(file.filename or "input.jsonl")[:255], size=len(content), lines=len(lines),
                     content=content)
    await asyncio.to_thread(_add, gateway.db, row)
    return file_json(row)


def _add(db, row) -> None:
    with Session(db) as session:
        session.add(row)
        session.commit()
        session.refresh(row)


@router.get("/files")
async def list_files(principal: InferencePrincipal, gateway: GatewayDep, purpose: str | None = None,
                     limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000):
    def read() -> list[StoredFile]:
        query = select(StoredFile).where(StoredFile.tenant == principal.tenant.name)
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
    return Response(row.content, media_type="application/jsonl")


@router.delete("/files/{file_id}")
async def delete_file(file_id: str, principal: InferencePrincipal, gateway: GatewayDep):
    def delete() -> None:
        row = _read_file(gateway.db, principal.tenant.name, file_id)
        with Session(gateway.db) as session:
            running = session.exec(select(func.count()).select_from(BatchRecord).where(
                BatchRecord.input_file_id == file_id, col(BatchRecord.status).not_in(FINAL))).one()
            if running:
                raise InvalidRequest(f"file {file_id!r} is the input of a batch still running", param="file_id")
            session.delete(session.merge(row))
            session.commit()

    await asyncio.to_thread(delete)
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
        for number, raw in enumerate(source.content.decode().splitlines(), 1):
            if raw.strip() and json.loads(raw)["url"] != body.endpoint:
                raise InvalidRequest(f"line {number} of {source.id!r} calls {json.loads(raw)['url']!r}, not the "
                                     f"batch's endpoint {body.endpoint!r}", param="input_file_id")
        now = datetime.now(UTC)
        with Session(gateway.db) as session:
            active = session.exec(select(func.count()).select_from(BatchRecord).where(
                BatchRecord.tenant == tenant, col(BatchRecord.status).not_in(FINAL))).one()
            if active >= settings.batch_active_per_tenant:
                raise GatewayError(429, f"The tenant {tenant!r} has {active} batches unfinished, its limit; create "
                                   "more once some finish or are cancelled.", "rate_limit_exceeded",
                                   code="batch_limit_exceeded")
            row = BatchRecord(id=f"batch_{uuid.uuid4().hex}", tenant=tenant, key_prefix=principal.key_prefix,
                              endpoint=body.endpoint, input_file_id=source.id, completion_window="24h",
                              status="in_progress", total=source.lines, labels=body.metadata, created_at=now,
                              in_progress_at=now, expires_at=now + timedelta(hours=24))
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
        query = select(BatchRecord).where(BatchRecord.tenant == principal.tenant.name)
        with Session(gateway.db) as session:
            if after is not None and (cursor := session.get(BatchRecord, after)) is not None:
                query = query.where(BatchRecord.created_at < cursor.created_at)
            return list(session.exec(query.order_by(col(BatchRecord.created_at).desc()).limit(limit + 1)))

    rows = await asyncio.to_thread(read)
    data = [batch_json(r) for r in rows[:limit]]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit}
