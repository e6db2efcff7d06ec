"""An instant OpenAI-compatible upstream, for measuring what sits in front of it (gateways,
adapters): a bare ASGI app, so that it costs as little as possible. Run it with
`uvicorn advisor.measure.stub:app`. Streams carry CHUNKS content chunks, a finish chunk, a usage
chunk and `[DONE]`, as vLLM sends them with `stream_options.include_usage`."""

from __future__ import annotations

import json

CHUNKS = 8
MODEL = "stub"


def _chunk(i: int) -> bytes:
    body = {"id": "stub", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "delta": {"content": f" tok{i}"}, "finish_reason": None}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


STREAM = [_chunk(i) for i in range(CHUNKS)] + [
    b'data: {"id":"stub","object":"chat.completion.chunk","created":0,"model":"stub","choices":[{"index":0,'
    b'"delta":{},"finish_reason":"length"}]}\n\n',
    b'data: {"id":"stub","object":"chat.completion.chunk","created":0,"model":"stub","choices":[],'
    b'"usage":{"prompt_tokens":12,"completion_tokens":8,"total_tokens":20}}\n\n',
    b"data: [DONE]\n\n",
]
FULL = json.dumps({"id": "stub", "object": "chat.completion", "created": 0, "model": MODEL, "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "".join(f" tok{i}" for i in range(CHUNKS))},
     "finish_reason": "length"}], "usage": {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20}}).encode()
MODELS = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 4096}]}).encode()


async def read_body(receive) -> bytes:
    """An ASGI request's whole body."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    body = await read_body(receive)
    if scope["method"] == "GET":
        payload = MODELS if scope["path"] == "/v1/models" else b"{}"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": payload})
        return
    if b'"stream":true' in body.replace(b" ", b""):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for piece in STREAM:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": FULL})
