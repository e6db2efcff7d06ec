"""Billing from what was received, against live upstreams, as an attacker would try it: nobody gets
tokens unbilled. A client that hangs up, an upstream that lies about its usage, reports impossible
figures or dies mid-stream, a vLLM chat left early: each is billed at least what was sent, and a
recounted stream never below one token per piece; a request refused before any answer is billed
nothing."""

from __future__ import annotations

import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from backends.openai_compat import OpenAICompatConfig
from backends.vllm import VLLMBackend

from .conftest import bearer, gateway_app, openai_upstream, serve_app, usage_records, wait_ready
from .upstreams import PIECES, answer, gateway_over, piece, tenant_with_key


def tokens_today(gw, tenant: str) -> int:
    """What the tenant's daily token window holds (the quota store's own count)."""
    day = int(time.time() // 86_400)
    return gw.gateway.quotas.counters[f"tenant:{tenant}", "tpd", day]


def read_pieces(gw, key: str, count: int, path: str = "/v1/completions", body: dict | None = None) -> int:
    """Stream a completion, read `count` pieces of text, then hang up; returns the pieces read."""
    body = body or {"model": "remote", "prompt": "hi", "max_tokens": 500, "stream": True}
    got = 0
    with httpx.stream("POST", gw.url + path, json=body, headers=bearer(key), timeout=30) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data:") and '"tok ' in line:
                got += 1
                if got == count:
                    break
    return got


@pytest.mark.slow
def test_a_client_that_hangs_up_mid_stream_is_billed_what_it_received(tmp_path):
    with gateway_over({"remote": openai_upstream(lambda path: answer())}, tmp_path) as gw:
        tenant, key = tenant_with_key(gw, tpm=100_000)
        received = read_pieces(gw, key, 10)
        record = usage_records(gw.url, tenant)[0]
        assert record["status"] == "cancelled" and record["completion_tokens"] >= received == 10
        total = record["prompt_tokens"] + record["completion_tokens"]
        deadline = time.monotonic() + 5
        while tokens_today(gw, tenant) != total:  # the reservation settles to what was billed
            assert time.monotonic() < deadline, (tokens_today(gw, tenant), total)
            time.sleep(0.05)

        # A whole answer bills what the upstream reports; never less than the pieces it sent.
        done = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key).completions.create(
            model="remote", prompt="hi", max_tokens=500)
        assert done.usage.completion_tokens == PIECES
        assert usage_records(gw.url, tenant, 2)[0]["completion_tokens"] == PIECES


@pytest.mark.slow
def test_an_upstream_that_lies_about_usage_is_billed_from_what_it_sent(tmp_path):
    async def liar():
        async for chunk in answer(count=20):
            yield chunk.replace(b'"completion_tokens": 20', b'"completion_tokens": 0')

    with gateway_over({"remote": openai_upstream(lambda path: liar())}, tmp_path) as gw:
        tenant, key = tenant_with_key(gw)
        done = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key).completions.create(
            model="remote", prompt="hi", max_tokens=500)
        assert done.usage.completion_tokens == 20 and usage_records(gw.url, tenant)[0]["completion_tokens"] == 20


@pytest.mark.slow
@pytest.mark.parametrize("usage, completion", [
    ({"prompt_tokens": 3, "completion_tokens": 20, "prompt_tokens_details": {"cached_tokens": 10**9}}, 20),
    ({"prompt_tokens": -1000, "completion_tokens": 20, "prompt_tokens_details": {"cached_tokens": -5}}, 20),
    ({"prompt_tokens": "3", "completion_tokens": None, "prompt_tokens_details": {"cached_tokens": 2.5}}, 20),
    ({"prompt_tokens": 3, "completion_tokens": 10**9}, 20),  # more than max_tokens: what was sent
    ({"prompt_tokens": 2**63, "completion_tokens": 2**63, "prompt_tokens_details": {"cached_tokens": 2**63}}, 20),
], ids=["cached-beyond-the-prompt", "negative-counts", "counts-not-integers", "beyond-max-tokens", "int64-overflow"])
def test_an_upstream_whose_usage_is_impossible_is_billed_at_least_what_it_sent(tmp_path, usage, completion, caplog):
    """Cached tokens priced below input ones, more of them than the prompt held, would bill less
    than nothing; a negative count likewise. A count beyond what the request could use (a completion
    past `max_tokens`, a prompt past the gateway's own count) is logged with the backend's name and
    billed from the gateway's own count: what it sent, the prompt as it counted it."""
    async def impossible():
        async for chunk in answer(count=20):
            yield chunk if b'"usage": null' in chunk or b"[DONE]" in chunk else piece(None, usage=usage)

    price = {"input": 1, "cached_input": 0.1, "output": 2}  # USD per million tokens
    with gateway_over({"remote": openai_upstream(lambda path: impossible())}, tmp_path,
                      prices={"remote": price}) as gw:
        tenant, key = tenant_with_key(gw)
        done = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key).completions.create(
            model="remote", prompt="hi", max_tokens=500)
        record = usage_records(gw.url, tenant)[0]
    billed = (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.prompt_tokens_details.cached_tokens)
    assert billed == (record["prompt_tokens"], record["completion_tokens"], record["cached_tokens"])
    assert 1 <= record["prompt_tokens"] < 2**31 and record["completion_tokens"] == completion
    assert 0 <= record["cached_tokens"] <= record["prompt_tokens"]
    if any(isinstance(v, int) and v > 500 for v in (usage["prompt_tokens"], usage["completion_tokens"])):
        assert any("backend remote reported usage" in r.getMessage() for r in caplog.records)
    # every prompt token at the cached price, in nano-dollars ($1 per million tokens is 1,000 a token)
    assert record["cost_nano_usd"] >= record["prompt_tokens"] * 100 + completion * 2_000


@pytest.mark.slow
def test_an_upstream_that_dies_mid_stream_bills_what_was_sent(tmp_path):
    with gateway_over({"remote": openai_upstream(lambda path: answer(die_after=12))}, tmp_path) as gw:
        tenant, key = tenant_with_key(gw)
        lines = []
        body = {"model": "remote", "prompt": "hi", "max_tokens": 500, "stream": True}
        with httpx.stream("POST", gw.url + "/v1/completions", json=body, headers=bearer(key), timeout=30) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data:")]
        assert sum('"tok ' in line for line in lines) == 12 and '"error"' in lines[-2] and lines[-1] == "data: [DONE]"
        record = usage_records(gw.url, tenant)[0]
        assert record["status"] == "error" and record["completion_tokens"] >= 12
        deadline = time.monotonic() + 5
        while tokens_today(gw, tenant) != record["prompt_tokens"] + record["completion_tokens"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)


@pytest.mark.slow
def test_a_client_that_leaves_a_vllm_chat_is_billed_the_prompt_vllm_counts(tmp_path, vllm_url):
    """Against the real vLLM: a chat stream the client leaves ends without vLLM's usage, so its
    prompt is counted again by vLLM's `/tokenize`: the same count vLLM's usage gives the finished
    request (the reservation's bound, bytes plus a margin per message, billed 109 for its 27)."""
    backend = VLLMBackend(OpenAICompatConfig(base_url=vllm_url, model="smollm2"), name="vllm")
    app = gateway_app({"smollm2": backend}, tmp_path)
    messages = [{"role": "system", "content": "You tell stories."},
                {"role": "user", "content": "Tell a long story about a lighthouse keeper."}]
    with serve_app(app) as url:
        wait_ready(url)
        gw = SimpleNamespace(url=url, gateway=app.state.gateway)
        tenant, key = tenant_with_key(gw)
        body = {"model": "smollm2", "messages": messages, "max_tokens": 300, "stream": True, "ignore_eos": True}
        pieces = 0
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=bearer(key), timeout=60) as r:
            for line in r.iter_lines():
                pieces += line.startswith("data:") and '"content":"' in line and '"content":""' not in line
                if pieces == 10:
                    break
        left = usage_records(url, tenant)[0]
        done = openai.OpenAI(base_url=f"{url}/v1", api_key=key).chat.completions.create(
            model="smollm2", messages=messages, max_tokens=2)
    assert left["status"] == "cancelled" and left["completion_tokens"] >= pieces == 10
    assert left["prompt_tokens"] == done.usage.prompt_tokens


@pytest.mark.slow
@pytest.mark.parametrize("status, answered", [(400, 400), (500, 502)])
def test_a_request_refused_before_any_answer_bills_nothing(tmp_path, status, answered):
    """An upstream that refuses a request (the client's fault) or fails before answering (its
    own) served nothing: the ledger bills no tokens and no money, and the tenant's token window
    gets its reservation back."""
    price = {"input": 1, "output": 2}  # USD per million tokens
    with gateway_over({"remote": openai_upstream(lambda path: [], status=status)}, tmp_path,
                      prices={"remote": price}) as gw:
        tenant, key = tenant_with_key(gw)
        body = {"model": "remote", "messages": [{"role": "user", "content": "hello " * 200}], "max_tokens": 50}
        refused = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=bearer(key), timeout=30)
        assert refused.status_code == answered
        record = usage_records(gw.url, tenant)[0]
        assert record["status"] == "error"
        assert (record["prompt_tokens"], record["completion_tokens"], record["cost_nano_usd"]) == (0, 0, 0)
        deadline = time.monotonic() + 5
        while tokens_today(gw, tenant) != 0:  # the reservation (prompt + max_tokens) is released
            assert time.monotonic() < deadline, tokens_today(gw, tenant)
            time.sleep(0.05)


def test_a_recounted_stream_is_never_billed_below_one_token_per_piece():
    from backends.base import Delta
    from gateway.inference.call import Received

    received = Received()
    for text in ("Hel", "lo", " world"):
        received.add(Delta(0, text))
    received.add(Delta(0, "!", (7, 8)))  # ids where the backend gives them
    assert received.choice_texts() == ["Hello world"] and received.lower_bound == 5
    assert received.counted(1) == 5 and received.counted(4) == 6  # the tokenizer's count, floored by the pieces
