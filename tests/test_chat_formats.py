"""Each model family's chat format on the built-in engine: tool calls written in the family's own
format under `tool_choice` and read back as OpenAI `tool_calls` through the official `openai` SDK,
reasoning returned as `reasoning_content`, the template switches (`enable_thinking`,
`reasoning_effort`), and each format's parser on streams split at every character. The families'
real chat templates are fixtures (tests/fixtures/chat_templates, each naming its source)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
from pathlib import Path

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from backends.base import GenerateRequest
from backends.builtin import BuiltinBackend, EngineConfig
from backends.builtin.chat_formats import ChatFormat, Harmony, Hermes, Llama3Json, MistralArray, MistralNamed
from backends.builtin.core.detokenizer import Detokenizer
from backends.builtin.core.structured import Grammars
from backends.builtin.tools import ToolUse
from backends.constraints import Constraint

from .conftest import ADMIN_KEY, running
from .families import build

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
FAMILIES = {  # family -> its chat template, and the format the engine must read in it
    "qwen3": ("qwen3.jinja", Hermes),
    "llama3.1": ("llama3.1.jinja", Llama3Json),
    "mistral-nemo": ("mistral-nemo.jinja", MistralArray),
    "mistral-small-3.2": ("mistral-small-3.2.jinja", MistralNamed),
    "gpt-oss": ("gpt-oss.jinja", Harmony),
}
# One call as each family writes it.
CALL = {
    "qwen3": '<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>',
    "llama3.1": '{{"name": "{name}", "parameters": {arguments}}}',
    "mistral-nemo": '[TOOL_CALLS][{{"name": "{name}", "arguments": {arguments}}}]',
    "mistral-small-3.2": "[TOOL_CALLS]{name}[ARGS]{arguments}",
    "gpt-oss": "<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{arguments}<|call|>",
}


def call_pattern(family: str, name: str) -> str:
    """The family's call of `name` as a regex, its arguments the group."""
    return re.escape(CALL[family].format(name=name, arguments="ARGUMENTS")).replace("ARGUMENTS", r"(\{.*\})")


def function(name: str, properties: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"The {name.split('_')[1]} somewhere",
                                             "parameters": {"type": "object", "properties": properties,
                                                            "required": list(properties),
                                                            "additionalProperties": False}}}


TOOLS = [function("get_weather", {"city": {"type": "string", "maxLength": 20}}),
         function("get_time", {"tz": {"enum": ["UTC", "Europe/Paris", "Asia/Tokyo"]}})]
SCHEMA_OF = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What time is it in Paris?"}]
GET_TIME = {"type": "function", "function": {"name": "get_time"}}


def with_template(model_dir: Path, template: Path, into: Path) -> Path:
    """`model_dir`'s model in `into`, its tokenizer's chat template `template`."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = template.read_text()
    tokenizer.save_pretrained(into)
    for item in model_dir.iterdir():
        if not (into / item.name).exists():
            (into / item.name).symlink_to(item)
    return into


@pytest.fixture(scope="session")
def family_models(default_model_dir, tmp_path_factory) -> dict[str, Path]:
    """Each family's own tiny random model (tests/families.py) with its chat template. Their
    tokenizer (SmolLM2's) has none of the families' special tokens (`<|channel|>`, `[TOOL_CALLS]`,
    `<|python_tag|>`): their markers are text there, in pieces, which the grammars constrain and
    the parsers read the same way."""
    architectures = {"qwen3": "qwen3", "llama3.1": "llama", "mistral-nemo": "mistral", "mistral-small-3.2": "mistral",
                     "gpt-oss": "gpt_oss"}
    bases = {}
    for architecture in set(architectures.values()):
        bases[architecture] = tmp_path_factory.mktemp(architecture)
        build(architecture, bases[architecture], default_model_dir)
    return {family: with_template(bases[architectures[family]], TEMPLATES / FAMILIES[family][0],
                                  tmp_path_factory.mktemp(family)) for family in FAMILIES}


@contextlib.asynccontextmanager
async def serving(family: str, model_dir: Path, tmp_path):
    """The family's model behind an in-process gateway: an SDK client of it, and the backend."""
    backend = BuiltinBackend(EngineConfig(model=str(model_dir), dtype="float64", served_name=family,
                                          kv_cache_tokens=4096, engine_process=False), family)
    async with running({family: backend}, tmp_path) as client:
        for _ in range(600):  # the gateway starts its backends in the background
            if (await client.get("/ready")).status_code == 200:
                break
            await asyncio.sleep(0.05)
        yield openai.AsyncOpenAI(base_url="http://gateway/v1", api_key=ADMIN_KEY, http_client=client,
                                 max_retries=0), backend


def raw_text(choice) -> str:
    """The text the model produced, markers and all: its tokens' bytes, from the logprobs."""
    return b"".join(bytes(entry.bytes) for entry in choice.logprobs.content).decode()


async def streamed(sdk: openai.AsyncOpenAI, **body) -> dict:
    """A streamed answer's choice 0 assembled from its deltas, and its usage."""
    content, reasoning, calls, usage, finish = "", "", {}, None, None
    async for chunk in await sdk.chat.completions.create(stream=True, stream_options={"include_usage": True}, **body):
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or ():
            calls[call.index] = (call.function.name, json.loads(call.function.arguments))
        finish = chunk.choices[0].finish_reason or finish
    return {"content": content, "reasoning": reasoning, "calls": [calls[i] for i in sorted(calls)], "usage": usage,
            "finish": finish}


# -- through the gateway, with the SDK ---------------------------------------------------------------
@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_a_required_or_named_call_is_written_in_the_familys_format(family, family_models, tmp_path):
    async with serving(family, family_models[family], tmp_path) as (sdk, backend):
        assert isinstance(backend.chat_format.tools, FAMILIES[family][1]) and backend.chat_format.native_tools
        asked = {"model": family, "messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 80}
        named = await sdk.chat.completions.create(tool_choice=GET_TIME, logprobs=True, **asked)
        choice = named.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        [call] = choice.message.tool_calls
        written = re.fullmatch(call_pattern(family, "get_time"), raw_text(choice))
        assert written, raw_text(choice)
        assert call.function.name == "get_time"
        assert json.loads(call.function.arguments) == json.loads(written.group(1))
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF["get_time"])
        if family.startswith("mistral"):
            assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id)  # the only ids Mistral's templates take back
        again = await streamed(sdk, tool_choice=GET_TIME, **asked)
        assert again["calls"] == [("get_time", json.loads(call.function.arguments))]
        assert again["finish"] == "tool_calls" and again["content"] == ""

        required = await sdk.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **asked)
        [call] = required.choices[0].message.tool_calls
        assert required.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])

        # the call and its result go back through the family's template (Mistral's takes 9-character ids)
        history = [*ASK, {"role": "assistant", "tool_calls": [{"id": "call_0123456789abcdef", "type": "function",
                                                               "function": {"name": "get_time",
                                                                            "arguments": '{"tz": "Europe/Paris"}'}}]},
                   {"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "14:05"}]
        answer = await sdk.chat.completions.create(model=family, messages=history, tools=TOOLS, temperature=0,
                                                   max_tokens=4)
        assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


THOUGHT = "[a-z]{1,8}( [a-z]{1,8}){2}"  # three words: what the grammar below lets the model think
ANSWER = "[A-Z][a-z]{0,8}[.]"
# Reasoning forced by a grammar over the raw output (a random model would not think on its own).
THINKING = {
    "qwen3": f'start: "<think>\\n" /{THOUGHT}/ "\\n</think>\\n\\n" /{ANSWER}/',
    "gpt-oss": f'start: "<|channel|>analysis<|message|>" /{THOUGHT}/ '
               f'"<|end|><|start|>assistant<|channel|>final<|message|>" /{ANSWER}/',
}


@pytest.mark.parametrize("family", sorted(THINKING))
async def test_reasoning_arrives_as_reasoning_content_streamed_and_not(family, family_models, tmp_path):
    async with serving(family, family_models[family], tmp_path) as (sdk, backend):
        asked = {"model": family, "messages": ASK, "temperature": 0, "max_tokens": 60,
                 "extra_body": {"structured_outputs": {"grammar": THINKING[family]}}}
        whole = await sdk.chat.completions.create(logprobs=True, **asked)
        message = whole.choices[0].message
        assert re.fullmatch(r"\n?" + THOUGHT + r"\n?", message.reasoning_content), message
        assert re.fullmatch(ANSWER, message.content), message  # no marker, no reasoning
        assert whole.usage.completion_tokens == len(whole.choices[0].logprobs.content)  # reasoning's tokens too
        assert whole.usage.completion_tokens > len(backend.tokenizer.encode(message.content))
        parts = await streamed(sdk, **asked)
        assert (parts["reasoning"], parts["content"]) == (message.reasoning_content, message.content)
        assert parts["usage"].completion_tokens == whole.usage.completion_tokens


async def test_enable_thinking_false_closes_qwen3s_thinking(family_models, tmp_path):
    """Qwen3's template writes an empty, closed thinking block into the prompt: the answer has no
    reasoning, even text shaped like it."""
    async with serving("qwen3", family_models["qwen3"], tmp_path) as (sdk, backend):
        asked = {"model": "qwen3", "messages": ASK, "temperature": 0, "max_tokens": 60}
        forced = {"structured_outputs": {"grammar": THINKING["qwen3"]}}
        thinking = await sdk.chat.completions.create(extra_body=forced, **asked)
        switched_off = {**forced, "chat_template_kwargs": {"enable_thinking": False}}
        off = await sdk.chat.completions.create(extra_body=switched_off, **asked)
        assert thinking.choices[0].message.reasoning_content
        assert getattr(off.choices[0].message, "reasoning_content", None) is None
        assert off.choices[0].message.content.startswith("<think>")
        prompt = await backend.tokenize_prompt(GenerateRequest("r", messages=ASK, extra={
            "chat_template_kwargs": {"enable_thinking": False}}))
        assert backend.tokenizer.decode(prompt.ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


async def test_reasoning_effort_reaches_gpt_oss_and_is_refused_elsewhere(family_models, tmp_path):
    async with serving("gpt-oss", family_models["gpt-oss"], tmp_path) as (sdk, backend):
        answer = await sdk.chat.completions.create(model="gpt-oss", messages=ASK, max_tokens=2, reasoning_effort="high")
        assert answer.usage.completion_tokens > 0
        prompt = await backend.tokenize_prompt(GenerateRequest("r", messages=ASK, extra={"reasoning_effort": "high"}))
        assert "Reasoning: high" in backend.tokenizer.decode(prompt.ids)
        with pytest.raises(openai.BadRequestError) as bad:
            await sdk.chat.completions.create(model="gpt-oss", messages=ASK, max_tokens=2,
                                              reasoning_effort="extreme")
        assert bad.value.body["param"] == "reasoning_effort" and "low, medium, high" in bad.value.body["message"]
    (tmp_path / "qwen3").mkdir()
    async with serving("qwen3", family_models["qwen3"], tmp_path / "qwen3") as (sdk, _):
        with pytest.raises(openai.BadRequestError) as bad:  # its template has no such switch
            await sdk.chat.completions.create(model="qwen3", messages=ASK, max_tokens=2, reasoning_effort="high")
        assert bad.value.body["param"] == "reasoning_effort"


# -- the formats, without a model ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def chat_format(tokenizer, family: str | None) -> ChatFormat:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    if family:
        tokenizer.chat_template = (TEMPLATES / FAMILIES[family][0]).read_text()
    return ChatFormat.of(tokenizer)


def test_each_template_is_read_as_its_familys_format(tokenizer):
    for family, (_, form) in FAMILIES.items():
        found = chat_format(tokenizer, family)
        assert isinstance(found.tools, form) and found.native_tools, family
        assert found.reasons == (family in ("qwen3", "gpt-oss")), family
        assert found.reads_reasoning_effort == (family == "gpt-oss"), family
    plain = chat_format(tokenizer, None)  # SmolLM2's template speaks no tools: Hermes by system prompt
    assert isinstance(plain.tools, Hermes) and not plain.native_tools and not plain.reasons


# Hand-written answers in each format: (raw text, prompt tail, content, reasoning, calls).
STREAMS = {
    "qwen3": ('<think>\nThe user wants the time.\n</think>\n\nChecking. <tool_call>\n{"name": "get_time", '
              '"arguments": {"tz": "Europe/Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
              '{"city": "Paris"}}\n</tool_call>', "<|im_start|>assistant\n", "Checking. ",
              "\nThe user wants the time.\n",
              [("get_time", {"tz": "Europe/Paris"}), ("get_weather", {"city": "Paris"})]),
    "llama3.1": ('<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}', "", "", "",
                 [("get_time", {"tz": "UTC"})]),
    "mistral-nemo": ('Let me see.[TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "UTC"}}, {"name": '
                     '"get_weather", "arguments": {"city": "Oslo"}}]', "", "Let me see.", "",
                     [("get_time", {"tz": "UTC"}), ("get_weather", {"city": "Oslo"})]),
    "mistral-small-3.2": ('[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e'
                          '[ARGS]{"city": "Oslo"}', "", "", "",
                          [("get_time", {"tz": "UTC"}), ("get_weather", {"city": "Oslo"})]),
    "gpt-oss": ('<|channel|>analysis<|message|>Need the time.<|end|><|start|>assistant<|channel|>commentary '
                'to=functions.get_time <|constrain|>json<|message|>{"tz": "UTC"}<|call|>', "<|start|>assistant", "",
                "Need the time.", [("get_time", {"tz": "UTC"})]),
}
PLAIN_ANSWERS = {  # answers without a call: reasoning and text only
    "qwen3": ("<think>\nHm.\n</think>\n\nIt is noon.", "", "It is noon.", "\nHm.\n"),
    "qwen3 (the prompt opened <think>)": ("Hm.\n</think>\n\nIt is noon.", "<think>\n", "It is noon.", "Hm.\n"),
    "qwen3 (thinking switched off)": ("<think>x</think> It is noon.", "<think>\n\n</think>\n\n",
                                      "<think>x</think> It is noon.", ""),
    "llama3.1": ("It is {noon}.", "", "It is {noon}.", ""),
    "gpt-oss": ("<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final<|message|>It is noon.",
                "", "It is noon.", "Hm."),
}


def read(chat: ChatFormat, pieces: list[str], prompt_tail: str) -> tuple[str, str, list]:
    """A request's answer with tools, fed in `pieces`: (content, reasoning, calls)."""
    parser = chat.parser(True, prompt_tail)
    content = reasoning = ""
    calls = []
    for i, piece in enumerate(pieces):
        text, fields = parser.feed(piece, final=i == len(pieces) - 1)
        content += text
        reasoning += fields.get("reasoning_content", "")
        calls += [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in fields.get("tool_calls", [])]
    return content, reasoning, calls


def splits(text: str):
    """The text in two pieces at every character boundary, then one character at a time."""
    for at in range(len(text) + 1):
        yield [text[:at], text[at:]]
    yield list(text)


@pytest.mark.parametrize("family", sorted(STREAMS))
def test_each_parser_reads_a_stream_split_at_every_character(tokenizer, family):
    chat = chat_format(tokenizer, family)
    text, tail, content, reasoning, calls = STREAMS[family]
    for pieces in splits(text):
        assert read(chat, pieces, tail) == (content, reasoning, calls), pieces
    for name, (text, tail, content, reasoning) in PLAIN_ANSWERS.items():
        if name.split()[0] == family:
            for pieces in splits(text):
                assert read(chat, pieces, tail) == (content, reasoning, []), (name, pieces)
    assert (chat.parser(False, "") is None) == (not chat.reasons)  # no tools, no reasoning: nothing to read


def test_grammars_hold_each_family_to_its_format(tokenizer):
    grammars = Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id])

    def accepted(chat: ChatFormat, choice, text: str, prompt_tail: str = "") -> bool:
        constraint = chat.tool_constraint(ToolUse.of({"tools": TOOLS, "tool_choice": choice}), prompt_tail)
        state = grammars.matcher(constraint).state
        return state.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and state.is_accepting()

    for family in FAMILIES:
        chat = chat_format(tokenizer, family)
        accepts = functools.partial(accepted, chat)

        call = CALL[family].format(name="get_time", arguments='{"tz":"UTC"}')
        other = CALL[family].format(name="get_weather", arguments='{"city":"Oslo"}')
        assert accepts("required", call) and accepts(GET_TIME, call), family
        assert accepts("required", other) and not accepts(GET_TIME, other), family
        assert not accepts("required", call.replace("UTC", "Mars/Olympus")), family  # outside the schema
        assert not accepts("required", "It is noon."), family
        assert accepts("auto", call), family
        auto_text = "<|channel|>final<|message|>It is noon." if family == "gpt-oss" else "It is noon."
        assert accepts("auto", auto_text), family
    qwen3 = chat_format(tokenizer, "qwen3")  # a prompt that opened <think>: the call comes after closing it
    call = CALL["qwen3"].format(name="get_time", arguments='{"tz":"UTC"}')
    assert accepted(qwen3, GET_TIME, "</think>\n\n" + call, "<think>\n")
    assert not accepted(qwen3, GET_TIME, call, "<think>\n")
    # a JSON answer goes where the format puts the answer; a raw grammar holds the output as written
    json_answer = Constraint("json_object", source="response_format")
    for chat, tail, before in ((qwen3, "<think>\n", "</think>\n\n"), (qwen3, "", ""),
                               (chat_format(tokenizer, "gpt-oss"), "", "<|channel|>final<|message|>")):
        constraint = chat.answer_constraint(json_answer, tail)
        for text, accepts in ((before + '{"a":1}', True), ('x{"a":1}', False)):
            state = grammars.matcher(constraint).state
            assert (state.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
                    and state.is_accepting()) == accepts, (before, text)
    raw = Constraint("regex", "[a-z]+", "structured_outputs")
    assert chat_format(tokenizer, "gpt-oss").answer_constraint(raw, "") == raw


def test_a_marker_that_is_a_special_token_is_that_token(tokenizer):
    """With a tokenizer that has the family's markers as special tokens (a real Mistral's), the grammar
    asks for the token itself, and the output's text keeps it for the parser; the end-of-sequence
    token that ends the answer is still not text."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    tokenizer.chat_template = (TEMPLATES / FAMILIES["mistral-small-3.2"][0]).read_text()
    chat = ChatFormat.of(tokenizer)
    assert chat.keeps_special_tokens(tools=True) and not chat.keeps_special_tokens(tools=False)
    calls_id, args_id = tokenizer.convert_tokens_to_ids(["[TOOL_CALLS]", "[ARGS]"])
    grammars = Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    constraint = chat.tool_constraint(ToolUse.of({"tools": TOOLS, "tool_choice": GET_TIME}), "")
    as_tokens = [calls_id, *tokenizer.encode("get_time", add_special_tokens=False), args_id,
                 *tokenizer.encode('{"tz":"UTC"}', add_special_tokens=False)]
    assert grammars.matcher(constraint).state.consume_tokens(as_tokens)
    spelled = tokenizer.encode('[TOOL_CALLS]get_time[ARGS]{"tz":"UTC"}', add_special_tokens=False,
                               split_special_tokens=True)
    assert not grammars.matcher(constraint).state.consume_tokens(spelled)

    detokenizer = Detokenizer(tokenizer, tokenizer.encode("[INST]hi[/INST]"), skip_special_tokens=False)
    text = "".join(detokenizer.add(token)[0] for token in as_tokens)
    text += detokenizer.add(tokenizer.eos_token_id, final=True, stop_token=True)[0]
    assert text == '[TOOL_CALLS]get_time[ARGS]{"tz":"UTC"}'
    assert read(chat, [text], "") == ("", "", [("get_time", {"tz": "UTC"})])
