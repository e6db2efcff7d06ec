"""Probes: /health (liveness: the process answers) and /ready (a backend can serve).

Ready needs one backend ready, not all: one replica down among a route's targets is the router's
business (it skips it), not a reason to take every gateway out of its load balancer. A background
task of the gateway's own that died (the usage ledger's writer, say) makes it unready until it is
running again: its body names the task and why, as it names each backend that failed to start."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from backends.base import Health
from gateway.api.deps import GatewayDep

router = APIRouter(tags=["probes"])


@router.get("/health")
async def health() -> dict:
    return {"status": "ok"}


@router.get("/ready")
async def ready(gateway: GatewayDep) -> JSONResponse:
    states = {model: (await backend.health()).value for model, backend in gateway.fleet.served.items()}
    ok = any(s == Health.READY for s in states.values()) and not gateway.down
    body = {"status": "ready" if ok else "not ready", "models": states}
    if gateway.down:
        body["down"] = dict(gateway.down)
    if gateway.failed_to_start:
        body["failed"] = dict(gateway.failed_to_start)
    return JSONResponse(body, status_code=200 if ok else 503)
