"""`/v1/responses` through the official `openai` SDK on a real socket: served on the chat path by the
built-in engine (and by vLLM's CPU build in the slow tests), streamed and not, with function calls,
structured outputs, stored responses that only their tenant reads or continues, and the ledger."""

from __future__ import annotations

import asyncio
import contextlib
import json
from datetime import timedelta

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseItemList, ResponseStreamEvent
from pydantic import BaseModel, Field, TypeAdapter, ValidationError
from sqlmodel import Session

from backends.base import InvalidRequest
from backends.builtin import BuiltinBackend, EngineConfig
from gateway.api.responses import create_response, purge_expired
from gateway.tables import StoredResponse, utcnow

from .conftest import (
    ADMIN_KEY,
    AUTH,
    free_port,
    gateway_app,
    openai_upstream,
    provisioned_or_skip,
    serve_app,
    usage_records,
    wait_ready,
)
from .upstreams import gateway_over

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
    "additionalProperties": False}, "strict": True}
TEXT_EVENTS = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
               "response.output_text.done", "response.content_part.done", "response.output_item.done"]
CALL_EVENTS = ["response.output_item.added", "response.function_call_arguments.delta",
               "response.function_call_arguments.done", "response.output_item.done"]
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)


class Forecast(BaseModel):
    city: str = Field(max_length=20)
    celsius: int = Field(ge=-50, le=60)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    backend = BuiltinBackend(EngineConfig(engine_process=False, dtype="float32"))
    app = gateway_app({backend.model_id: backend}, tmp_path_factory.mktemp("gw"))
    with serve_app(app) as url:
        wait_ready(url)
        yield url, app.state.gateway


@pytest.fixture
def client(gateway):
    return openai.OpenAI(base_url=f"{gateway[0]}/v1", api_key=ADMIN_KEY, max_retries=0)


def other_tenant(url: str, name: str) -> openai.OpenAI:
    assert httpx.post(f"{url}/admin/tenants", json={"name": name}, headers=AUTH).status_code == 201
    key = httpx.post(f"{url}/admin/keys", json={"tenant": name}, headers=AUTH).json()["key"]
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def raw_events(url: str, body: dict) -> list[dict]:
    """A streamed response's server-sent events as sent: each one's `event` and its `data`."""
    with httpx.stream("POST", f"{url}/v1/responses", json={**body, "stream": True}, headers=AUTH,
                      timeout=60) as answer:
        blocks = answer.read().decode().strip().split("\n\n")
    return [{"event": event.removeprefix("event: "), "data": json.loads(data.removeprefix("data: "))}
            for event, data in (block.split("\n") for block in blocks)]


def without_numbers(events: list[str]) -> list[str]:
    """Event types with repeated deltas folded into one, to compare sequences."""
    return [kind for i, kind in enumerate(events) if not (kind.endswith(".delta") and events[i - 1] == kind)]


def test_create_answers_as_chat_does_and_bills_responses(gateway, client):
    url = gateway[0]
    response = client.responses.create(model=MODEL, instructions="You answer briefly.", input="Name a color.",
                                       max_output_tokens=12, temperature=0)
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=12, messages=[
        {"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Name a color."}])
    assert response.output_text == chat.choices[0].message.content  # the same call on the same path
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    raw = httpx.get(f"{url}/v1/responses/{response.id}", headers=AUTH).json()
    Response.model_validate(raw)  # strictly: every field the SDK's type requires is there
    assert [item.type for item in response.output] == ["message"] and response.output[0].id.startswith("msg_")
    assert response.instructions == "You answer briefly." and response.store and response.tools == []
    usage = response.usage
    assert usage.input_tokens == chat.usage.prompt_tokens and usage.output_tokens == chat.usage.completion_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0 and usage.input_tokens_details.cached_tokens >= 0
    expected = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert response.status == expected
    short = client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=2, temperature=0)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert short.output[0].status == "incomplete" and short.usage.output_tokens == 2
    record = next(r for r in usage_records(url, "default", 3) if r["request_id"] == response.id)
    assert record["api"] == "responses" and record["completion_tokens"] == usage.output_tokens
    assert record["prompt_tokens"] == usage.input_tokens


def test_stream_sends_openais_events_in_order(gateway, client):
    url = gateway[0]
    ask = {"model": MODEL, "input": "Name a fruit.", "max_output_tokens": 12, "temperature": 0}
    whole = client.responses.create(**ask)
    assert whole.status == "completed"  # the SDK's final response is a completed one's
    with client.responses.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert without_numbers(kinds) == ["response.created", "response.in_progress", *TEXT_EVENTS,
                                      "response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    for raw in raw_events(url, ask):  # each the SDK's own type, every field it requires present
        assert raw["event"] == raw["data"]["type"]
        STREAM_EVENT.validate_python(raw["data"])
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    item_id = final.output[0].id
    assert all(e.item_id == item_id and e.output_index == 0 and e.content_index == 0 for e in deltas)
    assert "".join(e.delta for e in deltas) == final.output_text == whole.output_text
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_function_call_round_trip(client):
    first = client.responses.create(model=MODEL, input="What is the weather like in Paris?", tools=[WEATHER],
                                    tool_choice="required", parallel_tool_calls=False, temperature=0,
                                    max_output_tokens=60)
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1, first.output
    call = calls[0]
    assert call.name == "get_weather" and call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert isinstance(json.loads(call.arguments)["city"], str)
    assert first.tool_choice == "required" and first.tools[0].name == "get_weather"
    second = client.responses.create(model=MODEL, previous_response_id=first.id, temperature=0, max_output_tokens=30,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "21 C and sunny"}])
    assert second.output_text and [item.type for item in second.output] == ["message"]
    assert second.previous_response_id == first.id

    with client.responses.stream(model=MODEL, input="What is the weather like in Oslo?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                 max_output_tokens=60) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert without_numbers(kinds) == ["response.created", "response.in_progress", *CALL_EVENTS, "response.completed"]
    [call] = streamed.output
    assert call.type == "function_call" and json.loads(call.arguments)["city"]


def test_parse_gives_the_schemas_object(client):
    parsed = client.responses.parse(model=MODEL, input="The forecast for Rome: give its city and temperature.",
                                    text_format=Forecast, temperature=0, max_output_tokens=60)
    assert isinstance(parsed.output_parsed, Forecast)
    assert parsed.text.format.type == "json_schema"
    as_object = client.responses.create(model=MODEL, input="A JSON object about Rome.", temperature=0,
                                        max_output_tokens=40, text={"format": {"type": "json_object"}})
    assert as_object.output_text.startswith("{")  # held to JSON, however far it got


def test_stored_responses_are_read_listed_deleted_and_expire(gateway, client):
    url, gw = gateway
    items = [{"role": "developer", "content": "Answer in one word."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Sky color?"}]}]
    kept = client.responses.create(model=MODEL, input=items, max_output_tokens=4, temperature=0,
                                   metadata={"case": "stored"})
    assert client.responses.retrieve(kept.id).model_dump() == kept.model_dump()
    listed = client.responses.input_items.list(kept.id)
    assert [(i.type, i.role) for i in listed.data] == [("message", "user"), ("message", "developer")]  # newest first
    assert listed.data[0].content[0].text == "Sky color?" and all(i.id for i in listed.data)
    ascending = client.responses.input_items.list(kept.id, order="asc", limit=1)
    assert [i.role for i in ascending.data] == ["developer"] and ascending.has_more
    assert kept.metadata == {"case": "stored"}
    ResponseItemList.model_validate(httpx.get(f"{url}/v1/responses/{kept.id}/input_items", headers=AUTH).json())

    deleted = httpx.delete(f"{url}/v1/responses/{kept.id}", headers=AUTH)
    assert deleted.json() == {"id": kept.id, "object": "response", "deleted": True}
    for gone in (lambda: client.responses.retrieve(kept.id), lambda: client.responses.delete(kept.id)):
        with pytest.raises(openai.NotFoundError) as missing:
            gone()
        assert missing.value.code == "response_not_found" and kept.id in missing.value.message

    unkept = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)

    expired = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with Session(gw.db) as session:
        row = session.get(StoredResponse, expired.id)
        assert row.expires_at - row.created_at == timedelta(seconds=gw.settings.responses_retention_s)
        row.expires_at = utcnow() - timedelta(seconds=1)
        session.add(row)
        session.commit()
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(expired.id)
    with pytest.raises(openai.NotFoundError) as not_continued:
        client.responses.create(model=MODEL, input="And?", previous_response_id=expired.id)
    assert not_continued.value.body["param"] == "previous_response_id"
    assert purge_expired(gw.db, utcnow()) >= 1
    with Session(gw.db) as session:
        assert session.get(StoredResponse, expired.id) is None


def test_another_tenant_can_neither_read_nor_continue_a_response(gateway, client):
    url = gateway[0]
    mine = client.responses.create(model=MODEL, input="My secret plan.", max_output_tokens=2)
    stranger = other_tenant(url, "responses-stranger")
    attempts = [lambda: stranger.responses.retrieve(mine.id), lambda: stranger.responses.delete(mine.id),
                lambda: stranger.responses.input_items.list(mine.id),
                lambda: stranger.responses.create(model=MODEL, input="Go on.", previous_response_id=mine.id)]
    for attempt in attempts:
        with pytest.raises(openai.NotFoundError) as refused:
            attempt()
        # the answer an id that never existed gets: nothing tells them apart
        assert refused.value.code == "response_not_found"
        assert refused.value.body["message"] == f"Response with id {mine.id!r} not found."
    assert client.responses.retrieve(mine.id).id == mine.id  # still there for its tenant


def test_follower_continues_the_conversation_without_its_instructions(gateway, client):
    gw = gateway[1]
    first = client.responses.create(model=MODEL, instructions="Be terse.", input="My name is Ada.",
                                    max_output_tokens=4, temperature=0)
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="What is my name?",
                                     max_output_tokens=4, temperature=0)
    assert second.instructions is None
    with Session(gw.db) as session:
        messages = session.get(StoredResponse, second.id).messages
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[0]["content"] == "My name is Ada." and messages[1]["content"] == first.output_text
    assert second.usage.input_tokens > first.usage.input_tokens  # the earlier turn was sent again


def test_bad_inputs_are_400s_naming_the_field(gateway):
    url = gateway[0]

    def refused(**fields) -> dict:
        answer = httpx.post(f"{url}/v1/responses", json={"model": MODEL, "input": "hi", **fields}, headers=AUTH)
        assert answer.status_code == 400, answer.text
        return answer.json()["error"]

    cases = {
        "background": {"background": True},
        "tools": {"tools": [{"type": "web_search"}]},
        "tool_choice": {"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}},
        "text.format": {"text": {"format": {"type": "xml"}}},
        "reasoning": {"reasoning": {"effort": "high"}},  # the built-in engine's model does not reason
        "include": {"include": ["file_search_call.results"]},
        "conversation": {"conversation": "conv_1"},
        "max_output_tokens": {"max_output_tokens": 0},
        "truncation": {"truncation": "auto"},
        "input": {"input": [{"type": "reasoning", "summary": []}]},
    }
    for field, fields in cases.items():
        error = refused(**fields)
        assert error["param"] == field and field in error["message"], (field, error)
    assert "web_search" in refused(tools=[{"type": "web_search"}])["message"]
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]
    assert "input_image" in refused(input=image)["message"]
    assert refused(input=[])["param"] == "input"
    assert refused(tool_choice="required")["param"] == "tool_choice"  # no tools to call
    streamed = httpx.post(f"{url}/v1/responses", headers=AUTH, json={"model": MODEL, "input": "hi", "stream": True,
                                                                     "background": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "background"
    unknown = httpx.post(f"{url}/v1/responses", headers=AUTH, json={"model": MODEL, "input": "hi",
                                                                    "previous_response_id": "resp_nope"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "response_not_found"
    assert "resp_nope" in unknown.json()["error"]["message"]


def test_create_response_takes_a_body_without_a_client(gateway):
    """What a batch runner calls: the endpoint's refusals, raised."""
    gw = gateway[1]
    principal = asyncio.run(gw.directory.authenticate(ADMIN_KEY))
    with pytest.raises(ValidationError):
        asyncio.run(create_response(gw, principal, {"model": MODEL}))
    with pytest.raises(InvalidRequest) as streamed:
        asyncio.run(create_response(gw, principal, {"model": MODEL, "input": "hi", "stream": True}))
    assert streamed.value.param == "stream"


# -- an upstream that streams a call in pieces, or dies mid-answer --------------------------------
def chat_piece(delta: dict, finish: str | None = None) -> bytes:
    return f"data: {json.dumps({'choices': [{'index': 0, 'delta': delta, 'finish_reason': finish}]})}\n\n".encode()


async def call_in_pieces():
    """A tool call as vLLM streams one: its id and name first, then its arguments in pieces."""
    yield chat_piece({"role": "assistant", "content": "Checking."})
    yield chat_piece({"tool_calls": [{"index": 0, "id": "call_abc", "type": "function",
                                      "function": {"name": "get_weather", "arguments": ""}}]})
    for piece in ('{"city": ', '"Paris"', "}"):
        yield chat_piece({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
    yield chat_piece({}, "tool_calls")
    yield b'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}}\n\n'
    yield b"data: [DONE]\n\n"


async def dies_mid_answer():
    for _ in range(3):
        yield chat_piece({"content": "tok "})
        await asyncio.sleep(0.01)
    raise ConnectionResetError("the upstream died")


def test_a_call_streamed_in_pieces_and_an_upstream_that_dies(tmp_path):
    upstreams = {"pieces": openai_upstream(lambda path: call_in_pieces()),
                 "dying": openai_upstream(lambda path: dies_mid_answer())}
    with gateway_over(upstreams, tmp_path) as gw:
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=ADMIN_KEY, max_retries=0)
        whole = client.responses.create(model="pieces", input="Weather in Paris?", tools=[WEATHER])
        assert [item.type for item in whole.output] == ["message", "function_call"]
        assert whole.output_text == "Checking." and whole.output[1].call_id == "call_abc"
        assert json.loads(whole.output[1].arguments) == {"city": "Paris"}
        with client.responses.stream(model="pieces", input="Weather in Paris?", tools=[WEATHER]) as stream:
            events = list(stream)
            final = stream.get_final_response()
        assert without_numbers([e.type for e in events]) == [
            "response.created", "response.in_progress", *TEXT_EVENTS, *CALL_EVENTS, "response.completed"]
        assert [e.delta for e in events if e.type == "response.function_call_arguments.delta"] == [
            '{"city": ', '"Paris"', "}"]
        assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1]
        assert final.output[1].arguments == whole.output[1].arguments and final.output[1].status == "completed"

        for raw in raw_events(gw.url, {"model": "pieces", "input": "Weather?", "tools": [WEATHER]}) + raw_events(
                gw.url, {"model": "dying", "input": "Hi"}):
            STREAM_EVENT.validate_python(raw["data"])
        with client.responses.stream(model="dying", input="Hi") as stream:
            events = list(stream)
        failed = events[-1]
        assert failed.type == "response.failed" and failed.response.status == "failed"
        assert failed.response.error.code == "server_error" and failed.response.output[0].status == "incomplete"
        assert failed.response.output[0].content[0].text == "tok tok tok "
        with pytest.raises(openai.NotFoundError):  # a failed response is not kept
            client.responses.retrieve(failed.response.id)


# -- vLLM's CPU build behind the gateway ----------------------------------------------------------
@contextlib.contextmanager
def vllm_client(vllm_url: str, home):
    from backends.openai_compat import OpenAICompatConfig
    from backends.vllm import VLLMBackend

    app = gateway_app({"smollm2": VLLMBackend(OpenAICompatConfig(base_url=vllm_url, model="smollm2"))}, home)
    with serve_app(app) as url:
        wait_ready(url)
        yield url, openai.OpenAI(base_url=f"{url}/v1", api_key=ADMIN_KEY, max_retries=0)


@pytest.mark.slow
def test_vllm_serves_text_streams_and_structured_outputs(vllm_url, tmp_path):
    with vllm_client(vllm_url, tmp_path) as (url, client):
        ask = {"model": "smollm2", "input": "Say hello.", "max_output_tokens": 60, "temperature": 0}
        text = client.responses.create(**ask)
        assert text.status == "completed" and text.output_text and text.usage.output_tokens <= 60, text
        with client.responses.stream(**ask) as stream:
            kinds = [event.type for event in stream]
            streamed = stream.get_final_response()
        assert streamed.output_text == text.output_text
        assert without_numbers(kinds) == ["response.created", "response.in_progress", *TEXT_EVENTS,
                                          "response.completed"]
        parsed = client.responses.parse(model="smollm2", input="The forecast for Rome: city and temperature.",
                                        text_format=Forecast, temperature=0, max_output_tokens=60)
        assert isinstance(parsed.output_parsed, Forecast)
        assert {r["api"] for r in usage_records(url, "default", 3)} == {"responses"}


@pytest.mark.slow
def test_vllm_round_trips_a_function_call(default_model_dir, tmp_path):
    """vLLM 0.32 takes any tool_choice only with auto tool choice on and a tool parser, which the
    run's shared server has not: this one has Hermes' (a named choice is decoded to the function's
    schema whatever the parser)."""
    from backends import peers
    from backends.launch import supervised

    provisioned_or_skip(peers.vllm_python)
    port = free_port()
    command = peers.vllm_command(default_model_dir, port, "smollm2", dtype="float32",
                                 extra=["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    with supervised(command, f"http://127.0.0.1:{port}", "/health", peers.vllm_env(), 900), \
            vllm_client(f"http://127.0.0.1:{port}", tmp_path) as (_, client):
        first = client.responses.create(model="smollm2", input="What is the weather like in Paris?", tools=[WEATHER],
                                        tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                        max_output_tokens=60)
        [call] = [item for item in first.output if item.type == "function_call"]
        assert first.status == "completed" and call.name == "get_weather", first
        assert isinstance(json.loads(call.arguments)["city"], str)
        second = client.responses.create(model="smollm2", previous_response_id=first.id, temperature=0,
                                         max_output_tokens=30, input=[{"type": "function_call_output",
                                                                       "call_id": call.call_id, "output": "21 C"}])
        assert second.output_text and [item.type for item in second.output] == ["message"], second
