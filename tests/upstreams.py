"""Streamed answers of an OpenAI-compatible upstream and a gateway served in front of such
upstreams: what the request core's tests (billing, failover, request limits, error logs, access
control, upstream fields) share."""

from __future__ import annotations

import asyncio
import json
import uuid
from contextlib import ExitStack, contextmanager
from types import SimpleNamespace

import httpx

from advisor.measure import stub
from backends.openai_compat import OpenAICompatBackend, OpenAICompatConfig

from .conftest import ADMIN_KEY, bearer, gateway_app, serve_app, wait_ready

PIECES = 60  # an upstream answer, one token per piece, streamed every PIECE_S
PIECE_S = 0.02


def piece(text: str | None, finish: str | None = None, usage: dict | None = None) -> bytes:
    choices = [] if text is None else [{"index": 0, "text": text, "finish_reason": finish}]
    return f"data: {json.dumps({'choices': choices, 'usage': usage})}\n\n".encode()


async def answer(count: int = PIECES, die_after: int | None = None, first_after_s: float = 0.0):
    """An upstream's streamed completion without token ids (as every remote runtime sends), its
    usage only at the end; with `die_after`, the connection breaks after that many pieces."""
    await asyncio.sleep(first_after_s)
    for i in range(count):
        if i == die_after:
            raise ConnectionResetError("the upstream died")
        yield piece("tok ")
        await asyncio.sleep(PIECE_S)
    yield piece("", "length")
    yield piece(None, usage={"prompt_tokens": 3, "completion_tokens": count, "total_tokens": count + 3})
    yield b"data: [DONE]\n\n"


def remote(url: str, name: str = "remote") -> OpenAICompatBackend:
    return OpenAICompatBackend(OpenAICompatConfig(base_url=url, model=stub.MODEL, max_context=4096), name=name)


@contextmanager
def gateway_over(upstreams: dict[str, object], tmp_path, **settings):
    """A gateway serving one model per upstream app, named by its key."""
    with ExitStack() as stack:
        urls = {name: stack.enter_context(serve_app(app)) for name, app in upstreams.items()}
        app = gateway_app({name: remote(url, name) for name, url in urls.items()}, tmp_path, **settings)
        url = stack.enter_context(serve_app(app))
        wait_ready(url)
        yield SimpleNamespace(url=url, gateway=app.state.gateway)


def admin(gw, method: str, path: str, key: str = ADMIN_KEY, **kwargs) -> httpx.Response:
    return httpx.request(method, gw.url + path, headers=bearer(key), timeout=30, **kwargs)


def tenant_with_key(gw, scopes: tuple[str, ...] = ("inference",), **limits) -> tuple[str, str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    assert admin(gw, "POST", "/admin/tenants", json={"name": name, **limits}).status_code == 201
    created = admin(gw, "POST", "/admin/keys", json={"tenant": name, "scopes": list(scopes)})
    assert created.status_code == 201, created.text
    return name, created.json()["key"]
