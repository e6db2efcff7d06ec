"""Versioned routes: a model alias -> a route version (targets with weights, fallbacks, how to
choose). Versions are immutable; at most one is `active` and one `canary` (with a traffic share);
the rest are `retired`. Every change is audited. The operations behind both the admin API and
`servegate routes`.

```yaml
# route.yaml
targets:
  - {backend: tgi-a, weight: 3}
  - {backend: tgi-b, weight: 1}
fallbacks: [vllm-a]            # tried, in order, when the chosen target fails before its first token
shadow: {backend: vllm-a, share: 0.1}          # mirrored, answers compared, never returned
balance: weighted              # or least-loaded: the target with the shortest queue, from its live load
prefix_aware: {block_chars: 256, blocks: 8}   # prompts sharing a leading block go where it was served last
rules: routing                 # policies/rules/routing.yaml: exclude and rank targets per request
timeout_s: 120                 # whole request
```
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlmodel import Session, col, select

from gateway.tables import AdapterRecord, AuditLog, Route
from gateway.tenancy.tenants import NAME_PATTERN, Conflict, NotFound, audit
from policies import rules


class Target(BaseModel):
    model_config = ConfigDict(extra="forbid")
    backend: str = Field(min_length=1)
    weight: float = Field(default=1.0, gt=0)
    pool: str = ""  # a label routing rules may read, e.g. throughput


class PrefixAware(BaseModel):
    """Hash the prompt's first `blocks` blocks of `block_chars` characters, each chained to the one
    before (as llm-d's approximate prefix scorer does), and send a request to the target that last
    served its longest known prefix, unless that target has `max_extra_waiting` more requests
    waiting than the least loaded one."""
    model_config = ConfigDict(extra="forbid")
    block_chars: int = Field(default=256, ge=16)
    blocks: int = Field(default=8, ge=1, le=64)
    max_extra_waiting: int = Field(default=4, ge=0)


class Shadow(BaseModel):
    """Mirror a sampled `share` of requests to `backend`: its answers are recorded beside the
    primary's (`servegate routes shadow-report`) and never reach the client."""
    model_config = ConfigDict(extra="forbid")
    backend: str = Field(min_length=1)
    share: float = Field(default=1.0, gt=0, le=1)


class RouteSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    targets: list[Target] = Field(min_length=1)
    fallbacks: list[str] = []
    balance: Literal["weighted", "least-loaded", "round-robin"] = "weighted"
    prefix_aware: PrefixAware | None = None
    # a LoRA adapter's request goes to a target with the adapter in its compute slots, else loaded,
    # before one that must load it (then by `balance` among the readiest)
    adapter_affinity: bool = True
    # a registered LoRA adapter every target applies: an adapter's versions are a route's versions,
    # canaried, promoted and rolled back as any
    adapter: str | None = Field(default=None, min_length=1)
    shadow: Shadow | None = None
    rules: str | None = Field(default=None, pattern=r"^[a-z0-9][a-z0-9_-]*$")  # a file in policies/rules
    timeout_s: float | None = Field(default=None, gt=0)

    @field_validator("rules")
    @classmethod
    def _rules_exist(cls, name: str | None) -> str | None:
        """A route names a rules file that loads (or the deploy fails, saying why)."""
        if name is not None:
            rules.named(name)
        return name

    def backends(self) -> list[str]:
        return [t.backend for t in self.targets] + self.fallbacks + ([self.shadow.backend] if self.shadow else [])


class RouteOut(BaseModel):
    alias: str
    version: int
    status: Literal["active", "canary", "retired"]
    share: float | None  # the canary's share of traffic
    spec: RouteSpec
    created_at: datetime


class RouteState(BaseModel):
    alias: str
    active: RouteOut | None
    canary: RouteOut | None


class DeployIn(BaseModel):
    spec: RouteSpec
    canary_share: float | None = Field(default=None, gt=0, lt=1)


def _out(route: Route) -> RouteOut:
    spec = RouteSpec.model_validate({"targets": route.targets, **{k: v for k, v in route.spec.items()
                                                                   if k != "share"}})
    return RouteOut(alias=route.alias, version=route.version, status=route.status, share=route.spec.get("share"),
                    spec=spec, created_at=route.created_at)


def _json(route: Route) -> dict[str, Any]:
    return _out(route).model_dump(mode="json")


def _versions(session: Session, alias: str) -> list[Route]:
    return list(session.exec(select(Route).where(Route.alias == alias).order_by(col(Route.version))))


def _with_status(versions: list[Route], status: str) -> Route | None:
    return next((r for r in versions if r.status == status), None)


def _retire(session: Session, actor: str, route: Route, action: str) -> None:
    before = _json(route)
    route.status = "retired"
    session.add(route)
    audit(session, actor, action, f"{route.alias}@{route.version}", before, _json(route))


def deploy(session: Session, actor: str, alias: str, spec: RouteSpec, canary_share: float | None = None,
           known_backends: set[str] | None = None) -> RouteOut:
    """A new version: active at once, or a canary beside the active one with `canary_share` of traffic."""
    if not re.fullmatch(NAME_PATTERN, alias):
        raise Conflict(f"alias {alias!r}: letters, digits, '_', '.', '-' (up to 64)")
    if known_backends is not None and (unknown := [b for b in spec.backends() if b not in known_backends]):
        raise NotFound(f"route {alias!r} names backends this gateway does not have: {', '.join(unknown)} "
                       f"(known: {', '.join(sorted(known_backends))})")
    if spec.adapter is not None and session.exec(select(AdapterRecord).where(
            AdapterRecord.name == spec.adapter)).first() is None:
        raise NotFound(f"route {alias!r} applies the LoRA adapter {spec.adapter!r}, which is not registered "
                       "(servegate adapters add)")
    versions = _versions(session, alias)
    active, canary = _with_status(versions, "active"), _with_status(versions, "canary")
    if canary_share is not None and active is None:
        raise Conflict(f"route {alias!r} has no active version to compare a canary with: deploy without --canary "
                       "first")
    if canary is not None:
        _retire(session, actor, canary, "route.canary.replace")
    if canary_share is None and active is not None:
        _retire(session, actor, active, "route.retire")
    extra = spec.model_dump(exclude={"targets"}, exclude_none=True)
    route = Route(alias=alias, version=(versions[-1].version + 1) if versions else 1,
                  status="active" if canary_share is None else "canary",
                  targets=[t.model_dump() for t in spec.targets],
                  spec=extra | ({"share": canary_share} if canary_share is not None else {}))
    session.add(route)
    audit(session, actor, "route.deploy.canary" if canary_share is not None else "route.deploy",
          f"{alias}@{route.version}", None, _json(route))
    session.commit()
    return _out(route)


def promote(session: Session, actor: str, alias: str, reason: str = "") -> RouteOut:
    """Make the canary the active version; a reason (the canary guard's) is written with it, in the
    same transaction, so that no reader sees the promotion without it."""
    versions = _versions(session, alias)
    canary = _with_status(versions, "canary")
    if canary is None:
        raise Conflict(f"route {alias!r} has no canary to promote")
    if (active := _with_status(versions, "active")) is not None:
        _retire(session, actor, active, "route.retire")
    before = _json(canary)
    canary.status, canary.spec = "active", {k: v for k, v in canary.spec.items() if k != "share"}
    session.add(canary)
    audit(session, actor, "route.promote", f"{alias}@{canary.version}", before, _json(canary))
    if reason:
        audit(session, actor, "route.promote.reason", f"{alias}@{canary.version}", None, {"reason": reason})
    session.commit()
    return _out(canary)


def rollback(session: Session, actor: str, alias: str, to: int | None = None, reason: str = "") -> RouteOut:
    """With a canary and no `to`: end the canary (the active version keeps all traffic). Otherwise
    make `to` (default: the version active before this one) active again."""
    versions = _versions(session, alias)
    if not versions:
        raise NotFound(f"no route {alias!r}")
    active, canary = _with_status(versions, "active"), _with_status(versions, "canary")
    if canary is not None and to is None:
        _retire(session, actor, canary, "route.rollback.canary")
        _note(session, actor, alias, canary.version, reason)
        session.commit()
        if active is None:
            raise Conflict(f"route {alias!r} has no active version")
        return _out(active)
    current = active.version if active else versions[-1].version + 1
    earlier = [r for r in versions if r.status == "retired" and r.version < current]
    target = next((r for r in versions if r.version == to), None) if to is not None else (
        earlier[-1] if earlier else None)
    if target is None:
        raise NotFound(f"route {alias!r} has no version {to} to roll back to" if to is not None else
                       f"route {alias!r} has no earlier version to roll back to")
    if target is active:
        raise Conflict(f"version {to} of {alias!r} is already active")
    for live in (canary, active):
        if live is not None:
            _retire(session, actor, live, "route.rollback.retire")
    before = _json(target)
    target.status, target.spec = "active", {k: v for k, v in target.spec.items() if k != "share"}
    session.add(target)
    audit(session, actor, "route.rollback", f"{alias}@{target.version}", before, _json(target))
    _note(session, actor, alias, target.version, reason)
    session.commit()
    return _out(target)


def end_canary(session: Session, actor: str, alias: str, version: int, reason: str,
               action: Literal["rollback", "promote"] = "rollback") -> bool:
    """Roll back (or promote) canary `version` if it is still the canary; False when it no longer
    is (another replica, or an operator, acted first)."""
    canary = _with_status(_versions(session, alias), "canary")
    if canary is None or canary.version != version:
        return False
    if action == "promote":
        promote(session, actor, alias, reason)
    else:
        _retire(session, actor, canary, "route.rollback.canary")
        _note(session, actor, alias, version, reason)
        session.commit()
    return True


def _note(session: Session, actor: str, alias: str, version: int, reason: str) -> None:
    if reason:
        audit(session, actor, "route.rollback.reason", f"{alias}@{version}", None, {"reason": reason})


def history(session: Session, alias: str) -> dict[str, Any]:
    versions = _versions(session, alias)
    if not versions:
        raise NotFound(f"no route {alias!r}")
    events = session.exec(select(AuditLog).where(col(AuditLog.target).startswith(f"{alias}@"))
                          .order_by(col(AuditLog.id))).all()
    return {"alias": alias, "versions": [_out(r).model_dump(mode="json") for r in reversed(versions)],
            "changes": [{"at": e.at.isoformat(), "actor": e.actor, "action": e.action, "target": e.target,
                         "after": e.after} for e in events]}


def table(session: Session) -> dict[str, RouteState]:
    """Every alias's live versions: what each replica's router serves."""
    live = session.exec(select(Route).where(col(Route.status).in_(("active", "canary")))).all()
    states: dict[str, RouteState] = {}
    for route in live:
        state = states.setdefault(route.alias, RouteState(alias=route.alias, active=None, canary=None))
        setattr(state, route.status, _out(route))
    return states
