"""The request core's input limits through a live gateway: a huge max_tokens is refused while Redis
stays authoritative, and a body over the limit is a 413 in each API's shape."""

from __future__ import annotations

import logging

import httpx
import pytest

from .conftest import AUTH, REDIS_URL, bearer, needs_redis, openai_upstream
from .upstreams import answer, gateway_over, tenant_with_key


@pytest.mark.slow
@needs_redis
def test_a_huge_max_tokens_is_refused_and_redis_stays_authoritative(tmp_path, caplog):
    with gateway_over({"remote": openai_upstream(lambda path: answer(count=2))}, tmp_path,
                      redis_url=REDIS_URL) as gw:
        tenant, key = tenant_with_key(gw, max_concurrency=2)
        with caplog.at_level(logging.WARNING):
            huge = httpx.post(gw.url + "/v1/completions", headers=bearer(key),
                              json={"model": "remote", "prompt": "hi", "max_tokens": 10**30})
            ok = httpx.post(gw.url + "/v1/completions", headers=bearer(key),
                            json={"model": "remote", "prompt": "hi", "max_tokens": 5})
        assert huge.status_code == 400 and huge.json()["error"]["param"] == "max_tokens"
        assert ok.status_code == 200
        assert not [r for r in caplog.records if "redis" in r.getMessage().lower()]


@pytest.mark.slow
def test_a_body_over_the_limit_is_a_413_in_each_apis_shape(tmp_path):
    with gateway_over({"remote": openai_upstream(lambda path: answer(count=2))}, tmp_path) as gw:
        big = b'{"model": "remote", "prompt": "' + b"a" * (50 * 1024 * 1024) + b'"}'
        openai_style = httpx.post(gw.url + "/v1/completions", content=big, headers=AUTH, timeout=60)
        assert openai_style.status_code == 413 and "larger than" in openai_style.json()["error"]["message"]
        tgi_style = httpx.post(gw.url + "/generate", content=big, headers=AUTH, timeout=60)
        assert tgi_style.status_code == 413 and set(tgi_style.json()) == {"error", "error_type"}

        def chunked():  # no Content-Length: counted as it arrives
            for _ in range(10):
                yield b"a" * (1024 * 1024)

        streamed = httpx.post(gw.url + "/v1/completions", content=chunked(), headers=AUTH, timeout=60)
        assert streamed.status_code == 413
        small = httpx.post(gw.url + "/v1/completions", headers=AUTH,
                           json={"model": "remote", "prompt": "hi", "max_tokens": 5})
        assert small.status_code == 200
