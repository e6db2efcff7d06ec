"""Versioned routes, target selection, fallback, canary and rollback: the router on its own, then
through the gateway's HTTP API and `servegate routes` against live OpenAI-compatible upstreams."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections import Counter

import httpx
import pytest
from typer.testing import CliRunner

from advisor.measure import stub
from backends.base import Capabilities, InvalidRequest, Load
from backends.openai_compat import OpenAICompatBackend, OpenAICompatConfig
from gateway.inference.admission import Admission
from gateway.inference.fleet import Breaker, Fleet
from gateway.inference.routing import PrefixIndex, RequestFacts, Router
from gateway.rollout.route_versions import PrefixAware, RouteOut, RouteSpec, RouteState, Target

from .conftest import AUTH, free_port, gateway_app, openai_upstream, serve_app


def backend(name: str, url: str = "http://127.0.0.1:9") -> OpenAICompatBackend:
    return OpenAICompatBackend(OpenAICompatConfig(base_url=url, model=stub.MODEL, max_context=4096), name=name)


def version(number: int, status: str = "active", share: float | None = None, **spec) -> RouteOut:
    return RouteOut(alias="chat", version=number, status=status, share=share, spec=RouteSpec(**spec),
                    created_at="2026-01-01T00:00:00Z")


def router_with(*names: str, seed: int = 7, **spec) -> Router:
    router = Router(Fleet({n: backend(n) for n in names}), seed=seed)
    router.set_routes({"chat": RouteState(alias="chat", active=version(1, **spec), canary=None)})
    return router


def picks(router: Router, count: int = 400, prompt: str = "") -> list[str]:
    return [router.resolve("chat", ["chat"], RequestFacts(prompt=prompt)).candidates[0].name for _ in range(count)]


# -- the router -------------------------------------------------------------------------------
def test_weighted_choice_follows_weights_and_is_reproducible_under_a_seed():
    spec = {"targets": [Target(backend="a", weight=3), Target(backend="b", weight=1)], "fallbacks": ["c"]}
    first = picks(router_with("a", "b", "c", **spec))
    assert first == picks(router_with("a", "b", "c", **spec))  # same seed, same choices
    assert first != picks(router_with("a", "b", "c", seed=8, **spec))
    share = Counter(first)["a"] / len(first)
    assert 0.68 < share < 0.82 and "c" not in first  # 3:1, and the fallback only as a fallback
    order = [b.name for b in router_with("a", "b", "c", **spec).resolve("chat", ["chat"]).candidates]
    assert order[-1] == "c" and sorted(order[:2]) == ["a", "b"]


def test_the_canary_gets_its_share():
    router = Router(Fleet({n: backend(n) for n in ("old", "new")}), seed=1)
    router.set_routes({"chat": RouteState(
        alias="chat", active=version(1, targets=[Target(backend="old")]),
        canary=version(2, status="canary", share=0.2, targets=[Target(backend="new")]))})
    decisions = [router.resolve("chat", ["chat"]) for _ in range(1000)]
    canary = [d for d in decisions if d.variant == "canary"]
    assert 0.16 < len(canary) / 1000 < 0.24
    assert {d.candidates[0].name for d in canary} == {"new"} and {d.version for d in canary} == {2}


def test_a_failing_target_is_skipped_while_its_breaker_is_open_then_probed():
    router = router_with("a", "b", targets=[Target(backend="a", weight=100), Target(backend="b", weight=1)])
    breaker = router.fleet["a"].breaker = Breaker(threshold=3, cooldown_s=0.2)
    for _ in range(3):
        breaker.record(False, time.monotonic())
    decision = router.resolve("chat", ["chat"])
    assert [b.name for b in decision.candidates] == ["b"] and "skipped a (down or circuit open)" in decision.reason
    time.sleep(0.25)
    names = lambda: [b.name for b in router.resolve("chat", ["chat"]).candidates]  # noqa: E731
    assert all("a" in names() for _ in range(5))  # half-open: routing reads it without taking the probe
    breaker.begin(time.monotonic())  # a request starts on it: the one probe is out
    assert names() == ["b"]  # while that probe is out, the others wait
    breaker.release()  # the probe never finished (its client left): the next request may probe
    assert "a" in names()
    breaker.begin(time.monotonic())
    breaker.record(True, time.monotonic())
    assert breaker.opened_at is None and breaker.failures == 0 and names()[0] == "a"


def test_a_target_whose_health_check_fails_is_skipped_until_it_recovers():
    router = router_with("a", "b", targets=[Target(backend="a", weight=100), Target(backend="b", weight=1)])
    router.fleet["a"].down = True
    assert set(picks(router, 20)) == {"b"}
    router.fleet["a"].down = False
    assert "a" in set(picks(router, 20))


def test_least_loaded_picks_the_shortest_queue():
    router = router_with("a", "b", targets=[Target(backend="a"), Target(backend="b")], balance="least-loaded")
    a, b = router.fleet["a"], router.fleet["b"]
    a.load, b.load = Load(running=4, waiting=6), Load(running=2, waiting=0)
    assert set(picks(router, 20)) == {"b"}
    b.admission = Admission(max_in_flight=1, max_queued=100, timeout_s=1)
    b.admission.queued = 50  # this replica's own queue counts too
    assert set(picks(router, 20)) == {"a"}
    b.admission.queued = 0
    a.load, b.load = Load(running=1, kv_usage=0.9), Load(running=1, kv_usage=0.2)
    assert set(picks(router, 20)) == {"b"}  # equal queues: the emptier KV cache


def test_prefix_aware_keeps_a_shared_prefix_together_unless_its_owner_is_overloaded():
    spec = {"targets": [Target(backend="a"), Target(backend="b")],
            "prefix_aware": PrefixAware(block_chars=16, blocks=4, max_extra_waiting=2)}
    router = router_with("a", "b", **spec)
    shared = "You are a careful assistant. " * 4
    owners = {p: picks(router, 1, shared + p)[0] for p in ("q1", "q2", "q3", "q4")}
    assert len(set(owners.values())) == 1  # every question on the shared system prompt, one replica
    first = next(iter(owners.values()))
    decision = router.resolve("chat", ["chat"], RequestFacts(prompt=shared + "q5"))
    assert decision.reason.startswith("prefix (4 blocks cached)")
    others = {picks(router, 1, f"{i:02d} unrelated prompt number {i}")[0] for i in range(30)}
    assert others == {"a", "b"}  # new prefixes spread by weight
    router.fleet[first].load = Load(running=5, waiting=0)
    moved = router.resolve("chat", ["chat"], RequestFacts(prompt=shared + "q6"))
    assert "overloaded" in moved.reason and moved.candidates[0].name != first


def test_routing_rules_exclude_and_rank_targets_and_say_why():
    spec = {"targets": [Target(backend="small", pool="latency"), Target(backend="big", pool="throughput")],
            "fallbacks": ["small"], "rules": "routing"}
    router = router_with("small", "big", **spec)
    router.fleet["small"].capabilities = Capabilities(runtime="vllm", version="", model="m", max_context=4096,
                                                     prefix_caching=True)
    router.fleet["big"].capabilities = Capabilities(runtime="sglang", version="", model="m", max_context=32768,
                                                   prefix_caching=True)

    def route(**facts) -> tuple[list[str], str]:
        decision = router.resolve("chat", ["chat"], RequestFacts(**facts))
        return [b.name for b in decision.candidates], decision.reason

    names, reason = route(tier="batch", prompt="hi", max_tokens=100)
    assert names[0] == "big" and "batch-tier-to-throughput-pool" in reason
    names, reason = route(tier="standard", prompt="hi", max_tokens=100)
    assert names[0] == "small" and "interactive-off-throughput-pool" in reason
    names, reason = route(tier="standard", prompt="x" * 20_000, max_tokens=500)  # ~5,000 tokens: small cannot
    assert names == ["big"] and "excluded 1" in reason  # the fallback too: it would not fit either
    with pytest.raises(InvalidRequest, match="no target of route 'chat'.*context-must-fit: big: ~50000 prompt"):
        route(prompt="x" * 200_000, max_tokens=10)


def test_a_long_shared_prefix_goes_to_the_target_with_prefix_caching():
    spec = {"targets": [Target(backend="cold"), Target(backend="warm")], "rules": "routing",
            "prefix_aware": PrefixAware(block_chars=64, blocks=4)}
    router = router_with("cold", "warm", **spec)
    router.fleet["cold"].capabilities = Capabilities(runtime="tgi", version="", model="m", max_context=32768,
                                                    prefix_caching=False)
    router.fleet["warm"].capabilities = Capabilities(runtime="vllm", version="", model="m", max_context=32768,
                                                    prefix_caching=True)
    system = "You answer questions about the attached contract. " * 50  # ~2,500 characters
    router.prefixes.remember(PrefixIndex.chain(system, spec["prefix_aware"]), "cold")  # seen before
    decision = router.resolve("chat", ["chat"], RequestFacts(prompt=system + "Who signs?", max_tokens=64))
    assert decision.candidates[0].name == "warm" and "long-shared-prefix-to-prefix-cache" in decision.reason
    fresh = router.resolve("chat", ["chat"], RequestFacts(prompt="A new question " * 200, max_tokens=64))
    assert "long-shared-prefix-to-prefix-cache" not in fresh.reason  # nothing shared yet


def test_a_route_naming_missing_or_broken_rules_is_refused():
    with pytest.raises(ValueError, match="no rules file 'nope' in policies/rules"):
        RouteSpec(targets=[Target(backend="a")], rules="nope")


# -- through the gateway ------------------------------------------------------------------------
def upstream(label: str, chunks: int = 3, delay: float = 0.0, status: int = 200, fail_after: int | None = None):
    """An OpenAI-compatible upstream whose text names it: `label0 label1 ...`, each piece after
    `delay` s; or answering `status`; or failing with an error event after `fail_after` pieces."""

    async def pieces(path: str):
        for i in range(chunks):
            if fail_after is not None and i == fail_after:
                yield b'data: {"error": {"message": "the engine died", "code": 500}}\n\n'
                return
            await asyncio.sleep(delay)
            chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": stub.MODEL,
                     "choices": [{"index": 0, "delta": {"content": f"{label}{i} "}, "finish_reason": None}]}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield stub.STREAM[-3]  # the finish chunk
        yield b"data: [DONE]\n\n"

    return openai_upstream(pieces, status)


@pytest.fixture
def gateway(tmp_path):
    """A gateway (refresh every 0.2 s) over upstreams: `a`, `b` (slow, 20 chunks), `dead` (nothing
    listens), `broken` (500s), `dies` (fails after its first chunk) and `mirror` (answers as `a`)."""
    apps = {"a": upstream("a"), "b": upstream("b", chunks=20, delay=0.05), "broken": upstream("x", status=500),
            "dies": upstream("d", fail_after=1), "mirror": upstream("a")}
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(serve_app(app)) for name, app in apps.items()}
        urls["dead"] = f"http://127.0.0.1:{free_port()}"
        backends = {name: backend(name, url) for name, url in urls.items()}
        app = gateway_app(backends, tmp_path, refresh_s=0.2, route_seed=3)
        with serve_app(app) as url:
            yield url, tmp_path


def chat(url: str, model: str = "chat", temperature: float = 1.0) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=30,
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30,
                            "temperature": temperature})


def admin(url: str, method: str, path: str, **kwargs) -> httpx.Response:
    return httpx.request(method, f"{url}/admin{path}", headers=AUTH, timeout=30, **kwargs)


@pytest.mark.slow
def test_routes_through_the_admin_api_fall_back_before_the_first_token_and_name_the_decision(gateway):
    url, _ = gateway
    bad = admin(url, "POST", "/routes/chat/deploy", json={"spec": {"targets": [{"backend": "nope"}]}})
    assert bad.status_code == 404 and "nope" in bad.json()["error"]["message"]
    spec = {"targets": [{"backend": "dead", "weight": 5}, {"backend": "broken"}], "fallbacks": ["a"]}
    assert admin(url, "POST", "/routes/chat/deploy", json={"spec": spec}).status_code == 201
    answer = chat(url)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"].startswith("a0 a1")
    route = answer.headers["x-servegate-route"]
    assert "alias=chat; version=1; variant=active; backend=a" in route
    deadline = time.monotonic() + 5  # the health poll finds `dead` down: it is skipped, not tried
    while "skipped dead" not in chat(url).headers["x-servegate-route"]:
        assert time.monotonic() < deadline, "the health check did not mark the dead target down"
        time.sleep(0.2)
    assert "chat" in [m["id"] for m in httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"]]

    # a new version, as a canary, promoted, then rolled back: every step in the history
    assert admin(url, "POST", "/routes/chat/deploy",
                 json={"spec": {"targets": [{"backend": "a"}]}, "canary_share": 0.5}).json()["status"] == "canary"
    variants = Counter(chat(url).headers["x-servegate-route"].split("; ")[2] for _ in range(20))
    assert variants["variant=canary"] > 0 and variants["variant=active"] > 0
    assert admin(url, "POST", "/routes/chat/promote").json()["version"] == 2
    assert admin(url, "POST", "/routes/chat/rollback", params={"reason": "latency"}).json()["version"] == 1
    history = admin(url, "GET", "/routes/chat").json()
    assert [v["status"] for v in history["versions"]] == ["retired", "active"]
    actions = [c["action"] for c in history["changes"]]
    for action in ("route.deploy", "route.deploy.canary", "route.promote", "route.rollback",
                   "route.rollback.reason"):
        assert action in actions


@pytest.mark.slow
def test_a_failure_after_the_first_token_is_an_error_event_not_a_fallback(gateway):
    url, _ = gateway
    admin(url, "POST", "/routes/chat/deploy", json={"spec": {"targets": [{"backend": "dies"}], "fallbacks": ["a"]}})
    with httpx.stream("POST", f"{url}/v1/chat/completions", headers=AUTH, timeout=30,
                      json={"model": "chat", "messages": [{"role": "user", "content": "hi"}], "stream": True}) as r:
        body = r.read().decode()
    assert '"content":"d0 "' in body and '"content":"a0 ' not in body  # no silent switch once text was sent
    assert '"error"' in body and "the engine died" in body and body.rstrip().endswith("data: [DONE]")
    assert '"finish_reason":"stop"' not in body.replace(" ", "")


@pytest.mark.slow
def test_cli_rollback_reaches_the_gateway_within_the_refresh_and_spares_requests_in_flight(gateway, monkeypatch):
    from gateway.cli import app

    url, home = gateway
    monkeypatch.setenv("SERVEGATE_DATABASE_URL", f"sqlite:///{home}/servegate.db")
    runner = CliRunner()
    route_a, route_b = home / "a.yaml", home / "b.yaml"
    route_a.write_text("targets: [{backend: a}]\n")
    route_b.write_text("targets: [{backend: b}]\n")
    assert "version 1 is active" in runner.invoke(app, ["routes", "deploy", "chat", "-f", str(route_a)]).output
    assert "version 2 is active" in runner.invoke(app, ["routes", "deploy", "chat", "-f", str(route_b)]).output
    bad = runner.invoke(app, ["routes", "deploy", "chat", "-f", str(route_a), "--canary", "150%"])
    assert bad.exit_code == 2 and "strictly between" in bad.output
    time.sleep(0.5)  # the gateway's refresh picks version 2 up

    streamed: list[str] = []

    def long_request() -> None:
        with httpx.stream("POST", f"{url}/v1/chat/completions", headers=AUTH, timeout=30,
                          json={"model": "chat", "messages": [{"role": "user", "content": "hi"}],
                                "stream": True}) as r:
            streamed.append(r.headers.get("x-servegate-route", ""))
            streamed.append(r.read().decode())

    worker = threading.Thread(target=long_request)
    worker.start()
    time.sleep(0.3)  # the request is streaming from b (20 chunks, 1 s)
    result = runner.invoke(app, ["routes", "rollback", "chat", "--reason", "regression"])
    assert result.exit_code == 0 and "version 1 is active" in result.output
    deadline = time.monotonic() + 2
    while "backend=a" not in chat(url).headers["x-servegate-route"]:
        assert time.monotonic() < deadline, "the rollback did not reach the gateway within the refresh"
        time.sleep(0.05)
    worker.join()
    assert "version=2" in streamed[0] and "b19" in streamed[1] and streamed[1].rstrip().endswith("[DONE]")
    history = runner.invoke(app, ["routes", "history", "chat", "--json"])
    data = json.loads(history.output)
    assert [v["version"] for v in data["versions"] if v["status"] == "active"] == [1]
    assert {"route.rollback", "route.rollback.reason"} <= {c["action"] for c in data["changes"]}
    missing = runner.invoke(app, ["routes", "promote", "chat"])
    assert missing.exit_code == 2 and "no canary to promote" in missing.output
    canary = runner.invoke(app, ["routes", "deploy", "chat", "-f", str(route_b), "--canary", "30%"])
    assert canary.exit_code == 0 and "version 3 is canary with 30% of traffic" in canary.output
    assert "version 3 is active" in runner.invoke(app, ["routes", "promote", "chat"]).output
    table = runner.invoke(app, ["routes", "history", "chat"]).output
    assert "route.promote" in table and "b:1" in table


@pytest.mark.slow
def test_shadow_traffic_is_mirrored_compared_and_never_returned(gateway, monkeypatch):
    from gateway.cli import app

    url, home = gateway
    admin(url, "POST", "/routes/chat/deploy", json={"spec": {"targets": [{"backend": "a"}],
                                                             "shadow": {"backend": "mirror", "share": 1.0}}})
    for temperature in (0.0, 0.0, 0.0, 0.0, 1.0, 1.0):
        answer = chat(url, temperature=temperature)
        assert "backend=a" in answer.headers["x-servegate-route"]
    admin(url, "POST", "/routes/chat/deploy", json={"spec": {"targets": [{"backend": "a"}],
                                                             "shadow": {"backend": "broken"}}})
    for _ in range(3):  # the candidate fails; the clients never notice
        assert chat(url).json()["choices"][0]["message"]["content"].startswith("a0")
    deadline = time.monotonic() + 10
    while sum(r["requests"] for r in admin(url, "GET", "/routes/chat/shadow").json()) < 9:
        assert time.monotonic() < deadline, "shadow results were not recorded"
        time.sleep(0.1)
    report = {r["version"]: r for r in admin(url, "GET", "/routes/chat/shadow").json()}
    same = report[1]
    assert (same["shadow_backend"], same["requests"], same["errors"]) == ("mirror", 6, 0)
    assert (same["greedy_requests"], same["exact_match_rate"]) == (4, 1.0)
    assert (same["sampled_requests"], same["mean_similarity"]) == (2, 1.0)
    assert same["shadow_ttft_p50_ms"] > 0 and same["primary_backends"] == ["a"]
    failing = report[2]
    assert (failing["shadow_backend"], failing["requests"], failing["error_rate"]) == ("broken", 3, 1.0)
    monkeypatch.setenv("SERVEGATE_DATABASE_URL", f"sqlite:///{home}/servegate.db")
    cli = json.loads(CliRunner().invoke(app, ["routes", "shadow-report", "chat", "--json"]).output)
    assert [r["requests"] for r in cli] == [6, 3]


@pytest.mark.slow
def test_routing_rules_reason_reaches_the_response_header(gateway):
    url, _ = gateway
    spec = {"targets": [{"backend": "a", "pool": "latency"}, {"backend": "mirror", "pool": "throughput"}],
            "rules": "routing"}
    assert admin(url, "POST", "/routes/chat/deploy", json={"spec": spec}).status_code == 201
    assert admin(url, "POST", "/tenants", json={"name": "nightly", "tier": "batch"}).status_code == 201
    key = admin(url, "POST", "/keys", json={"tenant": "nightly"}).json()["key"]
    batch = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=30,
                       json={"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
    route = batch.headers["x-servegate-route"]
    assert "backend=mirror" in route and "rules: batch-tier-to-throughput-pool" in route
    interactive = chat(url).headers["x-servegate-route"]
    assert "backend=a" in interactive and "interactive-off-throughput-pool" in interactive


def test_two_backends_under_one_name_are_refused():
    """Routes, breakers and admission queues go by backend name: two backends sharing one would
    silently share them."""
    with pytest.raises(ValueError, match=r"distinct names: \['same'\]"):
        Fleet({"model-a": backend("same"), "model-b": backend("same")})
    shared = backend("one")
    assert set(Fleet({"alias-a": shared, "alias-b": shared}).members) == {"one"}  # one backend, two names
