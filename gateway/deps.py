"""FastAPI dependencies shared by the routers."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from .routing import ModelRouter


@dataclass(frozen=True)
class Principal:
    """Who is calling. Tenants and API keys replace the anonymous principal in the gateway issue."""

    tenant: str = "default"
    key_prefix: str | None = None
    scopes: frozenset[str] = frozenset({"inference"})


ANONYMOUS = Principal()


async def authenticate(request: Request) -> Principal:
    return ANONYMOUS


def get_router(request: Request) -> ModelRouter:
    return request.app.state.router
