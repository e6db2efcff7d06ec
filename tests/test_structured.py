"""The built-in engine speaks the OpenAI API that applications use: structured outputs, logprobs
and the common sampling knobs, through the official `openai` SDK on a real socket (the engine in
its own process, fp32 so that figures are exact on every CPU), plus the batched sampler checked
against a row-by-row reference."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel, Field

from backends.builtin import BuiltinBackend, EngineConfig
from backends.builtin.core.sampler import sample
from backends.builtin.core.sequence import SamplingParams, Sequence
from backends.tokenization import vocabulary_bytes

from .conftest import ADMIN_KEY, AUTH, gateway_app, serve_app, wait_ready

MODEL = "SmolLM2-135M-Instruct"
SCHEMAS = json.loads((Path(__file__).parent / "fixtures" / "json_schemas.json").read_text())
# A 135M model decoding greedily can loop inside a string until max_tokens; the penalties that
# applications set for small models keep it finishing (the same settings run against vLLM in
# benchmarks/structured_outputs.py).
FINISHING = {"frequency_penalty": 0.5, "extra_body": {"repetition_penalty": 1.1}}


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    backend = BuiltinBackend(EngineConfig(dtype="float32", gguf_weights="dequantized"))
    with serve_app(gateway_app({backend.model_id: backend}, tmp_path_factory.mktemp("gw"))) as url:
        wait_ready(url)
        yield url


@pytest.fixture
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=ADMIN_KEY, max_retries=0)


def ask(prompt: str, schema: dict | None = None) -> list[dict]:
    if schema is not None:
        prompt = f"{prompt} Answer in JSON matching this schema: {json.dumps(schema)}"
    return [{"role": "user", "content": prompt}]


class Address(BaseModel):
    city: str = Field(max_length=40)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=120)
    role: str = Field(json_schema_extra={"enum": ["engineer", "doctor", "artist"]})
    address: Address


@pytest.mark.slow
def test_sdk_parse_returns_an_object_streaming_and_not(client):
    messages = ask("Describe a person who lives in Paris.", Person.model_json_schema())
    parsed = client.chat.completions.parse(model=MODEL, messages=messages, response_format=Person, temperature=0,
                                           max_tokens=200, **FINISHING)
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and isinstance(person.address, Address)
    assert parsed.choices[0].finish_reason == "stop"
    with client.chat.completions.stream(model=MODEL, messages=messages, response_format=Person, temperature=0,
                                        max_tokens=200, **FINISHING) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.parsed == person  # the same greedy answer, assembled from chunks


@pytest.mark.slow
def test_every_output_matches_its_schema(base_url):
    """54 schemas of varied shape, sent at once so that they share batches: 100% finish and validate."""

    async def run_all():
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=ADMIN_KEY, max_retries=0, timeout=600)
        return await asyncio.gather(*[client.chat.completions.create(
            model=MODEL, messages=ask(case["prompt"], case["schema"]), temperature=0, max_tokens=256,
            response_format={"type": "json_schema", "json_schema": {"name": case["name"], "schema": case["schema"],
                                                                     "strict": True}}, **FINISHING)
            for case in SCHEMAS])

    assert len(SCHEMAS) >= 50
    invalid = []
    for case, answer in zip(SCHEMAS, asyncio.run(run_all())):
        choice = answer.choices[0]
        try:
            validator = jsonschema.Draft202012Validator(case["schema"],
                                                        format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
            validator.validate(json.loads(choice.message.content))
        except (ValueError, jsonschema.ValidationError) as exc:
            invalid.append((case["name"], choice.finish_reason, choice.message.content[:80], str(exc)[:80]))
    assert not invalid, invalid


@pytest.mark.slow
def test_regex_choice_grammar_and_every_spelling(client):
    def content(**fields) -> str:
        answer = client.chat.completions.create(model=MODEL, messages=ask("Give a phone number."), temperature=0,
                                                max_tokens=40, extra_body=fields)
        return answer.choices[0].message.content

    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", content(structured_outputs={"regex": "[0-9]{3}-[0-9]{4}"}))
    assert content(structured_outputs={"choice": ["yes", "no"]}) in ("yes", "no")
    assert content(guided_choice=["red", "blue"]) in ("red", "blue")  # vLLM's older spelling
    assert re.fullmatch(r"call [0-9]{3}", content(structured_outputs={"grammar": 'start: "call " /[0-9]{3}/'}))  # Lark
    assert re.fullmatch(r"dial [0-9]{2}", content(guided_grammar='root ::= "dial " [0-9] [0-9]'))  # GBNF
    assert isinstance(json.loads(content(response_format={"type": "json_object"})), dict)
    number = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    assert 0 <= json.loads(content(guided_json=number))["n"] <= 99


@pytest.mark.slow
def test_constrained_and_free_requests_share_a_batch(base_url):
    """A free request answers the same whether constrained ones run beside it or not."""
    body = {"model": MODEL, "messages": ask("Name three fruits."), "temperature": 0, "max_tokens": 24}
    constrained = {**body, "max_tokens": 60, "response_format": {"type": "json_object"}}

    async def run(with_constrained: bool):
        async with httpx.AsyncClient(base_url=base_url, headers=AUTH, timeout=120) as http:
            calls = [http.post("/v1/chat/completions", json=body)]
            if with_constrained:
                calls += [http.post("/v1/chat/completions", json=constrained) for _ in range(3)]
            return [r.json() for r in await asyncio.gather(*calls)]

    alone = asyncio.run(run(False))[0]
    free, *others = asyncio.run(run(True))
    assert free["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
    assert all(isinstance(json.loads(o["choices"][0]["message"]["content"]), dict) for o in others)


@pytest.mark.slow
def test_logprobs_are_the_models_own(client, hf_model, default_model):
    """Top-1 logprob tokens are the greedy tokens, and each value is transformers' log-softmax."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12,
                                            logprobs=True, top_logprobs=5)
    entries = answer.choices[0].logprobs.content
    assert len(entries) == answer.usage.completion_tokens and all(len(e.top_logprobs) == 5 for e in entries)
    assert all(e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob for e in entries)
    tok = default_model.tokenizer
    prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                        add_special_tokens=False)
    with torch.inference_mode():
        generated = hf_model.generate(torch.tensor([prompt]), max_new_tokens=len(entries), do_sample=False,
                                      output_logits=True, return_dict_in_generate=True)
    reference = torch.log_softmax(torch.cat(generated.logits).float(), dim=-1)
    for step, entry in enumerate(entries):
        token = int(generated.sequences[0, len(prompt) + step])
        assert bytes(entry.bytes) == vocabulary_bytes(tok.convert_ids_to_tokens(token))  # the greedy token
        top = reference[step].topk(5).values.tolist()
        assert max(abs(a.logprob - b) for a, b in zip(entry.top_logprobs, top)) < 1e-3, (step, entry, top)
    streamed = [c.choices[0].logprobs.content for c in client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=12, logprobs=True, top_logprobs=5, stream=True)
        if c.choices and c.choices[0].logprobs]
    assert [e.token for chunk in streamed for e in chunk] == [e.token for e in entries]
    completion = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0,
                                           max_tokens=5, logprobs=3)
    lp = completion.choices[0].logprobs
    assert "".join(lp.tokens) == completion.choices[0].text and len(lp.token_logprobs) == 5
    assert lp.text_offset[0] == 0 and all(len(top) == 3 for top in lp.top_logprobs)
    echoed = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=5,
                                       echo=True)
    assert echoed.choices[0].text == "The capital of France is" + completion.choices[0].text
    assert echoed.usage.completion_tokens == 5


@pytest.mark.slow
def test_sampling_knobs_do_what_they_say(client, default_model):
    messages = [{"role": "user", "content": "Say hello."}]
    nine = default_model.tokenizer.convert_tokens_to_ids("9")

    def create(**fields):
        return client.chat.completions.create(model=MODEL, messages=messages, **{"max_tokens": 24, **fields})

    greedy = create(temperature=0).choices[0].message.content
    forced = create(temperature=0, max_tokens=4, logit_bias={str(nine): 100}, logprobs=True)
    assert [e.token for e in forced.choices[0].logprobs.content] == ["9"] * 4
    short = create(temperature=0, max_tokens=200)
    assert short.choices[0].finish_reason == "stop"
    longer = create(temperature=0, max_tokens=200, extra_body={"min_tokens": short.usage.completion_tokens + 8})
    assert longer.usage.completion_tokens >= short.usage.completion_tokens + 8
    assert create(temperature=1.0, extra_body={"min_p": 1.0}).choices[0].message.content == greedy  # only the top token
    seeded = [create(temperature=1.0, seed=11).choices[0].message.content for _ in range(2)]
    assert seeded[0] == seeded[1] != create(temperature=1.0, seed=12).choices[0].message.content


@pytest.mark.slow
def test_bad_inputs_are_400s_naming_the_field(base_url):
    def refused(path: str, **fields) -> dict:
        body = {"model": MODEL, "max_tokens": 4, **fields}
        body.setdefault("messages" if path == "chat" else "prompt", ask("hi") if path == "chat" else "hi")
        answer = httpx.post(f"{base_url}/v1/{'chat/' if path == 'chat' else ''}completions", json=body, headers=AUTH)
        assert answer.status_code == 400, answer.text
        return answer.json()["error"]

    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}
    error = refused("chat", response_format=schema)
    assert error["param"] == "response_format" and "strin" in error["message"]
    unsupported = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                                  "not": {"required": ["a"]}}}}
    error = refused("chat", response_format=unsupported)
    assert error["param"] == "response_format" and '"not"' in error["message"]
    assert refused("chat", structured_outputs={"regex": "a(b"})["param"] == "structured_outputs"
    assert refused("chat", logprobs=True, top_logprobs=21)["param"] == "top_logprobs"
    assert refused("text", logprobs=21)["param"] == "logprobs"
    assert refused("chat", logit_bias={"99999999": 5})["param"] == "logit_bias"
    assert refused("chat", logit_bias={"hello": 5})["param"] == "logit_bias"
    assert refused("chat", frequency_penalty=3)["param"] == "frequency_penalty"
    assert refused("chat", min_tokens=10)["param"] == "min_tokens"  # more than max_tokens
    assert refused("text", echo=True, logprobs=2)["param"] == "echo"  # prompt logprobs are not computed
    assert refused("chat", response_format={"type": "json_object"}, guided_regex="a+")["param"] in (
        "response_format", "guided_regex")


# -- the batched sampler against a row-by-row reference --------------------------------------------
def reference_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """vLLM's penalties written one token at a time."""
    row = logits.clone()
    p = seq.params
    outputs = seq.output_ids
    for token in set(seq.token_ids):
        if p.repetition_penalty != 1.0:
            row[token] = row[token] / p.repetition_penalty if row[token] > 0 else row[token] * p.repetition_penalty
    for token in set(outputs):
        row[token] -= p.frequency_penalty * outputs.count(token) + p.presence_penalty
    return row


def test_batched_penalties_equal_the_row_by_row_reference():
    torch.manual_seed(0)
    vocab = 64
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.7, presence_penalty=0.3),
              SamplingParams(temperature=0.0, repetition_penalty=1.3),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, repetition_penalty=0.8, frequency_penalty=-0.5)]
    seqs = []
    for p in params:
        seq = Sequence(torch.randint(0, vocab, (10,)).tolist(), p)
        seq.token_ids += torch.randint(0, vocab, (12,)).tolist()  # 12 output tokens
        seqs.append(seq)
    logits = torch.randn(len(seqs), vocab) * 3
    expected = torch.stack([reference_penalties(logits[i], seq) for i, seq in enumerate(seqs)])
    tokens, _ = sample(logits.clone(), seqs)
    assert tokens == expected.argmax(dim=-1).tolist()
    bias = Sequence([1, 2, 3], SamplingParams(temperature=0.0, logit_bias=((5, 100.0),), min_tokens=2))
    banned = torch.zeros(1, vocab)
    banned[0, 7] = 50.0  # an end-of-sequence token, barred before min_tokens
    assert sample(banned, [bias], frozenset({7}))[0] == [5]


# -- tool calls ---------------------------------------------------------------------------------
def function(name: str, description: str, properties: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}}}


TOOLS = [
    function("get_weather", "Current weather in a city",
             {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}}),
    function("get_time", "Current time in a time zone",
             {"tz": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Z][a-z]+$"}}),
    function("convert", "Convert an amount between currencies",
             {"amount": {"type": "number", "minimum": 0, "maximum": 1e6}, "to": {"enum": ["EUR", "USD", "JPY"]}}),
]
SCHEMA_OF = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
QUESTIONS = ["What's the weather like in {}?", "What time is it in {}?", "How much is 20 dollars in {}'s currency?"]
CITIES = ["Paris", "Oslo", "Tokyo", "Berlin", "Lima", "Cairo"]


@pytest.mark.slow
def test_tool_conversations_through_the_sdk(base_url):
    """36 conversations, streamed and not, tool_choice required or named for the call, auto for the
    answer: every call's arguments validate against its function's schema, and the model answers
    from the tool's result."""

    async def conversation(index: int, client: openai.AsyncOpenAI):
        city, question = CITIES[index % len(CITIES)], QUESTIONS[index % len(QUESTIONS)]
        named = TOOLS[index % len(TOOLS)]["function"]["name"]
        choice = "required" if index % 2 else {"type": "function", "function": {"name": named}}
        messages = [{"role": "user", "content": question.format(city)}]
        ask = {"model": MODEL, "tools": TOOLS, "temperature": 0, "max_tokens": 80, **FINISHING}
        if index % 3 == 0:  # streamed: the SDK assembles the tool-call deltas
            async with client.chat.completions.stream(messages=messages, tool_choice=choice, **ask) as stream:
                first = await stream.get_final_completion()
        else:
            first = await client.chat.completions.create(messages=messages, tool_choice=choice, **ask)
        message = first.choices[0].message
        calls = message.tool_calls or []
        results = [{"role": "tool", "tool_call_id": call.id, "content": "21 C, cloudy"} for call in calls]
        messages += [message.model_dump(exclude_none=True), *results]
        final = await client.chat.completions.create(messages=messages, tool_choice="auto", **ask)
        return named if isinstance(choice, dict) else None, first.choices[0], final.choices[0]

    async def run_all():
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=ADMIN_KEY, max_retries=0, timeout=600)
        return await asyncio.gather(*[conversation(i, client) for i in range(36)])

    checked = 0
    for named, first, final in asyncio.run(run_all()):
        assert first.finish_reason == "tool_calls" and first.message.tool_calls, first
        for call in first.message.tool_calls:
            assert named in (None, call.function.name)
            jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])
            checked += 1
        assert final.finish_reason in ("stop", "length") and final.message.content and not final.message.tool_calls
    assert checked >= 36


def test_a_call_begun_under_auto_must_be_a_valid_one(default_model):
    """auto leaves text free, but once the model writes <tool_call> the grammar holds it to a
    known function and its schema (the 135M model rarely chooses to call on its own)."""
    from backends.builtin.chat_formats import ChatFormat
    from backends.builtin.core.structured import Grammars
    from backends.builtin.tools import ToolUse

    tok = default_model.tokenizer
    grammars = Grammars(tok, default_model.config.vocab_size, [2])
    auto = ChatFormat.of(tok).tool_constraint(ToolUse.of({"tools": TOOLS, "tool_choice": "auto"}), "")

    def accepted(text: str) -> bool:
        return grammars.matcher(auto).state.consume_tokens(tok.encode(text, add_special_tokens=False))

    good = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris","unit":"celsius"}}'
            '\n</tool_call>')
    assert accepted("Just text, no call.") and accepted(good)
    assert not accepted('<tool_call>\n{"name": "get_stock", "arguments": {}}')  # no such function
    assert not accepted('<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris","unit":"kelvin"}}')


@pytest.mark.slow
def test_bad_tool_requests_are_400s_naming_the_field(base_url):
    def refused(**fields) -> dict:
        body = {"model": MODEL, "messages": ask("hi"), "max_tokens": 4, **fields}
        answer = httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=AUTH)
        assert answer.status_code == 400, answer.text
        return answer.json()["error"]

    error = refused(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_stock"}})
    assert error["param"] == "tool_choice" and "get_stock" in error["message"]
    assert refused(tools=[{"type": "function", "function": {}}])["param"] == "tools"
    assert refused(tool_choice="required")["param"] == "tool_choice"  # no tools to call
    assert refused(tools=TOOLS, response_format={"type": "json_object"})["param"] == "tools"
