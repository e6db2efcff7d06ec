"""Fair work between tenants: the admission queue serves the tenant with the fewest requests in
flight, the engine's scheduler takes tenants' waiting sequences in turn, and large request bodies
and upstream answers are decoded off the event loop. The slow tests flood the gateway from a
client process of their own (so the flood's client work takes no turns of the gateway's GIL) and
measure what another tenant sees meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from advisor.measure import stub
from backends.base import Overloaded
from backends.builtin import BuiltinBackend, EngineConfig
from backends.builtin.core.sequence import SamplingParams
from backends.openai_compat import OpenAICompatBackend, OpenAICompatConfig
from gateway.inference.admission import Admission

from . import conftest
from .conftest import AUTH, gateway_app, openai_upstream, running, serve_app, wait_ready
from .upstreams import answer, remote, tenant_with_key

# -- the admission queue ------------------------------------------------------------------------


async def test_a_tenant_with_many_queued_requests_delays_another_by_at_most_one_slot():
    admission = Admission(max_in_flight=1, max_queued=100, timeout_s=10)
    await admission.acquire("a")
    granted: list[str] = []

    async def wait(tenant: str) -> None:
        await admission.acquire(tenant)
        granted.append(tenant)

    waiting = [asyncio.create_task(wait("a")) for _ in range(20)]
    await asyncio.sleep(0)
    waiting.append(asyncio.create_task(wait("b")))
    await asyncio.sleep(0)
    assert admission.queued == 21
    for _ in range(2):  # each release frees the slot to one waiter
        admission.release(granted[-1] if granted else "a")
        await asyncio.sleep(0)
    assert "b" in granted[:2]  # FIFO would have served b after a's twenty
    while len(granted) < 21:
        admission.release(granted[-1])
        await asyncio.sleep(0)
    await asyncio.gather(*waiting)
    admission.release(granted[-1])
    assert admission.in_flight == admission.queued == 0


async def test_a_freed_slot_goes_to_the_tenant_with_fewest_in_flight():
    admission = Admission(max_in_flight=3, max_queued=100, timeout_s=10)
    for _ in range(3):
        await admission.acquire("a")
    order: list[str] = []

    async def wait(tenant: str) -> None:
        await admission.acquire(tenant)
        order.append(tenant)

    waiting = [asyncio.create_task(wait(t)) for t in ("a", "a", "a", "a", "b", "c")]
    await asyncio.sleep(0)
    for _ in range(3):
        admission.release("a")
        await asyncio.sleep(0)
    assert order == ["b", "c", "a"]  # none in flight first, then a again (FIFO: a, a, a)
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert admission.in_flight == 3 and admission.queued == 0


async def test_a_waiter_that_times_out_or_leaves_gives_no_slot_away():
    admission = Admission(max_in_flight=1, max_queued=10, timeout_s=0.05)
    await admission.acquire("a")
    with pytest.raises(Overloaded, match="no capacity freed"):
        await admission.acquire("b")
    leaving = asyncio.create_task(admission.acquire("b"))
    staying = asyncio.create_task(admission.acquire("c"))
    await asyncio.sleep(0)
    admission.release("a")  # granted to b, who leaves before it runs: the slot passes on to c
    leaving.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await leaving
    await staying
    assert admission.in_flight == 1 and admission.queued == 0
    admission.release("c")
    assert admission.in_flight == 0


# -- the engine's scheduler ---------------------------------------------------------------------


def test_a_flood_of_embedding_prompts_does_not_hold_back_another_tenants_chat(make_engine, tiny_model):
    """Tenant a queues 400 embedding prompts (a step runs 64 sequences at most); tenant b's chat,
    arriving after a's first step, takes its first token from the next step, where a queue in
    arrival order would have run a's 336 waiting prompts first. Its tokens are those it gets alone,
    and every one of a's prompts is embedded."""
    engine = make_engine(tiny_model, dtype="float64")
    documents = [[(13 * i + k) % 40000 + 100 for k in range(12)] for i in range(400)]
    for i, prompt in enumerate(documents):
        engine.add_request(f"embed-{i}", prompt, SamplingParams(), embed=True, tenant="a")
    vectors = {out.request_id for out in engine.step()}
    assert len(vectors) == engine.config.max_num_seqs

    chat = [(7 * k) % 40000 + 300 for k in range(40)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request("chat", chat, params, tenant="b")
    tokens, steps_to_first = [], None
    for step in range(1, 100):
        if not engine.has_work:
            break
        for out in engine.step():
            if out.embedding is not None:
                vectors.add(out.request_id)
            elif out.request_id == "chat":
                tokens.extend(out.token_ids)
                steps_to_first = steps_to_first or step
    assert steps_to_first == 1
    assert len(vectors) == len(documents)
    assert tokens == make_engine(tiny_model, dtype="float64").generate([chat], params)[0][0]


# -- through the public API -----------------------------------------------------------------------

FLOOD = """
import asyncio, collections, json, sys, time
import httpx

url, key, body_file, workers, seconds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
body = open(body_file, "rb").read()
headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}

async def main():
    stop, codes = time.monotonic() + seconds, collections.Counter()
    async def worker():
        async with httpx.AsyncClient(timeout=120) as client:
            for _ in range(10_000):
                if time.monotonic() > stop:
                    break
                codes[(await client.post(url, content=body, headers=headers)).status_code] += 1
    await asyncio.gather(*(worker() for _ in range(workers)))
    print(json.dumps(codes))

asyncio.run(main())
"""


@contextlib.contextmanager
def flood(url: str, key: str, body: dict, tmp_path: Path, workers: int, seconds: float):
    """`workers` clients posting `body` to `url` as `key`'s, back to back for `seconds`, from a
    process of their own; yields a dict that holds, once the block ends, the count of each status."""
    body_file = tmp_path / "flood.json"
    body_file.write_bytes(json.dumps(body).encode())
    process = subprocess.Popen([sys.executable, "-c", FLOOD, url, key, str(body_file), str(workers), str(seconds)],
                               stdout=subprocess.PIPE, text=True)
    codes: dict[str, int] = {}
    try:
        yield codes
        out, _ = process.communicate(timeout=seconds + 120)
    finally:
        process.kill()
    assert process.returncode == 0
    codes.update(json.loads(out))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def report(title: str, unloaded: list[float], loaded: list[float]) -> str:
    line = (f"{title}: unloaded p50 {statistics.median(unloaded) * 1000:.0f} ms, p99 "
            f"{percentile(unloaded, 0.99) * 1000:.0f} ms; loaded p50 {statistics.median(loaded) * 1000:.0f} ms, p99 "
            f"{percentile(loaded, 0.99) * 1000:.0f} ms ({len(loaded)} requests, p99 ratio "
            f"{percentile(loaded, 0.99) / percentile(unloaded, 0.99):.1f})")
    conftest.REPORTS.setdefault("fairness between tenants", []).append(line)
    return line


def measured_while(seconds: float, measure) -> list[float]:
    """`measure()` again and again for `seconds` (at most 500 times)."""
    stop, samples = time.monotonic() + seconds, []
    while time.monotonic() < stop and len(samples) < 500:
        samples.append(measure())
    return samples


@pytest.mark.slow
def test_a_tenants_embedding_flood_leaves_another_tenants_chat_its_first_tokens(tiny_model_dir, tmp_path):
    """On the built-in engine (in its own process, as served): tenant a posts 256 inputs a request
    from 8 clients at once (up to 2,048 sequences in the engine), tenant b streams chats. Every
    request of both succeeds, and b's median time to first token under the flood stays within 4
    times its unloaded p99 (at least 250 ms): about 0.04 s here with tenants taking turns, 0.7 s with
    the engine's queue in arrival order, where it grows with a's backlog. The p99 ratio is reported,
    not asserted at 1.5: on two shared cores the gateway's event loop, its tokenizer threads and
    the engine's steps serve a's flood too, and the gateway's full garbage collections (0.15-0.4 s)
    land in b's tail."""
    backend = BuiltinBackend(EngineConfig(model=str(tiny_model_dir), dtype="float64", served_name="tiny",
                                          kv_cache_tokens=8192), "tiny")
    app = gateway_app({"tiny": backend}, tmp_path)
    with serve_app(app) as url:
        wait_ready(url)
        gw = SimpleNamespace(url=url)
        _, a = tenant_with_key(gw)
        _, b = tenant_with_key(gw)

        def first_token(client: httpx.Client) -> float:
            started = time.perf_counter()
            body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me about the sea."}],
                    "max_tokens": 8, "stream": True, "temperature": 0}
            with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=conftest.bearer(b)) as answer:
                assert answer.status_code == 200, answer.read()
                lines = answer.iter_lines()
                assert next(line for line in lines if line.startswith("data: {"))  # the first token's event
                took = time.perf_counter() - started
                assert "data: [DONE]" in list(lines)
            return took

        documents = [f"document {k} about the weather and the sea" for k in range(256)]
        with httpx.Client(timeout=120) as client:
            first_token(client)  # warm
            unloaded = [first_token(client) for _ in range(40)]
            with flood(f"{url}/v1/embeddings", a, {"model": "tiny", "input": documents}, tmp_path,
                       workers=8, seconds=9) as embedded:
                time.sleep(1.5)  # the flood under way
                loaded = measured_while(6, lambda: first_token(client))
    print(report("built-in engine, b's time to first token under a's embeddings", unloaded, loaded))
    assert set(embedded) == {"200"} and embedded["200"] >= 8
    assert statistics.median(loaded) < max(4 * percentile(unloaded, 0.99), 0.25)


@pytest.mark.slow
def test_large_upstream_embedding_answers_leave_another_tenants_chat_fast(tmp_path):
    """A remote upstream answers each embeddings request with 7 MB of JSON; tenant a asks for them
    from 2 clients at once while tenant b chats. The answers are decoded on a thread a vector at a
    time and the gateway's own answer encoded on one: b's median latency stays under 4 times its
    unloaded p99 (at least 0.3 s): about 0.15 s here, 0.46 s with both on the event loop."""
    rng = random.Random(0)
    vector = [round(rng.uniform(-1, 1), 9) for _ in range(8192)]
    inputs = 64
    big = json.dumps({"object": "list", "data": [{"object": "embedding", "index": i, "embedding": vector}
                                                  for i in range(inputs)],
                      "usage": {"prompt_tokens": inputs, "total_tokens": inputs}}).encode()
    assert len(big) > 6_000_000

    def pieces(path: str):
        return [big] if path.endswith("/embeddings") else answer(count=2)

    with contextlib.ExitStack() as stack:
        upstream = stack.enter_context(serve_app(openai_upstream(pieces)))
        backend = OpenAICompatBackend(OpenAICompatConfig(base_url=upstream, model=stub.MODEL, max_context=4096,
                                                         embeddings=True), name="remote")
        url = stack.enter_context(serve_app(gateway_app({"remote": backend}, tmp_path)))
        wait_ready(url)
        gw = SimpleNamespace(url=url)
        _, a = tenant_with_key(gw)
        _, b = tenant_with_key(gw)

        def chat(client: httpx.Client) -> float:
            started = time.perf_counter()
            answered = client.post(f"{url}/v1/chat/completions", headers=conftest.bearer(b), json={
                "model": "remote", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert answered.status_code == 200, answered.text
            return time.perf_counter() - started

        with httpx.Client(timeout=120) as client:
            unloaded = [chat(client) for _ in range(30)]
            with flood(f"{url}/v1/embeddings", a, {"model": "remote", "input": ["x"] * inputs}, tmp_path,
                       workers=2, seconds=8) as embedded:
                time.sleep(1)
                loaded = measured_while(6, lambda: chat(client))
    print(report("remote upstream, b's chat latency under a's 7 MB embedding answers", unloaded, loaded))
    assert set(embedded) == {"200"} and embedded["200"] >= 4
    assert statistics.median(loaded) < max(4 * percentile(unloaded, 0.99), 0.3)


@pytest.mark.slow
def test_health_answers_within_100_ms_while_a_tenant_posts_bodies_of_240k_items(tmp_path):
    """Bodies of 7.5 MiB holding 240,000 short inputs each, posted by 3 clients at once: each is
    decoded and validated in full on the large bodies' thread (then refused, over 2,048 inputs)
    while /health keeps answering, its p99 under 100 ms (about 70 ms here, 190 ms with validation
    on the event loop)."""
    items = [f"item {i:07d} abcdefghijklmnop" for i in range(240_000)]
    body = {"model": "remote", "input": items}
    with contextlib.ExitStack() as stack:
        upstream = stack.enter_context(serve_app(openai_upstream(lambda path: answer(count=2))))
        url = stack.enter_context(serve_app(gateway_app({"remote": remote(upstream)}, tmp_path)))
        wait_ready(url)
        _, key = tenant_with_key(SimpleNamespace(url=url))
        refused = httpx.post(f"{url}/v1/embeddings", json=body, headers=conftest.bearer(key), timeout=60)
        assert refused.status_code == 400 and "more than 2048" in refused.json()["error"]["message"]

        def health(client: httpx.Client) -> float:
            started = time.perf_counter()
            assert client.get(f"{url}/health").status_code == 200
            took = time.perf_counter() - started
            time.sleep(0.01)
            return took

        with httpx.Client(timeout=30) as client, \
                flood(f"{url}/v1/embeddings", key, body, tmp_path, workers=3, seconds=8) as posted:
            time.sleep(0.5)
            latencies = measured_while(7, lambda: health(client))
    line = (f"/health under 7.5 MiB bodies of 240k items: p50 {statistics.median(latencies) * 1000:.0f} ms, p99 "
            f"{percentile(latencies, 0.99) * 1000:.0f} ms over {len(latencies)} probes, {posted} bodies")
    conftest.REPORTS.setdefault("fairness between tenants", []).append(line)
    print(line)
    assert set(posted) == {"400"} and posted["400"] >= 4
    assert len(latencies) >= 100 and percentile(latencies, 0.99) < 0.1


# -- large bodies: the same answers as small ones ---------------------------------------------------


async def test_a_large_body_is_refused_as_a_small_one_is(tmp_path):
    """Above the gate's size a body is decoded and validated on a thread: its refusals are the ones
    FastAPI gives a small body, and a valid one reaches its endpoint."""
    async with running({"remote": remote("http://127.0.0.1:9")}, tmp_path, gate_body_bytes=1024) as client:
        headers = AUTH | {"Content-Type": "application/json"}
        padding = " " * 2048  # over the gate's size, the same JSON
        for body in ('{"model": "remote", "input": [1, "two"]', '{"model": "remote", "input": [{"a": 1}]}',
                     '{"model": "remote", "input": "hi", "unknown": 1}'):
            small = await client.post("/v1/embeddings", content=body, headers=headers)
            large = await client.post("/v1/embeddings", content=body + padding, headers=headers)
            assert small.status_code == large.status_code == 400
            assert small.json() == large.json()
        many = {"model": "remote", "input": ["x"] * 3000}
        reached = await client.post("/v1/embeddings", json=many, headers=AUTH)
        assert reached.status_code == 400 and "more than 2048" in reached.json()["error"]["message"]
