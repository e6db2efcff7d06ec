"""LoRA adapters as tenants' resources: the operations behind both the admin API and
`servegate adapters`. An adapter is called by its name as a model and served on its base's
backends; its owner (a tenant, or none: the operator's) and the tenants it names may use it,
and to anyone else it does not exist. Every change is written to the audit log in the same
transaction, as tenants' and keys' are."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from pydantic import Field
from sqlmodel import Session, select

from backends import adapter_files
from gateway.errors import GatewayError
from gateway.tables import AdapterRecord, Tenant, UsageLimits
from gateway.tenancy.tenants import NAME_PATTERN, Conflict, NotFound, audit

# A model name clients send: a Hugging Face id may hold a slash (`org/adapter`).
ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}$"


class AdapterIn(UsageLimits):
    name: str = Field(pattern=ADAPTER_NAME, description="The model name clients send for it.")
    base: str = Field(min_length=1, max_length=128, description="The served model or route alias it applies to.")
    path: str = Field(min_length=1, max_length=1024, description="Where its backends read it (a directory, a file "
                                                                 "or a hub id, as the runtime takes it).")
    owner: str | None = Field(default=None, pattern=NAME_PATTERN,
                              description="Its tenant; none: the operator's. A tenant administrator's is its own.")
    tenants: list[str] = Field(default=[], description="Tenants that may use it besides its owner.")


class AdapterPatch(UsageLimits):
    """Fields to change; limits set to null are lifted, fields left out are kept."""

    path: str | None = Field(default=None, min_length=1, max_length=1024)
    tenants: list[str] | None = None


class AdapterOut(UsageLimits):
    name: str
    base: str
    path: str
    digest: str | None  # SHA-256 of the files as registered, which backends serve; None: a path its runtime reads
    owner: str | None
    tenants: list[str]
    created_at: datetime


def _out(row: AdapterRecord) -> AdapterOut:
    return AdapterOut.model_validate(row, from_attributes=True)


def _json(row: AdapterRecord) -> dict:
    return _out(row).model_dump(mode="json")


@dataclass(frozen=True)
class AdapterStore:
    """Where registered adapters' files are kept as they were checked (`backends/adapter_files.py`):
    backends read that copy, never the path a tenant registered, so changing or linking the files
    afterwards serves nothing else."""

    directory: Path
    max_bytes: int
    tenant_root: Path | None  # a tenant administrator's adapters lie under `<tenant_root>/<tenant>/`

    @classmethod
    def of(cls, settings) -> AdapterStore:
        return cls(settings.adapter_store_dir, settings.adapter_max_bytes, settings.tenant_adapter_dir)

    def keep(self, path: str, tenant: str | None) -> tuple[str | None, str | None]:
        """(digest, the stored copy's path) of the adapter at `path`, read and checked in a sandbox;
        `tenant`: the administrator's tenant, whose own directory every file must lie in (None: an
        operator's, anywhere). An operator's path that is not on this host (a hub id, a path only its
        runtime sees) is the runtime's to read: (None, None)."""
        within = self._own_directory(path, tenant)
        if within is None and not Path(path).exists():
            return None, None
        try:
            digest, copy = adapter_files.snapshot(path, self.directory, within, self.max_bytes)
            adapter_files.check(copy)
        except ValueError as exc:
            raise GatewayError(400, f"The adapter at {path!r} cannot be served: {exc}", "invalid_request_error",
                               code="invalid_adapter", param="path") from None
        return digest, str(copy)

    def _own_directory(self, path: str, tenant: str | None) -> Path | None:
        if tenant is None:
            return None
        if self.tenant_root is None:
            raise GatewayError(403, "Only an operator registers adapter paths here (SERVEGATE_TENANT_ADAPTER_DIR "
                                    "is unset).", "permission_error", code="adapter_path_forbidden")
        own = (self.tenant_root / tenant).resolve()
        if not Path(path).is_absolute() or not Path(path).resolve().is_relative_to(own):
            raise GatewayError(403, f"A tenant's adapters lie under {own}/.", "permission_error",
                               code="adapter_path_forbidden")
        return own


def _known_tenants(session: Session, names: list[str], within: str | None) -> None:
    """Every tenant named exists, checked for an operator only: to a tenant administrator an
    unknown name must answer as a known one does, or names could be probed (a name shared with
    before its tenant exists is that tenant's once the operator creates it)."""
    if within is not None:
        return
    found = set(session.exec(select(Tenant.name).where(Tenant.name.in_(names))).all()) if names else set()
    if missing := [name for name in names if name not in found]:
        raise NotFound(f"no tenant named {missing[0]!r}")


def _get(session: Session, name: str, within: str | None) -> AdapterRecord:
    """The adapter, if it is `within`'s own (None: any); another tenant's is not found."""
    row = session.exec(select(AdapterRecord).where(AdapterRecord.name == name)).first()
    if row is None or within is not None and row.owner != within:
        raise NotFound(f"no adapter named {name!r}")
    return row


def list_adapters(session: Session, within: str | None = None) -> list[AdapterOut]:
    """Every adapter, or (`within`) a tenant's own: one shared with it is listed by /v1/models, never
    with its owner's path and limits."""
    query = select(AdapterRecord).order_by(AdapterRecord.name)
    if within is not None:
        query = query.where(AdapterRecord.owner == within)
    return [_out(row) for row in session.exec(query)]


def create_adapter(session: Session, actor: str, data: AdapterIn, store: AdapterStore, within: str | None = None,
                   taken: set[str] = frozenset()) -> AdapterOut:
    """`within`: the registering administrator's tenant (None: an operator); `taken`: the model
    names served already, which an adapter may not shadow. Whose name a taken one is stays unsaid."""
    if data.name in taken or session.exec(select(AdapterRecord).where(AdapterRecord.name == data.name)).first():
        raise Conflict(f"the model name {data.name!r} is not available: choose another")
    _known_tenants(session, [*filter(None, [data.owner]), *data.tenants], within)
    digest, stored = store.keep(data.path, within)
    row = AdapterRecord(**data.model_dump() | {"tenants": sorted(set(data.tenants) - {data.owner}),
                                               "digest": digest, "stored_path": stored})
    session.add(row)
    session.flush()
    audit(session, actor, "adapter.create", row.name, None, _json(row))
    session.commit()
    return _out(row)


def update_adapter(session: Session, actor: str, name: str, patch: AdapterPatch, store: AdapterStore,
                   within: str | None = None) -> AdapterOut:
    row = _get(session, name, within)
    before = _json(row)
    changes = patch.model_dump(exclude_unset=True)
    if changes.get("tenants") is not None:
        _known_tenants(session, changes["tenants"], within)
        changes["tenants"] = sorted(set(changes["tenants"]) - {row.owner})
    if changes.get("path") is not None:
        row.digest, row.stored_path = store.keep(changes["path"], within)
    for field, value in changes.items():
        if value is None and field not in UsageLimits.model_fields:
            continue
        setattr(row, field, value)
    session.add(row)
    session.flush()
    audit(session, actor, "adapter.update", name, before, _json(row))
    session.commit()
    return _out(row)


def delete_adapter(session: Session, actor: str, name: str, within: str | None = None) -> AdapterOut:
    """Requests stop finding it within the refresh interval; backends keep what they loaded until
    they unload it themselves."""
    row = _get(session, name, within)
    out = _out(row)
    session.delete(row)
    audit(session, actor, "adapter.delete", name, out.model_dump(mode="json"), None)
    session.commit()
    return out
