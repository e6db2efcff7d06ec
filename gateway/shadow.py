"""Shadow traffic: a sampled request is sent to the route's candidate too, at the same time as to
its primary target. The client gets only the primary's answer; the candidate's latency, tokens,
error and agreement with the primary (exact match for greedy requests, token-level similarity
otherwise) are recorded for `servegate routes shadow-report`. A failing or saturated candidate
costs the client nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import logging
import time
from dataclasses import dataclass

from sqlmodel import Session, col, select

from backends.base import Backend, BackendError, Delta, GenerateRequest

from .models import ShadowResult

log = logging.getLogger("servegate.shadow")
GREEDY_BELOW = 1e-5  # temperature under which sampling is greedy, as the engines treat it


@dataclass
class Answer:
    text: str = ""
    tokens: int = 0
    ttft_ms: float | None = None
    latency_ms: float = 0.0
    error: str | None = None


async def mirror(gateway, backend: Backend, greq: GenerateRequest) -> Answer:
    """The candidate's answer to the same request, within the gateway's request timeout."""
    answer, started = Answer(), time.monotonic()
    admission = gateway.admission[backend.name]
    shadow = dataclasses.replace(greq, request_id=f"{greq.request_id}-shadow")
    try:
        await admission.acquire()
        try:
            async with asyncio.timeout(gateway.settings.request_timeout_s):
                async for event in backend.generate(shadow):
                    if isinstance(event, Delta) and event.index == 0 and event.text:
                        if answer.ttft_ms is None:
                            answer.ttft_ms = (time.monotonic() - started) * 1000
                        answer.text += event.text
                    elif not isinstance(event, Delta):
                        answer.tokens = event.usage.completion_tokens
        finally:
            admission.release()
    except BackendError as exc:
        answer.error = exc.code
    except TimeoutError:
        answer.error = "timeout"
    answer.latency_ms = (time.monotonic() - started) * 1000
    return answer


def similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a.split(), b.split(), autojunk=False).ratio()


async def record(gateway, alias: str, version: int, greq: GenerateRequest, primary_backend: str,
                 primary: Answer, shadow_backend: str, pending: asyncio.Task) -> None:
    """Wait for the candidate, then store both answers side by side."""
    shadow = await pending
    row = ShadowResult(
        alias=alias, version=version, request_id=greq.request_id, primary_backend=primary_backend,
        shadow_backend=shadow_backend, greedy=greq.temperature < GREEDY_BELOW, primary_ttft_ms=primary.ttft_ms,
        shadow_ttft_ms=shadow.ttft_ms, primary_latency_ms=primary.latency_ms, shadow_latency_ms=shadow.latency_ms,
        primary_tokens=primary.tokens, shadow_tokens=shadow.tokens, shadow_error=shadow.error,
        exact_match=shadow.error is None and primary.text == shadow.text,
        similarity=0.0 if shadow.error else similarity(primary.text, shadow.text))

    def insert() -> None:
        with Session(gateway.db) as session:
            session.add(row)
            session.commit()

    try:
        await asyncio.to_thread(insert)
    except Exception:  # a lost comparison must not disturb anything else
        log.exception("shadow result for %s not recorded", greq.request_id)


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

