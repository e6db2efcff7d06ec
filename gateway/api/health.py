"""Probes: /health (liveness: the process answers) and /ready (every backend can serve)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from backends.base import Health

from ..deps import get_router
from ..routing import ModelRouter

router = APIRouter(tags=["probes"])


@router.get("/health")
async def health() -> dict:
    return {"status": "ok"}


@router.get("/ready")
async def ready(models: Annotated[ModelRouter, Depends(get_router)]) -> JSONResponse:
    states = {model: (await backend.health()).value for model, backend in models.backends.items()}
    ok = bool(states) and all(s == Health.READY for s in states.values())
    return JSONResponse({"status": "ready" if ok else "not ready", "models": states}, status_code=200 if ok else 503)
