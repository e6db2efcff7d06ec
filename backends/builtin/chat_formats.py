"""The chat formats of the model families the engine serves: how each family writes tool calls and
reasoning, how a tool choice is enforced in that format, and how the output is read back into
OpenAI's `content`, `reasoning_content` and `tool_calls`.

The format is the one the model's chat template speaks, known by the markers the template mentions
(`FORMATS`, first match):

- gpt-oss harmony (`<|channel|>`): messages on channels; `analysis` is reasoning, `final` the answer,
  and a call is `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`;
- Mistral, tokenizers v11 and later (`[TOOL_CALLS]` and `[ARGS]`): `[TOOL_CALLS]NAME[ARGS]{...}`, repeated;
- Mistral, v3 tokenizers (`[TOOL_CALLS]`): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
- Hermes / Qwen (`<tool_call>`): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, repeated;
- Llama 3.1 / 3.2 (`<|python_tag|>` or their JSON-call instructions): `{"name": ..., "parameters": {...}}`
  as the whole answer, optionally after `<|python_tag|>`.

A template that speaks none of them gets the Hermes format through a system prompt (`tools.render`).
Besides harmony's analysis channel, `<think>...</think>` is reasoning where the template mentions
`<think>` (Qwen3, DeepSeek-R1): the answer starts with it, or the template opened it at the end of
the prompt; a prompt that ends with it closed (Qwen3's `enable_thinking: false`) has no reasoning.

`tool_choice` is enforced with an llguidance grammar in the format: `required` and a named function
make the answer the calls themselves (after closing a reasoning block the prompt opened); `auto`
leaves the answer free until the model opens a call, which must then be a valid one. A marker that
is one special token of the tokenizer is written in the grammar as that token (a model writes it as
one token, and a quoted string never matches a special token); elsewhere (a tokenizer without the
family's tokens) it is text, which works the same, spelled in pieces.
"""

from __future__ import annotations

import json
import random
import re
import string
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from backends.builtin.core.structured import JSON_OPTIONS
from backends.builtin.tools import Tool, ToolUse
from backends.constraints import Constraint

PROMPT_TAIL_TOKENS = 16  # the prompt's last tokens, decoded, say whether it left a reasoning block open


# -- grammars -------------------------------------------------------------------------------------
class Lark:
    """One llguidance Lark grammar, its markers written as the tokenizer knows them."""

    def __init__(self, special_tokens: Mapping[str, int]) -> None:
        self.special_tokens = special_tokens
        self.rules: list[str] = []

    def seq(self, *parts: str) -> str:
        """Markers and text in order: a special token by its id, anything else as a string."""
        return " ".join(f"<[{self.special_tokens[part]}]>" if part in self.special_tokens else json.dumps(part)
                        for part in parts if part)

    def rule(self, body: str) -> str:
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def text_until(self, marker: str) -> str:
        """Free text ended by the first `marker`."""
        if marker in self.special_tokens:  # free text cannot hold a special token
            return f"TEXT {self.seq(marker)}"
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}[lazy]: TEXT {json.dumps(marker)}")
        return name

    def triggered(self, trigger: str, then: str, repeat: str) -> str:
        """Free text in which `trigger`, once written, must go on as `then`; `repeat` is * or ?."""
        if trigger in self.special_tokens:
            return f"TEXT ({self.seq(trigger)} {then} TEXT){repeat}"
        return f"({self.text_until(trigger)} {then}){repeat} TEXT"

    def constraint(self, start: str, source: str) -> Constraint:
        lines = ["%llguidance {}", f"start: {start}", *self.rules, "TEXT: /(.|\\n)*/"]
        return Constraint("grammar", "\n".join(lines) + "\n", source)


def arguments(tool: Tool) -> str:
    """A call's arguments: JSON of the function's schema, compact as every structured output here."""
    return f"%json {json.dumps({**tool.parameters, 'x-guidance': JSON_OPTIONS})}"


# -- parsing helpers ---------------------------------------------------------------------------------
@dataclass
class Parsed:
    """What a piece of output holds: visible text, reasoning text, completed calls (name, arguments)."""

    content: str = ""
    reasoning: str = ""
    calls: list[tuple[str, dict]] = field(default_factory=list)

    def add(self, other: Parsed) -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        self.calls += other.calls


def split(text: str, markers: tuple[str, ...], final: bool) -> tuple[str, str | None, str]:
    """(text before the first marker, that marker, text after it); with no marker, the end of
    `text` that may be a marker's beginning is held back as the third part, unless `final`."""
    hits = [(text.find(marker), -len(marker), marker) for marker in markers if marker in text]
    if hits:
        at, _, marker = min(hits)  # the earliest; the longest of those that begin there
        return text[:at], marker, text[at + len(marker):]
    keep = 0 if final else max(partial_prefix(text, marker) for marker in markers)
    return text[:len(text) - keep], None, text[len(text) - keep:]


def partial_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


def leading_json(text: str) -> tuple[object, str] | None:
    """The JSON value `text` begins with (after whitespace) and the text after it; None until it is complete."""
    body = text.lstrip()
    if "}" not in body and "]" not in body:  # no object or array is complete yet: spare the decoder
        return None
    try:
        value, end = json.JSONDecoder().raw_decode(body)
    except ValueError:
        return None
    return value, body[end:]


def as_call(value: object, arguments_key: str = "arguments") -> tuple[str, dict] | None:
    """(name, arguments) of a decoded `{"name": ..., arguments_key: {...}}`; None for anything else."""
    if isinstance(value, dict) and isinstance(value.get("name"), str) and isinstance(value.get(arguments_key), dict):
        return value["name"], value[arguments_key]
    return None


class Parser:
    """A format's reader of streamed text: `feed` each piece; `final` with the last."""

    def __init__(self) -> None:
        self.pending = ""  # text not yet attributed: a marker's beginning, an unfinished call
        self.separated = False  # just past a call or a reasoning block, where whitespace only separates

    def feed(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError

    def text(self, out: Parsed, text: str) -> None:
        if self.separated:
            text = text.lstrip()
            self.separated = not text
        out.content += text

    def call(self, out: Parsed, name: str, arguments: dict) -> None:
        out.calls.append((name, arguments))
        self.separated = True


class PlainText(Parser):
    def feed(self, text: str, final: bool) -> Parsed:
        return Parsed(content=text)


# -- reasoning in <think> tags -----------------------------------------------------------------------
@dataclass(frozen=True)
class ThinkTags:
    open: str = "<think>"
    close: str = "</think>"
    separator: str = "\n\n"  # what the families write between the closed block and the answer

    def state(self, prompt_tail: str) -> str:
        """Where the prompt leaves the answer: in reasoning the template opened, past a block it
        closed (thinking switched off), or free to open one."""
        tail = prompt_tail.rstrip()
        return "open" if tail.endswith(self.open) else "closed" if tail.endswith(self.close) else "start"


class ThinkParser(Parser):
    """Reasoning up to `</think>`, where the answer opens `<think>` or the prompt did."""

    def __init__(self, tags: ThinkTags, state: str) -> None:
        super().__init__()
        self.tags = tags
        self.state = {"open": "reasoning", "closed": "content", "start": "start"}[state]

    def feed(self, text: str, final: bool) -> Parsed:
        self.pending += text
        out = Parsed()
        if self.state == "start":
            begun = self.pending.lstrip()
            if begun.startswith(self.tags.open):
                self.state, self.pending = "reasoning", begun[len(self.tags.open):]
            elif final or not self.tags.open.startswith(begun):
                self.state = "content"
            else:
                return out
        if self.state == "reasoning":
            out.reasoning, marker, self.pending = split(self.pending, (self.tags.close,), final)
            if marker is None:
                return out
            self.state, self.separated = "content", True
        self.text(out, self.pending)
        self.pending = ""
        return out


# -- tool-call formats ---------------------------------------------------------------------------------
class ToolFormat:
    """How one family writes tool calls: its grammar for a tool choice, and its parser."""

    mentions: tuple[str, ...] = ()  # what a chat template that speaks this format mentions
    markers: tuple[str, ...] = ()  # special tokens in the family's tokenizer
    opener = ""  # what begins a call (or the calls) in free text
    separator = ""  # between two calls of one answer
    parallel = True  # may one answer hold several calls
    answer_header: tuple[str, ...] = ()  # what a plain answer begins with

    def call(self, lark: Lark, tool: Tool) -> str:
        return f"{lark.seq(self.opener)} {self.after_opener(lark, tool)}"

    def after_opener(self, lark: Lark, tool: Tool) -> str:
        raise NotImplementedError

    def required(self, lark: Lark, tools: list[Tool], several: bool) -> str:
        """The answer as calls only."""
        call = lark.rule(" | ".join(self.call(lark, tool) for tool in tools))
        return f"{call} ({lark.seq(self.separator)} {call})*" if several else call

    def auto(self, lark: Lark, tools: list[Tool], several: bool) -> str:
        """Free text, in which a call, once opened, must be a valid one."""
        then = lark.rule(" | ".join(self.after_opener(lark, tool) for tool in tools))
        return lark.triggered(self.opener, then, "*" if several else "?")

    def parser(self) -> Parser:
        raise NotImplementedError

    def call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def history(self, message: dict) -> dict:
        """An earlier message as the family's template takes it."""
        return message


class Hermes(ToolFormat):
    mentions = ("<tool_call>",)
    opener, closer, separator = "<tool_call>", "</tool_call>", "\n"
    markers = (opener, closer)
    tail = "}\n"  # the call's end before the closer

    def after_opener(self, lark: Lark, tool: Tool) -> str:
        head = '\n{"name": ' + json.dumps(tool.name) + ', "arguments": '
        return f"{lark.seq(head)} {arguments(tool)} {lark.seq(self.tail, self.closer)}"

    def parser(self) -> Parser:
        return HermesParser(self)

    def written(self, function: dict) -> str:
        """An earlier call, for a template that does not write calls itself."""
        call = json.dumps({"name": function["name"], "arguments": function["arguments"]})
        return f"{self.opener}\n{call}\n{self.closer}"


class HermesParser(Parser):
    def __init__(self, form: Hermes) -> None:
        super().__init__()
        self.form, self.in_call = form, False

    def feed(self, text: str, final: bool) -> Parsed:
        self.pending += text
        out = Parsed()
        while True:
            if not self.in_call:
                before, marker, self.pending = split(self.pending, (self.form.opener,), final)
                self.text(out, before)
                if marker is None:
                    return out
                self.in_call = True
            end = self.pending.find(self.form.closer)
            if end < 0:
                if final:  # an unfinished call (max_tokens): left as text
                    self.text(out, self.form.opener + self.pending)
                    self.pending = ""
                return out
            body, self.pending, self.in_call = self.pending[:end], self.pending[end + len(self.form.closer):], False
            try:
                call = as_call(json.loads(body))
            except ValueError:
                call = None
            if call:
                self.call(out, *call)
            else:
                self.text(out, self.form.opener + body + self.form.closer)


TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"  # Mistral's control tokens
MISTRAL_ID = string.ascii_letters + string.digits
MISTRAL_ID_LENGTH = 9  # Mistral's templates refuse any other call id (mistral-common's validator)


class Mistral(ToolFormat):
    """What Mistral's formats share: `[TOOL_CALLS]` opens the calls, and call ids are 9 letters or digits."""

    opener = TOOL_CALLS

    def call_id(self) -> str:
        return "".join(random.choices(MISTRAL_ID, k=MISTRAL_ID_LENGTH))

    def history(self, message: dict) -> dict:
        """Other ids cut to their last nine characters, as vLLM does for Mistral's tokenizer."""
        if message.get("tool_calls"):
            return {**message, "tool_calls": [{**call, "id": _mistral_id(call.get("id"))}
                                              for call in message["tool_calls"]]}
        if message.get("role") == "tool" and "tool_call_id" in message:
            return {**message, "tool_call_id": _mistral_id(message["tool_call_id"])}
        return message


def _mistral_id(call_id):
    return call_id[-MISTRAL_ID_LENGTH:] if isinstance(call_id, str) else call_id


class MistralArray(Mistral):
    """v3 tokenizers (Mistral 7B v0.3, Nemo): the answer's calls in one JSON array."""

    mentions = markers = (TOOL_CALLS,)
    separator = ", "

    def item(self, lark: Lark, tool: Tool) -> str:
        head = '{"name": ' + json.dumps(tool.name) + ', "arguments": '
        return f"{lark.seq(head)} {arguments(tool)} {lark.seq('}')}"

    def array(self, lark: Lark, tools: list[Tool], several: bool) -> str:
        item = lark.rule(" | ".join(self.item(lark, tool) for tool in tools))
        more = f" ({lark.seq(self.separator)} {item})*" if several else ""
        return f"{lark.seq('[')} {item}{more} {lark.seq(']')}"

    def required(self, lark: Lark, tools: list[Tool], several: bool) -> str:
        return f"{lark.seq(self.opener)} {self.array(lark, tools, several)}"

    def auto(self, lark: Lark, tools: list[Tool], several: bool) -> str:
        return lark.triggered(self.opener, self.array(lark, tools, several), "?")

    def parser(self) -> Parser:
        return MistralArrayParser()


class MistralArrayParser(Parser):
    def __init__(self) -> None:
        super().__init__()
        self.state = "content"

    def feed(self, text: str, final: bool) -> Parsed:
        self.pending += text
        out = Parsed()
        if self.state == "content":
            before, marker, self.pending = split(self.pending, (TOOL_CALLS,), final)
            self.text(out, before)
            if marker is None:
                return out
            self.state = "calls"
        if self.state == "calls":
            found = leading_json(self.pending)
            if found is None and not final:
                return out
            calls = [as_call(item) for item in found[0]] if found and isinstance(found[0], list) else []
            if calls and all(calls):
                for call in calls:
                    self.call(out, *call)
                self.pending = found[1]
            else:  # not calls after all: left as text
                self.pending = TOOL_CALLS + self.pending
            self.state = "after"
        self.text(out, self.pending)
        self.pending = ""
        return out


class MistralNamed(Mistral):
    """v11 tokenizers and later (Mistral Small 3.2, Magistral, Devstral): each call its own
    `[TOOL_CALLS]NAME[ARGS]{...}` (some templates write `[CALL_ID]ID` before `[ARGS]`)."""

    mentions = (ARGS,)
    markers = (TOOL_CALLS, ARGS, CALL_ID)

    def after_opener(self, lark: Lark, tool: Tool) -> str:
        return f"{lark.seq(tool.name, ARGS)} {arguments(tool)}"

    def parser(self) -> Parser:
        return MistralNamedParser()


class MistralNamedParser(Parser):
    def __init__(self) -> None:
        super().__init__()
        self.state, self.name = "content", ""

    def feed(self, text: str, final: bool) -> Parsed:
        self.pending += text
        out = Parsed()
        while True:
            if self.state == "content":
                before, marker, self.pending = split(self.pending, (TOOL_CALLS,), final)
                self.text(out, before)
                if marker is None:
                    return out
                self.state = "name"
            if self.state == "name":
                name, marker, rest = split(self.pending, (ARGS,), final)
                if marker is None:
                    if final:
                        self.text(out, TOOL_CALLS + self.pending)
                        self.pending = ""
                    return out
                self.name, self.pending, self.state = name.split(CALL_ID)[0], rest, "arguments"
            found = leading_json(self.pending)
            if found is None or not isinstance(found[0], dict):
                if final:
                    self.text(out, f"{TOOL_CALLS}{self.name}{ARGS}{self.pending}")
                    self.pending = ""
                return out
            self.call(out, self.name, found[0])
            self.pending, self.state = found[1], "content"


PYTHON_TAG = "<|python_tag|>"


class Llama3Json(ToolFormat):
    """Llama 3.1 / 3.2: one call, as the whole answer."""

    mentions = (PYTHON_TAG, '"parameters": dictionary of argument name')
    markers = (PYTHON_TAG,)
    parallel = False

    def call(self, lark: Lark, tool: Tool) -> str:
        head = '{"name": ' + json.dumps(tool.name) + ', "parameters": '
        return f"{lark.seq(head)} {arguments(tool)} {lark.seq('}')}"

    def auto(self, lark: Lark, tools: list[Tool], several: bool) -> str:
        call = lark.rule(" | ".join(self.call(lark, tool) for tool in tools))
        lark.rules.append("PLAIN: /([^{](.|\\n)*)?/")  # an answer that does not open a call
        return f"{lark.seq(PYTHON_TAG)}? {call} | PLAIN"

    def parser(self) -> Parser:
        return Llama3Parser()


class Llama3Parser(Parser):
    def __init__(self) -> None:
        super().__init__()
        self.state = "start"

    def feed(self, text: str, final: bool) -> Parsed:
        self.pending += text
        out = Parsed()
        if self.state == "start":
            if self.pending.startswith((PYTHON_TAG, "{")):
                self.state = "calls"
                self.pending = self.pending.removeprefix(PYTHON_TAG)
            elif final or not PYTHON_TAG.startswith(self.pending):
                self.state = "content"
            else:
                return out
        if self.state == "content":
            self.text(out, self.pending)
            self.pending = ""
            return out
        if final:  # calls are read whole: `{...}`, or several joined by `;` (vLLM's llama3_json)
            calls, rest = [], self.pending
            while (found := leading_json(rest)) and (call := as_call(found[0], "parameters")
                                                      or as_call(found[0])):
                calls.append(call)
                rest = found[1].lstrip().removeprefix(";")
            if calls and not rest.strip():
                for call in calls:
                    self.call(out, *call)
            else:
                self.text(out, self.pending)
            self.pending = ""
        return out


class Harmony(ToolFormat):
    """gpt-oss: one call per answer, on the commentary channel; the analysis channel is reasoning."""

    mentions = ("<|channel|>",)
    markers = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>")
    parallel = False
    answer_header = ("<|channel|>", "final", "<|message|>")

    def call(self, lark: Lark, tool: Tool) -> str:
        header = lark.seq("<|channel|>", f"commentary to=functions.{tool.name} ", "<|constrain|>", "json",
                          "<|message|>")
        return f"{header} {arguments(tool)} {lark.seq('<|call|>')}"

    def auto(self, lark: Lark, tools: list[Tool], several: bool) -> str:
        analysis = lark.rule(f"{lark.seq('<|channel|>', 'analysis', '<|message|>')} {lark.text_until('<|end|>')} "
                             f"{lark.seq('<|start|>', 'assistant')}")
        final = f"{lark.seq(*self.answer_header)} TEXT"
        return f"{analysis}* ({final} | {self.required(lark, tools, several=False)})"

    def parser(self) -> Parser:
        return HarmonyParser()

    def history(self, message: dict) -> dict:
        """Earlier reasoning goes where the template reads it: `thinking`."""
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        return {**message, "thinking": reasoning} if reasoning else message


class HarmonyParser(Parser):
    """Harmony messages: `[<|start|>assistant]<|channel|>NAME[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY`,
    a body ended by `<|end|>`, `<|call|>`, `<|return|>` (the last two end the answer: the engine shows no
    end-of-answer token, so the text ends there instead) or the next message's header. Text outside any
    message is content."""

    OPENERS = ("<|start|>", "<|channel|>")
    ENDS = ("<|end|>", "<|call|>", "<|return|>", *OPENERS)

    def __init__(self) -> None:
        super().__init__()
        self.state, self.channel, self.recipient = "between", "", ""

    def feed(self, text: str, final: bool) -> Parsed:
        self.pending += text
        out = Parsed()
        while True:
            if self.state == "between":
                before, marker, rest = split(self.pending, self.OPENERS, final)
                self.text(out, before)
                if marker is None:
                    self.pending = rest
                    return out
                self.state, self.pending = "header", marker + rest
            if self.state == "header":
                header, marker, rest = split(self.pending, ("<|message|>",), final)
                if marker is None:
                    if final:  # a header cut short has nothing to show
                        self.pending = ""
                    return out
                channel = re.search(r"<\|channel\|>\s*(\w+)", header)
                recipient = re.search(r"to=([^\s<]+)", header)
                self.channel = channel.group(1) if channel else ""
                self.recipient = recipient.group(1) if recipient else ""
                self.state, self.pending = "body", rest
            body, marker, rest = split(self.pending, self.ENDS, final)
            if self.recipient.startswith("functions."):
                if marker is None and not final:
                    return out  # a call's arguments are read whole
                try:
                    arguments = json.loads(body)
                except ValueError:
                    arguments = None
                if isinstance(arguments, dict):
                    self.call(out, self.recipient.removeprefix("functions."), arguments)
                else:
                    self.text(out, body)
            elif self.channel == "analysis":
                out.reasoning += body
            else:  # the final answer, or a preamble to the user on the commentary channel
                self.text(out, body)
            if marker is None:
                self.pending = rest
                return out
            self.state = "between"
            self.pending = (marker if marker in self.OPENERS else "") + rest


HERMES = Hermes()
HARMONY = Harmony()
FORMATS = (HARMONY, MistralNamed(), MistralArray(), HERMES, Llama3Json())  # the first a template mentions
THINK_TAGS = ThinkTags()


# -- a model's format --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChatFormat:
    """The tool and reasoning formats a model's chat template speaks, and its tokenizer's special tokens."""

    tools: ToolFormat
    native_tools: bool  # the template writes tools and calls itself
    thinking: ThinkTags | None
    reads_reasoning_effort: bool  # gpt-oss's switch
    special_tokens: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, tokenizer) -> ChatFormat:
        template = getattr(tokenizer, "chat_template", None)
        template = template if isinstance(template, str) else ""
        spoken = next((form for form in FORMATS if any(mention in template for mention in form.mentions)), None)
        thinking = THINK_TAGS if spoken is not HARMONY and THINK_TAGS.open in template else None
        special = {token.content: token_id for token_id, token in getattr(tokenizer, "added_tokens_decoder", {}).items()
                   if token.special}
        return cls(spoken or HERMES, spoken is not None, thinking, "reasoning_effort" in template, special)

    @property
    def reasons(self) -> bool:
        return self.tools is HARMONY or self.thinking is not None

    def keeps_special_tokens(self, tools: bool) -> bool:
        """Whether the output's text must show special tokens: where the parser reads markers that
        this tokenizer has as special tokens (which text would otherwise leave out)."""
        markers = (self.tools.markers if tools or self.tools is HARMONY else ()) + \
            ((self.thinking.open, self.thinking.close) if self.thinking else ())
        return any(marker in self.special_tokens for marker in markers)

    def parser(self, tools: bool, prompt_tail: str) -> OutputParser | None:
        """The reader of one choice's output; None where there is nothing to read."""
        if self.tools is HARMONY:
            return OutputParser(self.tools.parser(), None, self.tools)
        if not tools and self.thinking is None:
            return None
        thinking = ThinkParser(self.thinking, self.thinking.state(prompt_tail)) if self.thinking else None
        return OutputParser(self.tools.parser() if tools else PlainText(), thinking, self.tools)

    def answer_prefix(self, prompt_tail: str) -> tuple[str, ...]:
        """What a constrained answer starts with: the close of a reasoning block the prompt opened."""
        if self.thinking and self.thinking.state(prompt_tail) == "open":
            return self.thinking.close, self.thinking.separator
        return ()

    def tool_constraint(self, use: ToolUse, prompt_tail: str) -> Constraint:
        lark = Lark(self.special_tokens)
        several = use.parallel and self.tools.parallel
        if use.choice == "auto":
            return lark.constraint(self.tools.auto(lark, list(use.tools), several), "tools")
        tools = [tool for tool in use.tools if use.choice in ("required", tool.name)]
        body = self.tools.required(lark, tools, several and use.choice == "required")
        return lark.constraint(f"{lark.seq(*self.answer_prefix(prompt_tail))} {body}", "tools")

    def answer_constraint(self, constraint: Constraint, prompt_tail: str) -> Constraint:
        """A JSON output placed where the format puts the answer: after a reasoning block the prompt
        opened, on harmony's final channel. Other constraints hold the raw output as written."""
        prefix = self.answer_prefix(prompt_tail) + self.tools.answer_header
        if constraint.schema is None or not prefix:
            return constraint
        lark = Lark(self.special_tokens)
        schema = {**constraint.schema, "x-guidance": JSON_OPTIONS}
        return lark.constraint(f"{lark.seq(*prefix)} %json {json.dumps(schema)}", constraint.source)


class OutputParser:
    """One choice's output read as it streams: visible text, and `reasoning_content` and
    `tool_calls` for the chunk's delta."""

    def __init__(self, tools: Parser, thinking: ThinkParser | None, form: ToolFormat) -> None:
        self.tools, self.thinking, self.form = tools, thinking, form
        self.calls = 0

    def feed(self, text: str, final: bool) -> tuple[str, dict]:
        out = Parsed()
        if self.thinking:
            thought = self.thinking.feed(text, final)
            out.reasoning, text = thought.reasoning, thought.content
        out.add(self.tools.feed(text, final))
        fields: dict = {}
        if out.reasoning:
            fields["reasoning_content"] = out.reasoning
        if out.calls:
            fields["tool_calls"] = [
                {"index": self.calls + i, "id": self.form.call_id(), "type": "function",
                 "function": {"name": name, "arguments": json.dumps(arguments)}}
                for i, (name, arguments) in enumerate(out.calls)]
            self.calls += len(out.calls)
        return out.content, fields
