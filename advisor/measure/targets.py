"""What a benchmark sends requests to: an OpenAI-compatible URL, a TGI URL, or a backend in process.

Each target turns (prompt, max_tokens) into an async stream of text pieces followed by one
`Counts` (token counts as the server reports them). All ask for greedy decoding and, where the
server honours it, `ignore_eos`, so output lengths follow the dataset.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from backends.base import Backend, Delta, Finish, GenerateRequest


class TargetError(Exception):
    """A request failed; the message says how (status and body, or the error event)."""


@dataclass
class Counts:
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int = 0


Piece = str | Counts


def _client(base_url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=httpx.Timeout(600.0, connect=10.0),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


async def _sse_events(response: httpx.Response) -> AsyncIterator[dict]:
    """JSON payloads of an SSE stream, with or without a space after `data:`, until [DONE] or the end."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        event = json.loads(payload)
        if "error" in event:
            raise TargetError(f"error event: {event['error']}")
        yield event


async def _scrape_servegate(client: httpx.AsyncClient, headers: dict) -> dict[str, float] | None:
    """A servegate server's engine figures from its /metrics (first model); None if it has none."""
    from prometheus_client.parser import text_string_to_metric_families

    response = await client.get("/metrics", headers=headers)
    if response.status_code != 200:
        return None
    figures = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name.startswith("servegate_backend_") and not sample.name.endswith("_created"):
                figures.setdefault(sample.name.removeprefix("servegate_backend_"), sample.value)
    return figures or None


async def _checked(response: httpx.Response) -> None:
    if response.status_code != 200:
        body = (await response.aread()).decode(errors="replace")
        raise TargetError(f"HTTP {response.status_code}: {body[:300]}")


class OpenAITarget:
    """`POST /v1/completions` with streaming and `stream_options.include_usage`. `server_pid`: the
    server's process where the bench started it, whose memory is then sampled during a run."""

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 server_pid: int | None = None) -> None:
        self.name, self.model, self.server_pid = base_url, model, server_pid
        self.client = _client(base_url)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def prepare(self) -> None:
        if self.model is None:
            models = (await self.client.get("/v1/models", headers=self.headers)).json()["data"]
            self.model = models[0]["id"]

    async def generate(self, prompt: str, max_tokens: int, model: str | None = None) -> AsyncIterator[Piece]:
        body = {"model": model or self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
        async with self.client.stream("POST", "/v1/completions", json=body, headers=self.headers) as response:
            await _checked(response)
            async for event in _sse_events(response):
                if event.get("choices"):
                    yield event["choices"][0].get("text") or ""
                if event.get("usage"):
                    usage = event["usage"]
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    yield Counts(usage.get("prompt_tokens"), usage.get("completion_tokens"), cached)

    async def engine_figures(self) -> dict[str, float] | None:
        return await _scrape_servegate(self.client, self.headers)

    async def close(self) -> None:
        await self.client.aclose()


class TGITarget:
    """TGI's native `POST /generate_stream` (events `data:{json}`, no [DONE], details at the end)."""

    server_pid = None  # a server this bench did not start

    def __init__(self, base_url: str, api_key: str | None = None) -> None:
        self.name = base_url
        self.client = _client(base_url)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def prepare(self) -> None:
        pass

    async def generate(self, prompt: str, max_tokens: int, model: str | None = None) -> AsyncIterator[Piece]:
        parameters = {"max_new_tokens": max_tokens, "do_sample": False, "details": True}
        body = {"inputs": prompt, "parameters": parameters | ({"adapter_id": model} if model else {})}
        async with self.client.stream("POST", "/generate_stream", json=body, headers=self.headers) as response:
            await _checked(response)
            async for event in _sse_events(response):
                token = event.get("token") or {}
                if not token.get("special"):
                    yield token.get("text", "")
                details = event.get("details")
                if details:
                    yield Counts(details.get("input_length"), details.get("generated_tokens"))

    async def engine_figures(self) -> dict[str, float] | None:
        return await _scrape_servegate(self.client, self.headers)

    async def close(self) -> None:
        await self.client.aclose()


class BackendTarget:
    """A `Backend` driven in process: no HTTP, the engine's own cost only."""

    server_pid = None  # no server: the engine shares this process

    def __init__(self, backend: Backend) -> None:
        self.name, self.backend = backend.name, backend

    async def prepare(self) -> None:
        await self.backend.start()

    async def generate(self, prompt: str, max_tokens: int, model: str | None = None) -> AsyncIterator[Piece]:
        request = GenerateRequest(request_id=f"bench-{uuid.uuid4().hex}", prompt=prompt, max_tokens=max_tokens,
                                  temperature=0.0, ignore_eos=True, adapter=model)
        async for event in self.backend.generate(request):
            if isinstance(event, Delta):
                yield event.text
            elif isinstance(event, Finish):
                yield Counts(event.usage.prompt_tokens, event.usage.completion_tokens, event.usage.cached_tokens)

    async def engine_figures(self) -> dict[str, float] | None:
        return (await self.backend.load()).details or None

    async def close(self) -> None:
        await self.backend.close()
