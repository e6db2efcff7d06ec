"""Request bodies decoded off the event loop: a JSON body of megabytes of small items takes a
fraction of a second to decode and validate, which every other request would wait out."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import TypeAdapter, ValidationError
from starlette.requests import ClientDisconnect

from gateway.errors import ClientDisconnected

# Large bodies are decoded one at a time: under the GIL they would not run faster together, and
# the event loop, which needs the GIL at every wake-up, then competes with one thread whatever the
# number of large bodies posted at once.
LARGE_BODIES = ThreadPoolExecutor(1, thread_name_prefix="large-bodies")


class OffLoopBody(APIRoute):
    """A route whose JSON body, when large (over `Settings.gate_body_bytes`), is decoded and
    validated on the large bodies' thread, as FastAPI would on the event loop: megabytes of small
    items take a fraction of a second, which every other request would wait out. FastAPI then finds
    the body validated (a model passes its own validation as it is); a refusal is the one it would
    give."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()
        if self.body_field is None:
            return handle
        body_type = TypeAdapter(self.body_field.field_info.annotation)

        async def handler(request: Request) -> Response:
            try:
                body = await request.body()
            except ClientDisconnect:
                raise ClientDisconnected from None
            if len(body) <= request.app.state.gateway.settings.gate_body_bytes or not is_json(request):
                return await handle(request)
            validated = await asyncio.get_running_loop().run_in_executor(LARGE_BODIES, validated_body, body_type,
                                                                         body)
            return await handle(ValidatedRequest(request, body, validated))

        return handler


def is_json(request: Request) -> bool:
    """Whether FastAPI reads the body as JSON: its content type says so."""
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def validated_body(body_type: TypeAdapter, body: bytes) -> Any:
    """The body decoded and validated, or FastAPI's own refusal of it."""
    try:
        decoded = json.loads(body)
    except json.JSONDecodeError as exc:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": exc.msg}}]) from None
    except ValueError:  # not UTF-8
        raise HTTPException(400, "There was an error parsing the body") from None
    try:
        return body_type.validate_python(decoded, from_attributes=True)
    except ValidationError as exc:
        raise RequestValidationError([error | {"loc": ("body", *error["loc"])}
                                      for error in exc.errors(include_url=False)]) from None


class ValidatedRequest(Request):
    """A request whose body was read and validated already: what FastAPI reads of it."""

    def __init__(self, request: Request, body: bytes, validated: Any) -> None:
        super().__init__(request.scope, request.receive)
        self._read, self._validated = body, validated

    async def body(self) -> bytes:
        return self._read

    async def json(self) -> Any:
        return self._validated
