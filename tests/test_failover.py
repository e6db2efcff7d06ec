"""Failover and breakers through a live gateway: a target whose breaker opened, once it recovers,
gets traffic again, even ranked second behind a healthy one."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from .conftest import AUTH, openai_upstream
from .upstreams import admin, answer, gateway_over


@pytest.mark.slow
def test_a_recovered_target_ranked_second_gets_traffic_again(tmp_path):
    failing = threading.Event()
    failing.set()

    def flaky(scope_path):
        if failing.is_set():
            raise ConnectionResetError("down")
        return answer(count=2)

    apps = {"a": openai_upstream(lambda path: answer(count=2)), "b": openai_upstream(flaky)}
    with gateway_over(apps, tmp_path, breaker_failures=1, breaker_cooldown_s=0.5, route_seed=3) as gw:
        spec = {"targets": [{"backend": "a", "weight": 9}, {"backend": "b", "weight": 1}]}
        assert admin(gw, "POST", "/admin/routes/chat/deploy", json={"spec": spec}).status_code == 201

        def served_by() -> str:
            reply = httpx.post(gw.url + "/v1/completions", headers=AUTH, timeout=30,
                               json={"model": "chat", "prompt": "hi", "max_tokens": 5})
            assert reply.status_code == 200, reply.text
            return reply.headers["x-servegate-route"].split("backend=")[1].split(";")[0]

        while gw.gateway.fleet["b"].breaker.opened_at is None:
            served_by()  # b fails over to a until its breaker opens
        failing.clear()  # b recovers
        recovered_at = time.monotonic()
        served = [served_by() for _ in range(200)]
        assert served.count("b") >= 5, served.count("b")
        breaker = gw.gateway.fleet["b"].breaker
        assert breaker.opened_at is None and not breaker.probing
        assert time.monotonic() - recovered_at < 60
