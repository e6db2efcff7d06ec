"""Errors as each API's clients expect them.

OpenAI routes answer `{"error": {message, type, param, code}}`; TGI routes answer
`{"error", "error_type"}` with TGI's statuses (422 validation, 424 generation, 429 overloaded).
Every error, from a backend or from the gateway itself, becomes a `GatewayError` first.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from backends.base import (
    BackendError,
    BackendTimeout,
    ContextTooLong,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    Unavailable,
    UpstreamError,
)

log = logging.getLogger("servegate.errors")

# backend error class -> (HTTP status, OpenAI error type)
STATUS = {
    ContextTooLong: (400, "invalid_request_error"),
    InvalidRequest: (400, "invalid_request_error"),
    ModelNotFound: (404, "invalid_request_error"),
    Overloaded: (503, "overloaded_error"),
    Unavailable: (503, "service_unavailable_error"),
    BackendTimeout: (504, "timeout_error"),
    UpstreamError: (502, "upstream_error"),
}


class ClientDisconnected(Exception):
    """The HTTP client went away; its call was cancelled. Answered 499 (to nobody), never logged."""


class BodyTooLarge(HTTPException):
    """Raised while the body is read (FastAPI passes HTTP exceptions from there through), so the
    answer takes the shape of the route's API."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"The request body is larger than this gateway accepts ({limit} bytes).")


class GatewayError(Exception):
    def __init__(self, status: int, message: str, type_: str, *, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers

    @classmethod
    def of(cls, error: BackendError) -> GatewayError:
        status, type_ = next((STATUS[c] for c in type(error).__mro__ if c in STATUS), (502, "upstream_error"))
        headers = {"Retry-After": "1"} if error.retryable else None
        return cls(status, error.message, type_, code=error.code, param=error.param, headers=headers)

    def openai_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def tgi_status(self) -> int:
        if self.status in (400, 404):
            return 422
        if self.status == 503:
            return 429
        if self.status in (502, 504):
            return 424
        return self.status

    def tgi_body(self) -> dict:
        kind = {422: "validation", 424: "generation", 429: "overloaded"}.get(self.tgi_status(), self.type)
        return {"error": self.message, "error_type": kind}


def is_tgi(request: Request) -> bool:
    route = request.scope.get("route")
    return "tgi" in getattr(route, "tags", ())


def error_response(request: Request, error: GatewayError) -> JSONResponse:
    if is_tgi(request):
        return JSONResponse(error.tgi_body(), status_code=error.tgi_status(), headers=error.headers)
    return JSONResponse(error.openai_body(), status_code=error.status, headers=error.headers)


def validation_error(errors: Sequence[dict]) -> GatewayError:
    """A body's first validation error (FastAPI's or pydantic's), naming where it lies."""
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return GatewayError(400, f"Invalid JSON in the request body: {first.get('msg')}", "invalid_request_error")
    where = ".".join(loc) or "body"
    return GatewayError(400, f"{where}: {first.get('msg')}", "invalid_request_error", param=loc[0] if loc else None)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(GatewayError)
    async def _gateway(request: Request, exc: GatewayError) -> JSONResponse:
        return error_response(request, exc)

    @app.exception_handler(BackendError)
    async def _backend(request: Request, exc: BackendError) -> JSONResponse:
        return error_response(request, GatewayError.of(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request, validation_error(exc.errors()))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(request, GatewayError(exc.status_code, str(exc.detail), type_,
                                                    headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(request, GatewayError(500, "internal error", "server_error"))
