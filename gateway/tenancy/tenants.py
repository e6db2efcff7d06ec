"""Tenants, keys and usage: the operations behind both the admin API and the CLI. Every change
is written to the audit log (who, what, before, after) in the same transaction."""

from __future__ import annotations

import csv
import dataclasses
import getpass
import io
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from pydantic import BaseModel, Field
from sqlalchemy import func
from sqlmodel import Session, col, select

from gateway.errors import GatewayError
from gateway.operations.telemetry import percentile
from gateway.tables import ApiKey, AuditLog, Dollars, Limits, Tenant, UsageRecord, as_utc, usd, utcnow
from gateway.tenancy.keys import chosen_key_prefix, hash_key, key_prefix, new_key

Scope = Literal["inference", "admin", "operator"]  # admin: its own tenant; operator: every tenant
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


class NotFound(GatewayError):
    def __init__(self, message: str) -> None:
        super().__init__(404, message, "invalid_request_error", code="not_found")


class Conflict(GatewayError):
    def __init__(self, message: str) -> None:
        super().__init__(409, message, "invalid_request_error", code="conflict")


# -- API shapes -----------------------------------------------------------------------------
class TenantIn(Limits):
    name: str = Field(pattern=NAME_PATTERN)
    tier: str = Field(default="standard", max_length=32)
    models: list[str] = []
    disabled: bool = False


class TenantPatch(Limits):
    """Fields to change; limits set to null are lifted, fields left out are kept."""

    tier: str | None = Field(default=None, max_length=32)
    models: list[str] | None = None
    disabled: bool | None = None


class TenantOut(Limits):
    name: str
    tier: str
    models: list[str]
    disabled: bool
    created_at: datetime


class KeyIn(Limits):
    tenant: str
    name: str = Field(default="", max_length=128)
    scopes: list[Scope] = Field(default=["inference"], min_length=1)
    expires_in_days: float | None = Field(default=None, gt=0, le=36500)


class KeyOut(Limits):
    prefix: str
    tenant: str
    name: str
    scopes: list[str]
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None


class KeyCreated(KeyOut):
    key: str = Field(description="The key itself: shown once, never stored.")


class UsageTotals(BaseModel):
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cost_usd: Dollars = Field(description="At the models' prices when the requests ran.")


class UsageReport(BaseModel):
    totals: UsageTotals
    records: list[dict[str, Any]]


def cli_actor() -> str:
    return f"cli:{getpass.getuser()}"


def _limits(obj: Limits) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in Limits.model_fields}


def audit(session: Session, actor: str, action: str, target: str, before: dict | None, after: dict | None) -> None:
    """One change, in the caller's transaction: who, what, before, after."""
    session.add(AuditLog(actor=actor, action=action, target=target, before=before, after=after))


def _tenant_json(t: Tenant) -> dict[str, Any]:
    return TenantOut.model_validate(t, from_attributes=True).model_dump(mode="json")


def _key_out(k: ApiKey, tenant: str) -> KeyOut:
    return KeyOut(prefix=k.prefix, tenant=tenant, name=k.name, scopes=k.scopes.split(","), created_at=k.created_at,
                  expires_at=k.expires_at, revoked_at=k.revoked_at, **_limits(k))


# -- tenants --------------------------------------------------------------------------------
def get_tenant(session: Session, name: str) -> Tenant:
    tenant = session.exec(select(Tenant).where(Tenant.name == name)).first()
    if tenant is None:
        raise NotFound(f"no tenant named {name!r}")
    return tenant


def list_tenants(session: Session) -> list[TenantOut]:
    tenants = session.exec(select(Tenant).order_by(Tenant.name))
    return [TenantOut.model_validate(t, from_attributes=True) for t in tenants]


def create_tenant(session: Session, actor: str, data: TenantIn) -> TenantOut:
    if session.exec(select(Tenant).where(Tenant.name == data.name)).first() is not None:
        raise Conflict(f"a tenant named {data.name!r} exists")
    tenant = Tenant(**data.model_dump())
    session.add(tenant)
    session.flush()
    audit(session, actor, "tenant.create", data.name, None, _tenant_json(tenant))
    session.commit()
    return TenantOut.model_validate(tenant, from_attributes=True)


def update_tenant(session: Session, actor: str, name: str, patch: TenantPatch) -> TenantOut:
    tenant = get_tenant(session, name)
    before = _tenant_json(tenant)
    for field, value in patch.model_dump(exclude_unset=True).items():
        if value is None and field not in Limits.model_fields:
            continue
        setattr(tenant, field, value)
    session.add(tenant)
    session.flush()
    audit(session, actor, "tenant.update", name, before, _tenant_json(tenant))
    session.commit()
    return TenantOut.model_validate(tenant, from_attributes=True)


# -- keys -----------------------------------------------------------------------------------
def _add_key(session: Session, tenant: Tenant, name: str, scopes: list[str], expires_at: datetime | None,
             limits: dict[str, Any], key: str | None = None) -> tuple[ApiKey, str]:
    if key is None:
        key, prefix = new_key()
    else:
        prefix = key_prefix(key) or chosen_key_prefix()
    row = ApiKey(prefix=prefix, key_hash=hash_key(key), tenant_id=tenant.id, name=name, scopes=",".join(scopes),
                 expires_at=expires_at, **limits)
    session.add(row)
    session.flush()
    return row, key


def create_key(session: Session, actor: str, data: KeyIn, operator: bool = True) -> KeyCreated:
    """`operator` False: a tenant administrator's key, which may not grant `operator` nor set a
    limit above the tenant's own."""
    tenant = get_tenant(session, data.tenant)
    if not operator:
        if "operator" in data.scopes:
            raise GatewayError(403, "Only an operator may grant the `operator` scope.", "permission_error",
                               code="insufficient_scope")
        for name, value in _limits(data).items():
            cap = getattr(tenant, name)
            if cap is not None and value is not None and value > cap:
                raise GatewayError(400, f"{name} {value} exceeds the tenant's limit of {cap}",
                                   "invalid_request_error", param=name)
    expires = utcnow() + timedelta(days=data.expires_in_days) if data.expires_in_days else None
    row, key = _add_key(session, tenant, data.name, sorted(set(data.scopes)), expires, _limits(data))
    out = _key_out(row, tenant.name)
    audit(session, actor, "key.create", row.prefix, None, out.model_dump(mode="json"))
    session.commit()
    return KeyCreated(key=key, **out.model_dump())


def _live_key(session: Session, prefix: str, within: str | None) -> tuple[ApiKey, Tenant]:
    """The key, if it is live and (`within` given) that tenant's and no operator's."""
    row = session.exec(select(ApiKey).where(ApiKey.prefix == prefix)).first()
    tenant = session.get(Tenant, row.tenant_id) if row is not None else None
    if row is None or within is not None and (tenant.name != within or "operator" in row.scopes.split(",")):
        raise NotFound(f"no key with prefix {prefix!r}")
    if row.revoked_at is not None:
        raise Conflict(f"the key {prefix} is already revoked")
    return row, tenant


def revoke_key(session: Session, actor: str, prefix: str, within: str | None = None) -> KeyOut:
    row, tenant = _live_key(session, prefix, within)
    before = _key_out(row, tenant.name).model_dump(mode="json")
    row.revoked_at = utcnow()
    session.add(row)
    out = _key_out(row, tenant.name)
    audit(session, actor, "key.revoke", prefix, before, out.model_dump(mode="json"))
    session.commit()
    return out


def rotate_key(session: Session, actor: str, prefix: str, within: str | None = None) -> KeyCreated:
    """A new key with the old one's tenant, scopes, expiry and limits; the old one is revoked.
    `within`: only a key of that tenant (a tenant administrator's reach)."""
    old, tenant = _live_key(session, prefix, within)
    before = _key_out(old, tenant.name).model_dump(mode="json")
    old.revoked_at = utcnow()
    session.add(old)
    row, key = _add_key(session, tenant, old.name, old.scopes.split(","), old.expires_at, _limits(old))
    out = _key_out(row, tenant.name)
    audit(session, actor, "key.rotate", prefix, before, out.model_dump(mode="json"))
    session.commit()
    return KeyCreated(key=key, **out.model_dump())


def list_keys(session: Session, tenant: str | None = None) -> list[KeyOut]:
    query = select(ApiKey, Tenant).join(Tenant).order_by(ApiKey.created_at)
    if tenant is not None:
        query = query.where(Tenant.name == tenant)
    return [_key_out(k, t.name) for k, t in session.exec(query)]


# -- usage ----------------------------------------------------------------------------------
def usage_report(session: Session, tenant: str | None = None, since: datetime | None = None,
                 until: datetime | None = None, limit: int = 100) -> UsageReport:
    since, until = as_utc(since), as_utc(until)
    conditions = []
    if tenant is not None:
        conditions.append(UsageRecord.tenant == tenant)
    if since is not None:
        conditions.append(UsageRecord.started_at >= since)
    if until is not None:
        conditions.append(UsageRecord.started_at < until)
    sums = [func.coalesce(func.sum(c), 0) for c in
            (UsageRecord.prompt_tokens, UsageRecord.completion_tokens, UsageRecord.cached_tokens,
             UsageRecord.cost_nano_usd)]
    totals = session.exec(select(func.count(), *sums).where(*conditions)).one()
    rows = session.exec(select(UsageRecord).where(*conditions)
                        .order_by(col(UsageRecord.started_at).desc()).limit(limit)).all()
    return UsageReport(totals=UsageTotals(requests=totals[0], prompt_tokens=totals[1], completion_tokens=totals[2],
                                          cached_tokens=totals[3], cost_usd=usd(totals[4])),
                       records=[r.model_dump(mode="json") for r in rows])


Bucket = Literal["minute", "hour", "day"]
GroupBy = Literal["model", "key", "tenant", "adapter"]
BUCKETS = {"minute": 60, "hour": 3600, "day": 86_400}
SERIES_GROUPS = {"model": UsageRecord.model, "key": UsageRecord.key_prefix, "tenant": UsageRecord.tenant,
                 "adapter": UsageRecord.adapter}  # the base model's requests: the group ""
SERIES_MAX_ROWS = 200_000  # records read per series request (about a day at 2 requests/s)


class SeriesPoint(BaseModel):
    at: datetime  # the bucket's start
    requests: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    cost_usd: Dollars
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None


class Series(BaseModel):
    group: str  # the model, key prefix, tenant or adapter
    points: list[SeriesPoint]


class UsageSeries(BaseModel):
    bucket: Bucket
    by: GroupBy
    since: datetime
    until: datetime
    series: list[Series]
    truncated: bool = Field(description="More records than one request reads: narrow the range.")


@dataclasses.dataclass
class _Cell:
    """One bucket of one group, summed as the records are read."""

    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_nano_usd: int = 0
    ttfts: list[float] = dataclasses.field(default_factory=list)


def usage_series(session: Session, tenant: str | None, since: datetime, until: datetime,
                 bucket: Bucket, by: GroupBy) -> UsageSeries:
    """Usage over time, per bucket and group: requests, errors, tokens, cost, TTFT p50 and p95."""
    since, until = as_utc(since), as_utc(until)
    group = SERIES_GROUPS[by]
    conditions = [UsageRecord.started_at >= since, UsageRecord.started_at < until]
    if tenant is not None:
        conditions.append(UsageRecord.tenant == tenant)
    rows = session.exec(select(group, UsageRecord.started_at, UsageRecord.status, UsageRecord.prompt_tokens,
                               UsageRecord.completion_tokens, UsageRecord.cost_nano_usd, UsageRecord.ttft_ms)
                        .where(*conditions).order_by(col(UsageRecord.started_at)).limit(SERIES_MAX_ROWS + 1)).all()
    width = BUCKETS[bucket]
    cells: dict[tuple[str, int], _Cell] = {}
    for name, started, status, prompt, completion, cost, ttft in rows[:SERIES_MAX_ROWS]:
        start = int(as_utc(started).timestamp()) // width * width
        cell = cells.setdefault((name or "", start), _Cell())
        cell.requests += 1
        cell.errors += status == "error"
        cell.prompt_tokens += prompt
        cell.completion_tokens += completion
        cell.cost_nano_usd += cost
        if ttft is not None:
            cell.ttfts.append(ttft)
    series: dict[str, list[SeriesPoint]] = {}
    for (name, start), cell in sorted(cells.items(), key=lambda item: item[0]):
        series.setdefault(name, []).append(SeriesPoint(
            at=datetime.fromtimestamp(start, UTC), requests=cell.requests, errors=cell.errors,
            prompt_tokens=cell.prompt_tokens, completion_tokens=cell.completion_tokens,
            cost_usd=usd(cell.cost_nano_usd), ttft_p50_ms=percentile(cell.ttfts, 50),
            ttft_p95_ms=percentile(cell.ttfts, 95)))
    return UsageSeries(bucket=bucket, by=by, since=since, until=until,
                       series=[Series(group=name, points=points) for name, points in series.items()],
                       truncated=len(rows) > SERIES_MAX_ROWS)


def series_csv(series: UsageSeries) -> str:
    """One row per bucket and group, for a spreadsheet."""
    out = io.StringIO()
    writer = csv.writer(out)
    fields = list(SeriesPoint.model_fields)
    writer.writerow([series.by, *fields])
    for line in series.series:
        for point in line.points:
            writer.writerow([line.group, *point.model_dump(mode="json").values()])
    return out.getvalue()


# -- first start ----------------------------------------------------------------------------
def bootstrap(session: Session, admin_key: str | None) -> str | None:
    """On a database without any key: a `default` tenant and one admin key (`admin_key` if
    given). Returns the new key, or None when keys exist already."""
    if session.exec(select(ApiKey.id).limit(1)).first() is not None:
        return None
    tenant = session.exec(select(Tenant).where(Tenant.name == "default")).first()
    if tenant is None:
        tenant = Tenant(name="default")
        session.add(tenant)
        session.flush()
    row, key = _add_key(session, tenant, "bootstrap admin", ["inference", "operator"], None, {}, key=admin_key)
    audit(session, "bootstrap", "key.create", row.prefix, None, _key_out(row, tenant.name).model_dump(mode="json"))
    session.commit()
    return key
