"""Shadow traffic: a sampled request is sent to the route's candidate too, at the same time as to
its primary target. The client gets only the primary's answer; the candidate's latency, tokens,
error and agreement with the primary (exact match for greedy requests, token-level similarity
otherwise) are recorded for `servegate routes shadow-report`. A failing or saturated candidate
costs the client nothing."""

from __future__ import annotations

import asyncio
import difflib
import logging

from sqlalchemy import Engine
from sqlmodel import Session, col, select

from gateway.inference.call import Outcome
from gateway.tables import ShadowResult

log = logging.getLogger("servegate.shadow")
GREEDY_BELOW = 1e-5  # temperature under which sampling is greedy, as the engines treat it


def similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a.split(), b.split(), autojunk=False).ratio()


async def record(db: Engine, primary: Outcome, pending: asyncio.Task) -> None:
    """Wait for the candidate's outcome, then store both answers side by side."""
    mirrored: Outcome = await pending
    failed = mirrored.status != "ok"
    decision = primary.decision
    row = ShadowResult(
        alias=decision.alias, version=decision.version, request_id=primary.request_id,
        primary_backend=primary.backend, shadow_backend=decision.shadow.name,
        greedy=primary.request.temperature < GREEDY_BELOW,
        primary_ttft_ms=primary.ttft_ms, shadow_ttft_ms=mirrored.ttft_ms,
        primary_latency_ms=primary.latency_ms, shadow_latency_ms=mirrored.latency_ms,
        primary_tokens=primary.usage.completion_tokens, shadow_tokens=mirrored.usage.completion_tokens,
        shadow_error=mirrored.error or ("cancelled" if failed else None),
        exact_match=not failed and primary.text == mirrored.text,
        similarity=0.0 if failed else similarity(primary.text, mirrored.text))

    def insert() -> None:
        with Session(db) as session:
            session.add(row)
            session.commit()

    try:
        await asyncio.to_thread(insert)
    except Exception:  # a lost comparison must not disturb anything else
        log.exception("shadow result for %s not recorded", primary.request_id)


def report(session: Session, alias: str) -> list[dict]:
    """Per (version, candidate): how often it failed, how fast it was against the primary, and
    how often it agreed."""
    rows = session.exec(select(ShadowResult).where(ShadowResult.alias == alias)
                        .order_by(col(ShadowResult.version), col(ShadowResult.shadow_backend))).all()
    groups: dict[tuple[int, str], list[ShadowResult]] = {}
    for row in rows:
        groups.setdefault((row.version, row.shadow_backend), []).append(row)
    out = []
    for (version, backend), group in groups.items():
        answered = [r for r in group if r.shadow_error is None]
        greedy = [r for r in answered if r.greedy]
        sampled = [r for r in answered if not r.greedy]
        out.append({
            "version": version, "shadow_backend": backend, "primary_backends": sorted({r.primary_backend
                                                                                        for r in group}),
            "requests": len(group), "errors": len(group) - len(answered),
            "error_rate": (len(group) - len(answered)) / len(group),
            "primary_ttft_p50_ms": _median(r.primary_ttft_ms for r in answered),
            "shadow_ttft_p50_ms": _median(r.shadow_ttft_ms for r in answered),
            "primary_latency_p50_ms": _median(r.primary_latency_ms for r in answered),
            "shadow_latency_p50_ms": _median(r.shadow_latency_ms for r in answered),
            "greedy_requests": len(greedy),
            "exact_match_rate": sum(r.exact_match for r in greedy) / len(greedy) if greedy else None,
            "sampled_requests": len(sampled),
            "mean_similarity": sum(r.similarity for r in sampled) / len(sampled) if sampled else None,
        })
    return out


def _median(values) -> float | None:
    ordered = sorted(v for v in values if v is not None)
    return ordered[len(ordered) // 2] if ordered else None

