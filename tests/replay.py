"""Replaying a runtime's recorded wire format (tests/fixtures/*.json) as a local server."""

from __future__ import annotations

import copy
import json

from advisor.measure import stub


def replay(fixture: dict, seen: list | None = None):
    """An ASGI app answering as the fixture says: a too-long prompt and a top_p above 1 (at 1 or
    above where the fixture says `top_p_below_one`, as TGI) get the runtime's own errors, a
    route's own (`"POST /generate_stream context_too_long"`) before the shared one, either as a
    status or as events on a 200 stream; generations stream the recorded chunks, cut where a
    requested stop string appears (finish reason `stop`), as the runtime would. An answer's
    `framing` is `data: ` unless it says `data:` (TGI), and `done: false` leaves out `[DONE]`.
    Request bodies go to `seen`."""
    routes = fixture["routes"]

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = await stub.read_body(receive)
        key, request = f"{scope['method']} {scope['path']}", {}
        if scope["method"] == "POST":
            request = json.loads(body or b"{}")
            if seen is not None:
                seen.append(request)
            text = json.dumps(request.get("prompt") or request.get("messages") or request.get("text")
                              or request.get("inputs"))
            top_p = request.get("top_p", (request.get("parameters") or {}).get("top_p")) or 0
            failure = None
            if len(text) > 10_000:
                failure = "context_too_long"
            elif top_p > 1 or (fixture.get("top_p_below_one") and top_p >= 1):
                failure = "invalid_parameter"
            if failure:
                key = f"{key} {failure}" if f"{key} {failure}" in routes else failure
        answer = routes.get(key, {"status": 404, "json": {"detail": "Not Found"}})
        if "sse" in answer:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            stops = request.get("stop") or (request.get("parameters") or {}).get("stop") or []
            framing = answer.get("framing", "data: ")
            for event in cut_at_stop(answer["sse"], [stops] if isinstance(stops, str) else stops):
                await send({"type": "http.response.body", "body": f"{framing}{json.dumps(event)}\n\n".encode(),
                            "more_body": True})
            await send({"type": "http.response.body",
                        "body": f"{framing}[DONE]\n\n".encode() if answer.get("done", True) else b""})
            return
        payload = json.dumps(answer["json"]).encode() if "json" in answer else answer["text"].encode()
        kind = b"application/json" if "json" in answer else b"text/plain"
        await send({"type": "http.response.start", "status": answer["status"], "headers": [(b"content-type", kind)]})
        await send({"type": "http.response.body", "body": payload})

    return app


def cut_at_stop(events: list[dict], stops: list[str]) -> list[dict]:
    """The stream's events up to the first stop string (not included), then a stop finish: an
    OpenAI chunk with finish reason `stop`, or TGI's last token event with `stop_sequence`."""
    if not stops:
        return events
    out, text = [], ""
    for event in events:
        piece = _piece(event)
        found = next((i for i in (f"{text}{piece}".find(s) for s in stops) if i >= 0), -1)
        if found < 0:
            out.append(event)
            text += piece
            continue
        last = copy.deepcopy(event)
        kept = f"{text}{piece}"[len(text):found] if found > len(text) else ""
        if "token" in last:  # TGI: the last token event carries the whole text and the details
            last["token"]["text"], last["generated_text"] = kept, text + kept
            last["details"] = {**events[-1]["details"], "finish_reason": "stop_sequence",
                               "generated_tokens": len(out) + 1}
            return out + [last]
        choice = last["choices"][0]
        if "delta" in choice:
            choice["delta"] = {"content": kept}
        else:
            choice["text"] = kept
        choice["finish_reason"] = "stop"
        return out + [last] + [e for e in events if e.get("usage")]
    return events


def _piece(event: dict) -> str:
    if "token" in event:
        return event["token"]["text"]
    choices = event.get("choices") or []
    return (choices[0].get("text", (choices[0].get("delta") or {}).get("content", "")) or "") if choices else ""
