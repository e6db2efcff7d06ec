"""No client makes the gateway log an error: a client that leaves before the first token is recorded
as cancelled, and an upstream event too long to read is the upstream's 502, neither with an error
logged by the gateway itself."""

from __future__ import annotations

import logging
import time

import httpx
import pytest

from .conftest import bearer, openai_upstream, usage_records
from .upstreams import answer, gateway_over, piece, tenant_with_key


@pytest.fixture
def errors_logged():
    """ERROR records from every logger, uvicorn's own included (it does not propagate)."""
    found: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = found.append
    loggers = [logging.getLogger(), logging.getLogger("uvicorn"), logging.getLogger("uvicorn.error")]
    for logger in loggers:
        logger.addHandler(handler)
    yield found
    for logger in loggers:
        logger.removeHandler(handler)


@pytest.mark.slow
@pytest.mark.parametrize("path, body", [
    ("/generate_stream", {"inputs": "hi", "parameters": {"max_new_tokens": 50}}),
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 50}}),
    ("/v1/completions", {"model": "remote", "prompt": "hi", "max_tokens": 50, "stream": True}),
])
def test_a_client_that_leaves_before_the_first_token_is_recorded_cancelled_without_an_error_log(
        tmp_path, errors_logged, path, body):
    with gateway_over({"remote": openai_upstream(lambda p: answer(first_after_s=1.5))}, tmp_path) as gw:
        tenant, key = tenant_with_key(gw)
        for _ in range(3):
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(gw.url + path, json=body, headers=bearer(key), timeout=0.3)
        cancelled = usage_records(gw.url, tenant, 3)
        assert [r["status"] for r in cancelled] == ["cancelled"] * 3
        assert all(r["completion_tokens"] == 0 for r in cancelled)
        time.sleep(1.5)  # the upstream's late answers arrive at nobody
        assert not errors_logged, [r.getMessage() for r in errors_logged]


@pytest.mark.slow
def test_an_upstream_event_too_long_to_read_is_a_502_not_a_gateway_error(tmp_path, errors_logged):
    """An event longer than the adapter reads as one line (llama-server sends megabytes a token
    when asked for a whole vocabulary's log-probabilities) ends the call as the upstream's
    failure, a 502 that says so; the gateway logs no error of its own."""
    huge = piece("x" * 600_000)
    with gateway_over({"remote": openai_upstream(lambda path: [huge])}, tmp_path) as gw:
        tenant, key = tenant_with_key(gw)
        answer = httpx.post(gw.url + "/v1/completions", json={"model": "remote", "prompt": "hi", "max_tokens": 5},
                            headers=bearer(key), timeout=30)
        assert usage_records(gw.url, tenant)[0]["status"] == "error"
    assert answer.status_code == 502 and "an event longer than" in answer.json()["error"]["message"]
    assert not errors_logged, [r.getMessage() for r in errors_logged]
