"""Probes: /health (liveness: the process answers) and /ready (every backend can serve)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from backends.base import Health

from ..deps import GatewayDep

router = APIRouter(tags=["probes"])


@router.get("/health")
async def health() -> dict:
    return {"status": "ok"}


@router.get("/ready")
async def ready(gateway: GatewayDep) -> JSONResponse:
    states = {model: (await backend.health()).value for model, backend in gateway.router.backends.items()}
    ok = bool(states) and all(s == Health.READY for s in states.values())
    return JSONResponse({"status": "ready" if ok else "not ready", "models": states}, status_code=200 if ok else 503)
