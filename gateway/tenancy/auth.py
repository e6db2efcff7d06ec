"""Who is calling: API keys and JWTs checked against an in-memory directory.

The directory (tenants, keys and the LoRA adapters tenants may call) is re-read from the database
every `refresh_s` in the background; the request path only reads memory. If the database is down
the last good copy keeps serving, so a database outage is not an auth outage. A key made since the last refresh
(`servegate keys create`, another replica's admin API) works at its first request: a well-formed
key missing from memory is looked up in the database, one lookup at a time, and a prefix found
missing is not asked again for a refresh interval, so garbage keys cannot hammer the database.
A revoked or expired key stops working within one refresh interval (expiry at once: it is
checked on every request). Work that outlives a request, a batch's lines, reads its key and tenant
from the database each time instead (`read_key_principal`, `read_tenant`), checked alike, so a
change reaches its next line.

Scopes: `inference` calls models; `admin` administers its own tenant (its keys, adapters, usage);
`operator` administers everything (tenants, their limits, routes, the audit log).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime

import jwt
from sqlalchemy import Engine
from sqlmodel import Session, select

from backends.base import Adapter
from gateway.errors import GatewayError
from gateway.settings import Settings
from gateway.tables import AdapterRecord, ApiKey, Tenant, UsageLimits, nano_usd
from gateway.tenancy.keys import hash_key, is_servegate_key, key_prefix, verify
from gateway.tenancy.quotas import QuotaLimits, Scope

log = logging.getLogger("servegate.auth")
JWKS_TTL_S = 300.0  # identity providers rotate keys with overlap; five minutes is their usual cache
MISSING_PREFIXES = 10_000  # the negative cache's bound: beyond it, it starts over
TOKEN_SCOPES = frozenset({"inference", "admin"})  # what a token's scope claim may grant by name


@dataclass(frozen=True)
class TenantView:
    name: str
    tier: str
    models: frozenset[str]  # empty: every model
    disabled: bool
    limits: QuotaLimits
    max_tokens_per_request: int | None


@dataclass(frozen=True)
class KeyView:
    prefix: str
    key_hash: str
    tenant: str
    scopes: frozenset[str]
    expires_at: datetime | None
    limits: QuotaLimits
    max_tokens_per_request: int | None


@dataclass(frozen=True)
class AdapterView:
    adapter: Adapter  # its name (the model clients ask for) and path, as its backends load it
    base: str  # the served model or route alias it applies to
    owner: str | None  # a tenant; None: the operator's
    tenants: frozenset[str]  # who may use it besides its owner
    limits: QuotaLimits  # on every use of it, whoever calls
    everyone: bool = False  # served by its backend from launch: any tenant that may use the base may use it

    @property
    def name(self) -> str:
        return self.adapter.name

    def allows(self, tenant: str) -> bool:
        return self.everyone or tenant == self.owner or tenant in self.tenants


@dataclass(frozen=True)
class Principal:
    tenant: TenantView
    subject: str  # the key prefix, or the JWT's subject
    scopes: frozenset[str]
    key: KeyView | None = None

    @property
    def key_prefix(self) -> str | None:
        return self.key.prefix if self.key else None

    @property
    def operator(self) -> bool:
        return "operator" in self.scopes

    def may_use(self, model: str) -> bool:
        return not self.tenant.models or model in self.tenant.models

    def quota_scopes(self, adapter: AdapterView | None = None) -> tuple[Scope, ...]:
        """The tenant's scope, the key's where it has limits, and the adapter's where the request
        applies one that has limits."""
        scopes = [Scope(f"tenant:{self.tenant.name}", self.tenant.limits)]
        if self.key is not None and self.key.limits != QuotaLimits():
            scopes.append(Scope(f"key:{self.key.prefix}", self.key.limits))
        if adapter is not None and adapter.limits != QuotaLimits():
            scopes.append(Scope(f"adapter:{adapter.name}", adapter.limits))
        return tuple(scopes)

    @property
    def max_tokens_per_request(self) -> int | None:
        caps = [c for c in (self.tenant.max_tokens_per_request,
                            self.key.max_tokens_per_request if self.key else None) if c is not None]
        return min(caps) if caps else None


def _limits(row: UsageLimits) -> QuotaLimits:
    """A row's limits; an adapter's carry no daily tokens or concurrency."""
    return QuotaLimits(rpm=row.rpm, tpm=row.tpm, tokens_per_day=getattr(row, "tokens_per_day", None),
                       max_concurrency=getattr(row, "max_concurrency", None),
                       daily_budget=nano_usd(row.daily_budget_usd), monthly_budget=nano_usd(row.monthly_budget_usd))


def _tenant_view(t: Tenant) -> TenantView:
    return TenantView(t.name, t.tier, frozenset(t.models), t.disabled, _limits(t), t.max_tokens_per_request)


def _key_view(k: ApiKey, tenant: Tenant) -> KeyView:
    return KeyView(k.prefix, k.key_hash, tenant.name, frozenset(k.scopes.split(",")), k.expires_at, _limits(k),
                   k.max_tokens_per_request)


def _adapter_view(a: AdapterRecord) -> AdapterView:
    return AdapterView(Adapter(a.name, a.stored_path or a.path, a.digest), a.base, a.owner, frozenset(a.tenants),
                       _limits(a))


def unauthorized(message: str) -> GatewayError:
    return GatewayError(401, message, "invalid_request_error", code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"})


def acting_tenant(name: str, tenant: TenantView | None) -> TenantView:
    """The tenant a caller acts for, refused where it is gone or disabled."""
    if tenant is None:
        raise unauthorized(f"Unknown tenant {name!r}.")
    if tenant.disabled:
        raise GatewayError(403, f"The tenant {name!r} is disabled.", "permission_error", code="tenant_disabled")
    return tenant


def key_principal(key: KeyView, tenant: TenantView | None) -> Principal:
    """Who a key acts as, refused once it has expired or where its tenant is gone or disabled."""
    if key.expires_at is not None and key.expires_at <= datetime.now(UTC):
        raise unauthorized(f"The API key {key.prefix} has expired.")
    return Principal(acting_tenant(key.tenant, tenant), key.prefix, key.scopes, key)


def require(principal: Principal, *scopes: str) -> Principal:
    """The principal, where it holds one of `scopes`."""
    if not principal.scopes & set(scopes):
        raise GatewayError(403, f"This key lacks the `{scopes[0]}` scope.", "permission_error",
                           code="insufficient_scope")
    return principal


def _read_key(engine: Engine, prefix: str) -> tuple[ApiKey, Tenant] | None:
    """A key's row, revoked or not, with its tenant's (one indexed read; blocking)."""
    with Session(engine) as session:
        return session.exec(select(ApiKey, Tenant).join(Tenant).where(ApiKey.prefix == prefix)).first()


def read_key_principal(engine: Engine, prefix: str) -> Principal:
    """Who the key `prefix` acts as now, by the database rather than a directory's copy (which may be
    a refresh interval old): for work that outlives a request, a batch's lines. Blocking; refused as
    `Directory.authenticate` refuses, and a revoked key by name."""
    found = _read_key(engine, prefix)
    if found is None:
        raise unauthorized(f"Unknown API key {prefix}.")
    key, tenant = found
    if key.revoked_at is not None:
        raise unauthorized(f"The API key {prefix} was revoked.")
    return key_principal(_key_view(key, tenant), _tenant_view(tenant))


def read_tenant(engine: Engine, name: str) -> TenantView:
    """The tenant `name` as the database holds it now, refused where it is gone or disabled (blocking)."""
    with Session(engine) as session:
        row = session.exec(select(Tenant).where(Tenant.name == name)).first()
    return acting_tenant(name, None if row is None else _tenant_view(row))


class Directory:
    """Tenants, keys and LoRA adapters, in memory."""

    def __init__(self, engine: Engine, settings: Settings) -> None:
        self.engine, self.settings = engine, settings
        self.tenants: dict[str, TenantView] = {}
        self.keys: dict[str, KeyView] = {}
        self.chosen: dict[str, KeyView] = {}
        self.adapters: dict[str, AdapterView] = {}  # by name
        self.loaded_at: datetime | None = None
        self._missing: dict[str, float] = {}  # key prefixes the database did not have, until when
        self._lookup = asyncio.Lock()
        # JWKS signing keys by key id, fetched with the directory (never on the request path).
        self._jwks = jwt.PyJWKClient(settings.jwt_jwks_url, cache_jwk_set=False) if settings.jwt_jwks_url else None
        self.signing_keys: dict[str, object] = {}
        self._jwks_fetched = 0.0

    # -- refresh ------------------------------------------------------------------------
    def load(self) -> None:
        """Read every tenant, live key and adapter (blocking: call it off the event loop)."""
        with Session(self.engine) as session:
            tenants = session.exec(select(Tenant)).all()
            keys = session.exec(select(ApiKey).where(ApiKey.revoked_at.is_(None))).all()
            adapters = session.exec(select(AdapterRecord)).all()
        by_id = {t.id: t for t in tenants}
        self.tenants = {t.name: _tenant_view(t) for t in tenants}
        self.keys = {k.prefix: _key_view(k, by_id[k.tenant_id]) for k in keys if k.tenant_id in by_id}
        self.chosen = {view.key_hash: view for view in self.keys.values()}  # keys an operator chose, by hash
        self.adapters = {a.name: _adapter_view(a) for a in adapters}
        self.loaded_at = datetime.now(UTC)
        self._missing.clear()
        if self._jwks is not None and time.monotonic() - self._jwks_fetched > JWKS_TTL_S:
            try:
                self.signing_keys = {k.key_id: k.key for k in self._jwks.get_signing_keys()}
                self._jwks_fetched = time.monotonic()
            except jwt.PyJWKClientError as exc:  # keep the keys we have; try again next refresh
                log.warning("JWKS fetch from %s failed: %s", self.settings.jwt_jwks_url, exc)

    async def refresh(self) -> None:
        try:
            await asyncio.to_thread(self.load)
        except Exception as exc:  # keep serving the last good copy
            log.warning("directory refresh failed, serving the copy from %s: %s", self.loaded_at, exc)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.refresh_s)
            await self.refresh()

    async def _look_up(self, prefix: str) -> KeyView | None:
        """A key made since the last refresh, from the database (None if it has no such key)."""
        async with self._lookup:
            if prefix in self.keys or self._missing.get(prefix, 0.0) > time.monotonic():
                return self.keys.get(prefix)
            try:
                found = await asyncio.to_thread(_read_key, self.engine, prefix)
            except Exception as exc:  # the database is down: what memory holds is all there is
                log.warning("key lookup failed: %s", exc)
                return None
            if found is None or found[0].revoked_at is not None:
                if len(self._missing) >= MISSING_PREFIXES:
                    self._missing.clear()
                self._missing[prefix] = time.monotonic() + self.settings.refresh_s
                return None
            key, tenant = _key_view(*found), _tenant_view(found[1])
            self.tenants[tenant.name] = tenant
            self.keys[prefix] = key
            return key

    # -- authentication -----------------------------------------------------------------
    async def authenticate(self, credential: str | None) -> Principal:
        if not credential:
            raise unauthorized("Missing API key: send `Authorization: Bearer <key>`.")
        if self.settings.jwt_enabled and credential.count(".") == 2 and not credential.startswith("sg_"):
            return self._from_jwt(credential)
        prefix = key_prefix(credential)
        if prefix is None:  # not shaped like a key servegate makes: one an operator chose, known by its hash
            key = self.chosen.get(hash_key(credential))
        else:
            key = self.keys.get(prefix)
            if key is None and is_servegate_key(credential):
                key = await self._look_up(prefix)
        if key is None or not verify(credential, key.key_hash):
            raise unauthorized("Incorrect API key provided.")
        return key_principal(key, self.tenants.get(key.tenant))

    def _from_jwt(self, token: str) -> Principal:
        s = self.settings
        try:
            key = self._signing_key(token) if self._jwks else s.jwt_public_key
            claims = jwt.decode(token, key, algorithms=s.jwt_algorithms, audience=s.jwt_audience,
                                issuer=s.jwt_issuer, options={"require": ["exp", "aud", "iss"]})
        except (jwt.PyJWTError, TypeError) as exc:  # PyJWT raises TypeError for an `iss` that is no string
            raise unauthorized(f"Invalid token: {exc}") from exc
        tenant = claims.get(s.jwt_tenant_claim)
        if not isinstance(tenant, str):
            raise unauthorized(f"The token has no {s.jwt_tenant_claim!r} claim naming a tenant.")
        scope = claims.get(s.jwt_scope_claim, "inference")
        if isinstance(scope, str):
            scope = scope.split()
        if not isinstance(scope, list) or not all(isinstance(item, str) for item in scope):
            raise unauthorized(f"The token's {s.jwt_scope_claim!r} claim is neither a string of scopes nor a "
                               "list of strings.")
        scopes = frozenset(scope) & TOKEN_SCOPES  # `operator` only by the name the operator configured
        if s.jwt_operator_scope is not None and s.jwt_operator_scope in scope:
            scopes |= {"operator"}
        return Principal(acting_tenant(tenant, self.tenants.get(tenant)), str(claims.get("sub", "jwt")), scopes)

    def _signing_key(self, token: str):
        kid = jwt.get_unverified_header(token).get("kid")
        if kid not in self.signing_keys:
            raise unauthorized(f"Invalid token: unknown signing key {kid!r}.")
        return self.signing_keys[kid]

