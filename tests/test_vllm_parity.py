"""Greedy, token for token, the built-in engine answers as vLLM's CPU build does, both in float32
on the default model: completions and chat, short prompts and prompts of 1,000+ tokens, sent
all at once (batched in both) and one at a time. Skips, saying why, where vLLM's environment
could not be provisioned (`python -m backends.peers vllm`); vLLM is the run's one server
(conftest's `vllm_url`)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from backends.base import Delta, Finish, GenerateRequest
from backends.builtin import BuiltinBackend, EngineConfig

pytestmark = pytest.mark.slow

MAX_TOKENS = 32
TOPICS = ["the sea", "gravity", "a city at night", "prime numbers", "bread"]
LONG = ("The history of the printing press begins with movable type in East Asia and continues in Europe, where "
        "Johannes Gutenberg combined a screw press, oil-based ink and metal type cast in a hand mould. ") * 40


def prompts(tokenizer) -> list[dict]:
    """Twenty requests: ten completions and ten chats, four of each with 1,000+ prompt tokens."""
    completions = [f"A short note about {topic}:" for topic in TOPICS] + [
        f"{LONG}\nQuestion {i}: in one sentence, what did Gutenberg combine?\nAnswer:" for i in range(5)]
    chats = [[{"role": "user", "content": f"Write two sentences about {topic}."}] for topic in TOPICS] + [
        [{"role": "system", "content": LONG}, {"role": "user", "content": f"Summarize that in {n} words."}]
        for n in (5, 10, 15, 20, 25)]
    requests = [{"prompt": p} for p in completions] + [{"messages": m} for m in chats]
    long = [r for r in requests if len(tokenizer.encode(r.get("prompt") or LONG)) >= 1000]
    assert len(requests) == 20 and len(long) >= 8
    return requests


async def vllm_answer(client: httpx.AsyncClient, request: dict) -> tuple[str, int]:
    route = "/v1/chat/completions" if "messages" in request else "/v1/completions"
    reply = await client.post(route, json={"model": "smollm2", "temperature": 0.0, "max_tokens": MAX_TOKENS,
                                           **request}, timeout=300)
    reply.raise_for_status()
    body = reply.json()
    choice = body["choices"][0]
    return (choice["message"]["content"] if "messages" in request else choice["text"]), \
        body["usage"]["completion_tokens"]


async def engine_answer(backend: BuiltinBackend, request: dict, number: int) -> tuple[str, int]:
    request = GenerateRequest(request_id=f"parity-{number}", temperature=0.0, max_tokens=MAX_TOKENS, **request)
    text, tokens = [], 0
    async for event in backend.generate(request):
        if isinstance(event, Delta):
            text.append(event.text)
        elif isinstance(event, Finish):
            tokens = event.usage.completion_tokens
    return "".join(text), tokens


def test_greedy_answers_equal_vllms_in_float32(vllm_url, default_model_dir):
    async def both() -> tuple[list, list, list, list]:
        backend = BuiltinBackend(EngineConfig(model=str(default_model_dir), dtype="float32", max_model_len=2048))
        await backend.start()
        try:
            requests = prompts(backend.tokenizer)
            async with httpx.AsyncClient(base_url=vllm_url) as client:
                theirs = await asyncio.gather(*(vllm_answer(client, r) for r in requests))  # batched
                ours = await asyncio.gather(*(engine_answer(backend, r, i) for i, r in enumerate(requests)))
                single = [0, 7, 12, 18]  # short and long, completion and chat, one at a time
                theirs_single = [await vllm_answer(client, requests[i]) for i in single]
                ours_single = [await engine_answer(backend, requests[i], 100 + i) for i in single]
            return theirs, ours, theirs_single, ours_single
        finally:
            await backend.close()

    theirs, ours, theirs_single, ours_single = asyncio.run(both())
    differing = [i for i, (a, b) in enumerate(zip(theirs, ours, strict=True)) if a != b]
    assert not differing, [(theirs[i], ours[i]) for i in differing[:3]]
    assert theirs_single == ours_single
    assert all(tokens > 0 for _, tokens in ours)
