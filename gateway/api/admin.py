"""Admin API (`/admin/...`): tenants, keys, adapters, usage, batches, stored responses, audit log, routes.
An operator administers everything; a tenant's administrator (`admin` scope) sees and manages its own
tenant's keys, LoRA adapters, usage, batches and stored responses, within the limits the operator set,
and nothing else: another tenant's names and ids answer 404, as if they did not exist. Changes take
effect in this process at once and on other replicas within the refresh interval."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from fastapi.responses import Response
from pydantic import AfterValidator
from sqlmodel import Session, col, select

from gateway.api import admin_batches
from gateway.api.deps import AdminPrincipal, GatewayDep, OperatorPrincipal
from gateway.errors import GatewayError
from gateway.rollout import route_versions, shadow
from gateway.rollout.canary import verdict
from gateway.service import Gateway
from gateway.tables import AuditLog, in_utc, utcnow
from gateway.tenancy import adapters, tenants
from gateway.tenancy.adapters import AdapterIn, AdapterOut, AdapterPatch, AdapterStore
from gateway.tenancy.auth import Principal
from gateway.tenancy.tenants import KeyCreated, KeyIn, KeyOut, TenantIn, TenantOut, TenantPatch, UsageReport


def _no_store(response: Response) -> None:
    """Keys, usage and audit entries are nobody's to cache: not a proxy's, not a browser's."""
    response.headers["Cache-Control"] = "no-store"


router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(_no_store)])


def get_session(gateway: GatewayDep) -> Iterator[Session]:
    with Session(gateway.db) as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]
Moment = Annotated[datetime, AfterValidator(in_utc)]  # a query's time, in UTC


def _changed(gateway: Gateway) -> None:
    gateway.directory.load()  # this replica sees the change now, the others at their next refresh


def _reach(admin: Principal) -> str | None:
    """The one tenant a tenant's administrator reaches; None: an operator reaches them all."""
    return None if admin.operator else admin.tenant.name


def _own(admin: Principal, tenant: str | None) -> str | None:
    """The tenant a request may look at (None: all); another's name is not found."""
    mine = _reach(admin)
    if mine is not None and tenant not in (None, mine):
        raise tenants.NotFound(f"no tenant named {tenant!r}")
    return tenant if mine is None else mine


@router.get("/me")
def me(admin: AdminPrincipal) -> dict[str, Any]:
    """Who the key acts as: what the console shows and hides."""
    return {"subject": admin.subject, "tenant": admin.tenant.name, "scopes": sorted(admin.scopes),
            "operator": admin.operator}


@router.get("/tenants", response_model=list[TenantOut])
def list_tenants(admin: AdminPrincipal, session: SessionDep):
    mine = _reach(admin)
    return [t for t in tenants.list_tenants(session) if mine is None or t.name == mine]


@router.post("/tenants", response_model=TenantOut, status_code=201)
def create_tenant(body: TenantIn, admin: OperatorPrincipal, session: SessionDep, gateway: GatewayDep):
    tenant = tenants.create_tenant(session, admin.subject, body)
    _changed(gateway)
    return tenant


@router.get("/tenants/{name}", response_model=TenantOut)
def get_tenant(name: str, admin: AdminPrincipal, session: SessionDep):
    _own(admin, name)
    return TenantOut.model_validate(tenants.get_tenant(session, name), from_attributes=True)


@router.patch("/tenants/{name}", response_model=TenantOut)
def update_tenant(name: str, body: TenantPatch, admin: OperatorPrincipal, session: SessionDep, gateway: GatewayDep):
    tenant = tenants.update_tenant(session, admin.subject, name, body)
    _changed(gateway)
    return tenant


@router.get("/keys", response_model=list[KeyOut])
def list_keys(admin: AdminPrincipal, session: SessionDep, tenant: str | None = None):
    return tenants.list_keys(session, _own(admin, tenant))


@router.post("/keys", response_model=KeyCreated, status_code=201)
def create_key(body: KeyIn, admin: AdminPrincipal, session: SessionDep, gateway: GatewayDep):
    _own(admin, body.tenant)
    key = tenants.create_key(session, admin.subject, body, operator=admin.operator)
    _changed(gateway)
    return key


@router.post("/keys/{prefix}/revoke", response_model=KeyOut)
def revoke_key(prefix: str, admin: AdminPrincipal, session: SessionDep, gateway: GatewayDep):
    key = tenants.revoke_key(session, admin.subject, prefix, _reach(admin))
    _changed(gateway)
    return key


@router.post("/keys/{prefix}/rotate", response_model=KeyCreated)
def rotate_key(prefix: str, admin: AdminPrincipal, session: SessionDep, gateway: GatewayDep):
    key = tenants.rotate_key(session, admin.subject, prefix, _reach(admin))
    _changed(gateway)
    return key


@router.get("/adapters", response_model=list[AdapterOut])
def list_adapters(admin: AdminPrincipal, session: SessionDep):
    return adapters.list_adapters(session, _reach(admin))


@router.post("/adapters", response_model=AdapterOut, status_code=201)
def create_adapter(body: AdapterIn, admin: AdminPrincipal, session: SessionDep, gateway: GatewayDep):
    """A tenant administrator's adapter is its tenant's; an operator's is whose `owner` says."""
    body = body.model_copy(update={"owner": _own(admin, body.owner)})
    adapter = adapters.create_adapter(session, admin.subject, body, AdapterStore.of(gateway.settings), _reach(admin),
                                      set(gateway.router.models()))
    _changed(gateway)
    return adapter


@router.patch("/adapters/{name:path}", response_model=AdapterOut)
def update_adapter(name: str, body: AdapterPatch, admin: AdminPrincipal, session: SessionDep, gateway: GatewayDep):
    adapter = adapters.update_adapter(session, admin.subject, name, body, AdapterStore.of(gateway.settings),
                                      _reach(admin))
    _changed(gateway)
    return adapter


@router.delete("/adapters/{name:path}", response_model=AdapterOut)
def delete_adapter(name: str, admin: AdminPrincipal, session: SessionDep, gateway: GatewayDep):
    adapter = adapters.delete_adapter(session, admin.subject, name, _reach(admin))
    _changed(gateway)
    return adapter


@router.get("/batches")
def list_batches(admin: AdminPrincipal, session: SessionDep, tenant: str | None = None,
                 status: admin_batches.BatchStatus | None = None,
                 limit: Annotated[int, Query(ge=1, le=admin_batches.MAX_LISTED)] = 100) -> list[dict[str, Any]]:
    """Batches, newest first, as `/v1/batches` shows them with their tenant and key; to operators,
    also the replica holding each one's lease (`runner`, `lease_until`)."""
    return admin_batches.list_batches(session, _own(admin, tenant), status, limit, admin.operator)


@router.get("/batches/{batch_id}")
def get_batch(batch_id: str, admin: AdminPrincipal, session: SessionDep) -> dict[str, Any]:
    return admin_batches.get_batch(session, batch_id, _reach(admin), admin.operator)


@router.post("/batches/{batch_id}/cancel")
def cancel_batch(batch_id: str, admin: AdminPrincipal, session: SessionDep) -> dict[str, Any]:
    """As the client's cancel: the batch moves to `cancelling` and its runner ends it `cancelled`
    once the lines under way finish; audited."""
    return admin_batches.cancel_batch(session, admin.subject, batch_id, _reach(admin), admin.operator)


@router.get("/responses")
def list_responses(admin: AdminPrincipal, session: SessionDep, tenant: str | None = None,
                   limit: Annotated[int, Query(ge=1, le=admin_batches.MAX_LISTED)] = 100) -> list[dict[str, Any]]:
    """Stored responses, newest first: their tenant, key, model, times, status and usage, never their text."""
    return admin_batches.list_responses(session, _own(admin, tenant), limit)


@router.delete("/responses/{response_id}")
def delete_response(response_id: str, admin: AdminPrincipal, session: SessionDep) -> dict[str, Any]:
    return admin_batches.delete_response(session, admin.subject, response_id, _reach(admin))


@router.get("/usage", response_model=UsageReport)
def usage(admin: AdminPrincipal, session: SessionDep, tenant: str | None = None, since: Moment | None = None,
          until: Moment | None = None, limit: Annotated[int, Query(ge=1, le=10_000)] = 100):
    return tenants.usage_report(session, _own(admin, tenant), since, until, limit)


@router.get("/usage/series", response_model=tenants.UsageSeries)
def usage_series(admin: AdminPrincipal, session: SessionDep, tenant: str | None = None,
                 since: Moment | None = None, until: Moment | None = None,
                 bucket: tenants.Bucket = "hour", by: tenants.GroupBy = "model"):
    """Usage over time (default: the last 24 hours), per bucket and per model, key or tenant."""
    until = until or utcnow()
    if since is None:
        if until.year < 2:
            raise GatewayError(400, "until is before the first day there can be usage for", "invalid_request_error",
                               param="until")
        since = until - timedelta(days=1)
    return tenants.usage_series(session, _own(admin, tenant), since, until, bucket, by)


@router.get("/usage/series.csv", response_class=Response, responses={
    200: {"description": "One row per bucket and group.", "content": {"text/csv": {"schema": {"type": "string"}}}}})
def usage_series_csv(admin: AdminPrincipal, session: SessionDep, tenant: str | None = None,
                     since: Moment | None = None, until: Moment | None = None,
                     bucket: tenants.Bucket = "hour", by: tenants.GroupBy = "model"):
    series = usage_series(admin, session, tenant, since, until, bucket, by)
    return Response(tenants.series_csv(series), media_type="text/csv",
                    headers={"Content-Disposition": 'attachment; filename="usage.csv"', "Cache-Control": "no-store"})


@router.get("/backends")
async def backends(_: OperatorPrincipal, gateway: GatewayDep) -> list[dict[str, Any]]:
    """Each backend as this replica sees it: health, live load, its admission queue and breaker."""
    fleet, now = gateway.fleet, time.monotonic()
    out = []
    for model, backend in fleet.served.items():
        capabilities, load = await backend.capabilities(), await backend.load()
        member = fleet[backend.name]
        admission, breaker = member.admission, member.breaker
        out.append({"name": backend.name, "model": model, "runtime": capabilities.runtime, "dtype": capabilities.dtype,
                    "health": (await backend.health()).value, "running": load.running, "waiting": load.waiting,
                    "kv_usage": load.kv_usage, "prefix_hit_rate": load.prefix_hit_rate,
                    "in_flight": admission.in_flight, "queued": admission.queued,
                    "saturation": admission.saturation, "breaker_open": not breaker.allows(now)})
    return out


@router.get("/audit")
def audit(_: OperatorPrincipal, session: SessionDep,
          limit: Annotated[int, Query(ge=1, le=10_000)] = 100) -> list[dict[str, Any]]:
    rows = session.exec(select(AuditLog).order_by(col(AuditLog.id).desc()).limit(limit))
    return [row.model_dump(mode="json") for row in rows]


# -- routes: versioned, audited; this replica serves a change at once, the others within the refresh
@router.get("/routes", response_model=list[route_versions.RouteState])
def list_routes(_: OperatorPrincipal, session: SessionDep):
    return list(route_versions.table(session).values())


@router.get("/routes/{alias}")
def route_history(alias: str, _: OperatorPrincipal, session: SessionDep) -> dict[str, Any]:
    return route_versions.history(session, alias)


@router.post("/routes/{alias}/deploy", response_model=route_versions.RouteOut, status_code=201)
def deploy_route(alias: str, body: route_versions.DeployIn, admin: OperatorPrincipal, session: SessionDep,
                 gateway: GatewayDep):
    out = route_versions.deploy(session, admin.subject, alias, body.spec, body.canary_share,
                                set(gateway.fleet.members))
    gateway.load_routes()
    return out


@router.post("/routes/{alias}/promote", response_model=route_versions.RouteOut)
def promote_route(alias: str, admin: OperatorPrincipal, session: SessionDep, gateway: GatewayDep):
    out = route_versions.promote(session, admin.subject, alias)
    gateway.load_routes()
    return out


@router.post("/routes/{alias}/rollback", response_model=route_versions.RouteOut)
def rollback_route(alias: str, admin: OperatorPrincipal, session: SessionDep, gateway: GatewayDep,
                   to: int | None = None, reason: str = ""):
    out = route_versions.rollback(session, admin.subject, alias, to, reason)
    gateway.load_routes()
    return out


@router.get("/routes/{alias}/canary")
def canary_comparison(alias: str, _: OperatorPrincipal, gateway: GatewayDep) -> dict[str, Any]:
    """The running canary against the active version, on the traffic this replica served in the
    guard's window, and what the guard would decide now."""
    state = gateway.router.routes.get(alias)
    if state is None or state.canary is None or state.active is None:
        raise tenants.NotFound(f"route {alias!r} runs no canary")
    guard = gateway.canary
    active, canary = guard.stats(alias, state.active.version), guard.stats(alias, state.canary.version)
    return {"alias": alias, "active": {"version": state.active.version, **dataclasses.asdict(active)},
            "canary": {"version": state.canary.version, "share": state.canary.share, **dataclasses.asdict(canary)},
            "verdict": verdict(guard.policy, active, canary), "policy": guard.policy.model_dump()}


@router.get("/routes/{alias}/shadow")
def shadow_report(alias: str, _: OperatorPrincipal, session: SessionDep) -> list[dict[str, Any]]:
    """Mirrored requests of this alias: each candidate against the primary answers."""
    return shadow.report(session, alias)
