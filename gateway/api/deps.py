"""FastAPI dependencies shared by the routers: the gateway state and who is calling."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from gateway.operations import tracing
from gateway.service import Gateway
from gateway.tenancy.auth import Principal, require


def get_gateway(request: Request) -> Gateway:
    return request.app.state.gateway


def credential(request: Request) -> str | None:
    """The key as clients send it: `Authorization: Bearer`, or Azure-style `api-key` / `x-api-key`."""
    headers = request.headers
    authorization = headers.get("authorization")
    if authorization:
        scheme, _, token = authorization.partition(" ")
        return token.strip() if scheme.lower() == "bearer" else None
    return headers.get("x-api-key") or headers.get("api-key")


def _require(*scopes: str):
    """A caller holding one of `scopes`."""
    async def principal(request: Request, gateway: Annotated[Gateway, Depends(get_gateway)]) -> Principal:
        with tracing.request_trace(request).step("gateway.auth") as span:
            who = await gateway.directory.authenticate(credential(request))
            span.set_attribute("servegate.tenant", who.tenant.name)
        return require(who, *scopes)

    return principal


InferencePrincipal = Annotated[Principal, Depends(_require("inference"))]
AdminPrincipal = Annotated[Principal, Depends(_require("admin", "operator"))]  # a tenant's, or the operator
OperatorPrincipal = Annotated[Principal, Depends(_require("operator"))]
GatewayDep = Annotated[Gateway, Depends(get_gateway)]
