"""A hostile tenant's requests against a remote upstream: what it assembles beyond the body cap (a
chain of stored responses), fields it smuggles into what is stored, and numbers no model takes.
Each gets a 4xx naming its problem and reaches no upstream; another tenant is served meanwhile."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from .conftest import openai_upstream, usage_records
from .test_responses import chat_piece
from .upstreams import admin, gateway_over, tenant_with_key

pytestmark = pytest.mark.slow

CAP = 64 * 1024  # the gateway's body cap in these tests


def answered(path: str):
    """Every POST answered by one short chat answer; the paths asked are counted."""
    answered.paths.append(path)
    return [chat_piece({"role": "assistant", "content": "ok"}), chat_piece({}, "stop"),
            b'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}\n\n',
            b"data: [DONE]\n\n"]


answered.paths = []


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    with gateway_over({"m": openai_upstream(answered)}, tmp_path_factory.mktemp("gw"), max_body_bytes=CAP) as gw:
        yield gw


def post(gw, key: str, path: str, body: dict) -> httpx.Response:
    return admin(gw, "POST", path, key, json=body)


def test_a_chain_of_stored_responses_is_held_to_the_body_cap_upstream(gw):
    name, key = tenant_with_key(gw)
    turn = "x" * (CAP * 2 // 5)  # each turn's body is well under the cap
    first = post(gw, key, "/v1/responses", {"model": "m", "input": turn})
    assert first.status_code == 200, first.text
    second = post(gw, key, "/v1/responses", {"model": "m", "input": turn, "previous_response_id": first.json()["id"]})
    assert second.status_code == 200, second.text
    sent = len(answered.paths)
    third = post(gw, key, "/v1/responses", {"model": "m", "input": turn, "previous_response_id": second.json()["id"]})
    assert third.status_code == 413, third.text
    error = third.json()["error"]
    assert error["code"] == "request_too_large" and f"({CAP} bytes)" in error["message"]
    assert len(answered.paths) == sent  # nothing went upstream, and nothing is billed for it
    time.sleep(1)  # past the ledger's flush
    assert [r["status"] for r in usage_records(gw.url, name, 2)] == ["ok", "ok"]
    _, other = tenant_with_key(gw)
    assert post(gw, other, "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
                ).status_code == 200


def test_unknown_fields_in_input_items_are_refused_by_name_not_stored(gw):
    _, key = tenant_with_key(gw)
    smuggled = [{"type": "message", "role": "user", "content": "hi", "x_payload": "A" * 100},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi", "evil": 1}]},
                {"type": "function_call_output", "call_id": "c1", "output": "ok", "extra": {}}]
    for item in smuggled:
        answer = post(gw, key, "/v1/responses", {"model": "m", "input": [item]})
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == "input" and "unknown field" in error["message"], error
        assert next(name for name in ("x_payload", "evil", "extra") if name in json.dumps(item)) in error["message"]
    kept = post(gw, key, "/v1/responses", {"model": "m", "input": [{"type": "message", "role": "user",
                                                                     "content": "hi", "id": "msg_1"}]})
    assert kept.status_code == 200
    listed = admin(gw, "GET", f"/v1/responses/{kept.json()['id']}/input_items", key).json()["data"]
    assert set(listed[0]) <= {"type", "id", "status", "role", "content"}


@pytest.mark.parametrize("dimensions", [10**30, 1e30, 2**20, 0, "8"])
def test_embedding_dimensions_no_model_has_are_refused_before_any_upstream(gw, dimensions):
    _, key = tenant_with_key(gw)
    sent = len(answered.paths)
    answer = post(gw, key, "/v1/embeddings", {"model": "m", "input": "hi", "dimensions": dimensions})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "dimensions", answer.text
    assert len(answered.paths) == sent
