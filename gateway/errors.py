"""Errors as clients expect them: OpenAI's `{"error": {message, type, param, code}}`."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
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

# error class -> (HTTP status, OpenAI error type)
STATUS = {
    ContextTooLong: (400, "invalid_request_error"),
    InvalidRequest: (400, "invalid_request_error"),
    ModelNotFound: (404, "invalid_request_error"),
    Overloaded: (503, "overloaded_error"),
    Unavailable: (503, "service_unavailable_error"),
    BackendTimeout: (504, "timeout_error"),
    UpstreamError: (502, "upstream_error"),
}


def status_of(error: BackendError) -> tuple[int, str]:
    for cls in type(error).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 502, "upstream_error"


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def backend_error_body(error: BackendError) -> dict:
    return error_body(error.message, status_of(error)[1], error.param, error.code)


def backend_error_response(error: BackendError) -> JSONResponse:
    status, _ = status_of(error)
    headers = {"Retry-After": "1"} if error.retryable else None
    return JSONResponse(backend_error_body(error), status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"Invalid JSON in the request body: {first.get('msg')}", None
    where = ".".join(loc) or "body"
    return f"{where}: {first.get('msg')}", (loc[0] if loc else None)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(BackendError)
    async def _backend(_: Request, exc: BackendError) -> JSONResponse:
        return backend_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), type_), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body("internal error", "server_error"), status_code=500)
