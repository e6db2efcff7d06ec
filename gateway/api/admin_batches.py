"""Batches and stored responses as their administrators see them: the operations behind the admin
API's `/admin/batches` and `/admin/responses` and the `servegate batches` and `servegate responses`
commands. Clients see only their own tenant's (`/v1/batches`, `/v1/responses`); here an operator
sees every tenant's, and a tenant's administrator its own tenant's, another's being not found.

A batch is shown as `/v1/batches` shows it (OpenAI's Batch object, times in Unix seconds) with
whose it is (`tenant`, `key_prefix`) and when it finished, and, to operators, the replica holding
its lease. A stored response is listed by its metadata, status and usage only, never its input or
output. Cancelling a batch and deleting a response are written to the audit log in the same
transaction."""

from __future__ import annotations

from typing import Any, Literal

from sqlmodel import Session, col, select

from gateway.api.batches import FINAL, batch_json, mark_cancelling
from gateway.tables import BatchRecord, StoredResponse, utcnow
from gateway.tenancy.tenants import NotFound, audit

BatchStatus = Literal["validating", "in_progress", "finalizing", "completed", "failed", "expired", "cancelling",
                      "cancelled"]
MAX_LISTED = 1000


def _unix(moment) -> int | None:
    return None if moment is None else int(moment.timestamp())


def batch_view(row: BatchRecord, operator: bool) -> dict[str, Any]:
    finished = next((getattr(row, f"{end}_at") for end in FINAL if row.status == end), None)
    view = {**batch_json(row), "tenant": row.tenant, "key_prefix": row.key_prefix, "finished_at": _unix(finished)}
    if operator:
        view |= {"runner": row.runner, "lease_until": _unix(row.lease_until)}
    return view


def list_batches(session: Session, tenant: str | None, status: str | None = None, limit: int = 100,
                 operator: bool = True) -> list[dict[str, Any]]:
    """Newest first; `tenant` None: every tenant's."""
    query = select(BatchRecord)
    if tenant is not None:
        query = query.where(BatchRecord.tenant == tenant)
    if status is not None:
        query = query.where(BatchRecord.status == status)
    rows = session.exec(query.order_by(col(BatchRecord.created_at).desc(), col(BatchRecord.id)).limit(limit))
    return [batch_view(row, operator) for row in rows]


def _batch(session: Session, batch_id: str, within: str | None) -> BatchRecord:
    """The batch, if it is `within`'s (None: any tenant's); another tenant's is not found."""
    row = session.get(BatchRecord, batch_id)
    if row is None or within is not None and row.tenant != within:
        raise NotFound(f"no batch with id {batch_id!r}")
    return row


def get_batch(session: Session, batch_id: str, within: str | None, operator: bool = True) -> dict[str, Any]:
    return batch_view(_batch(session, batch_id, within), operator)


def cancel_batch(session: Session, actor: str, batch_id: str, within: str | None,
                 operator: bool = True) -> dict[str, Any]:
    """As the client's cancel: the batch moves to `cancelling`, its runner takes no more lines and it
    ends `cancelled` with what was done; a finished or cancelling one refuses (InvalidRequest)."""
    before = _batch(session, batch_id, within).status
    row = mark_cancelling(session, batch_id)
    audit(session, actor, "batch.cancel", batch_id, {"tenant": row.tenant, "status": before},
          {"tenant": row.tenant, "status": row.status})
    session.commit()
    session.refresh(row)
    return batch_view(row, operator)


def response_view(row: StoredResponse) -> dict[str, Any]:
    """What a listing shows of a stored response: never its input or output."""
    return {"id": row.id, "object": "response", "tenant": row.tenant, "key_prefix": row.key_prefix,
            "model": row.model, "created_at": _unix(row.created_at), "expires_at": _unix(row.expires_at),
            "status": row.body.get("status"), "usage": row.body.get("usage")}


def list_responses(session: Session, tenant: str | None, limit: int = 100) -> list[dict[str, Any]]:
    """The unexpired stored responses, newest first; `tenant` None: every tenant's."""
    query = select(StoredResponse).where(StoredResponse.expires_at > utcnow())
    if tenant is not None:
        query = query.where(StoredResponse.tenant == tenant)
    rows = session.exec(query.order_by(col(StoredResponse.created_at).desc(), col(StoredResponse.id)).limit(limit))
    return [response_view(row) for row in rows]


def delete_response(session: Session, actor: str, response_id: str, within: str | None) -> dict[str, Any]:
    """Delete a stored response: a request naming it as `previous_response_id` is refused from then
    on, as after the client's own delete. An expired one, or another tenant's, is not found."""
    row = session.get(StoredResponse, response_id)
    if row is None or row.expires_at <= utcnow() or within is not None and row.tenant != within:
        raise NotFound(f"no stored response with id {response_id!r}")
    view = response_view(row)
    audit(session, actor, "response.delete", response_id, {k: view[k] for k in ("tenant", "key_prefix", "model")},
          None)
    session.delete(row)
    session.commit()
    return {"id": response_id, "object": "response", "deleted": True, "tenant": view["tenant"]}
