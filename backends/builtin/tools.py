"""Tool calls for the built-in engine, in the Hermes / Qwen format that ChatML models are trained on:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The tools reach the model through its chat template where the template speaks that format (it
mentions `<tool_call>`); otherwise through a system prompt that lists them in `<tools>` and
asks for that format (Qwen 2.5's own wording), with earlier calls and tool results written back
the same way. `tool_choice` is enforced with the structured-output machinery: `required` and a
named function make the output a sequence of calls; `auto` leaves text free until the model
writes `<tool_call>`, after which the call must be one of the functions with arguments that
match its schema (a lazy trigger). So arguments always parse against the function's schema.
`ToolCallParser` turns the text back into OpenAI `tool_calls`, holding back text that may be the
start of a call.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from backends.base import InvalidRequest
from backends.constraints import Constraint

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# Compact arguments (a small model left free to indent loops on whitespace).
_ARGUMENTS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict


@dataclass(frozen=True)
class ToolUse:
    """A request's tools and how it asks for them: `choice` is auto, required or a tool's name."""

    tools: tuple[Tool, ...]
    choice: str
    parallel: bool = True

    @classmethod
    def of(cls, extra: dict) -> ToolUse | None:
        """From OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`; None where no tool may be
        called (none given, or `tool_choice: none`); InvalidRequest naming the field otherwise."""
        raw, choice = extra.get("tools"), extra.get("tool_choice")
        if not raw:
            if choice not in (None, "none"):
                raise InvalidRequest("tool_choice needs tools", param="tool_choice")
            return None
        if not isinstance(raw, list):
            raise InvalidRequest("tools must be a list of functions", param="tools")
        tools = tuple(_tool(item, i) for i, item in enumerate(raw))
        names = [tool.name for tool in tools]
        if len(set(names)) != len(names):
            raise InvalidRequest("tools have the same name twice", param="tools")
        if choice is None or choice == "auto":
            choice = "auto"
        elif choice == "none":
            return None
        elif isinstance(choice, dict) and choice.get("type") == "function":
            name = (choice.get("function") or {}).get("name")
            if name not in names:
                raise InvalidRequest(f"tool_choice names {name!r}, which is not among the tools "
                                     f"({', '.join(names)})", param="tool_choice")
            choice = name
        elif choice != "required":
            raise InvalidRequest("tool_choice must be none, auto, required or {\"type\": \"function\", "
                                 "\"function\": {\"name\": ...}}", param="tool_choice")
        return cls(tools, choice, extra.get("parallel_tool_calls") is not False)

    @property
    def constraint(self) -> Constraint:
        """The grammar that enforces the choice: calls only (required, named), or free text in
        which a call, once begun, must be a valid one (auto)."""
        if self.choice == "auto":
            tags = " | ".join(f"call_{i}" for i in range(len(self.tools)))
            repeat = "*" if self.parallel else "?"
            lines = ["%llguidance {}", f"start: ({tags}){repeat} tail", "tail: TEXT", "TEXT: /(.|\\n)*/"]
            for i, tool in enumerate(self.tools):
                lines.append(f"call_{i}_trigger[lazy]: TEXT {json.dumps(OPEN)}")
                lines.append(f"call_{i}: call_{i}_trigger {_call(tool, opened=True)}")
        else:
            tools = [tool for tool in self.tools if self.choice in ("required", tool.name)]
            calls = " | ".join(f"call_{i}" for i in range(len(tools)))
            lines = ["%llguidance {}", "start: call (\"\\n\" call)*" if self.parallel and self.choice == "required"
                     else "start: call", f"call: {calls}"]
            lines += [f"call_{i}: {_call(tool)}" for i, tool in enumerate(tools)]
        return Constraint("grammar", "\n".join(lines) + "\n", "tools")

    def system_prompt(self) -> str:
        """Qwen 2.5's tool instructions, for a template that does not render tools itself."""
        listed = "\n".join(json.dumps({"type": "function", "function": {
            "name": tool.name, "description": tool.description, "parameters": tool.parameters}}) for tool in self.tools)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n"
                f"<tools>\n{listed}\n</tools>\n\n"
                "For each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _tool(item, index: int) -> Tool:
    function = item.get("function") if isinstance(item, dict) and item.get("type") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise InvalidRequest(f"tools[{index}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                             param="tools")
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise InvalidRequest(f"tools[{index}].function.parameters must be a JSON schema object", param="tools")
    return Tool(function["name"], str(function.get("description") or ""), parameters)


def _call(tool: Tool, opened: bool = False) -> str:
    """One call of `tool` in Lark: fixed text around the arguments' JSON schema."""
    begin = ("" if opened else OPEN) + '\n{"name": ' + json.dumps(tool.name) + ', "arguments": '
    end = "}\n" + CLOSE
    schema = {**tool.parameters, "x-guidance": _ARGUMENTS}
    return f"{json.dumps(begin)} %json {json.dumps(schema)} {json.dumps(end)}"


def render(messages: list[dict], tool_use: ToolUse | None, template_speaks_tools: bool) -> tuple[list[dict], dict]:
    """The messages and template arguments that put tools, earlier calls and their results before
    the model: the template's own way where it has one, else the system-prompt convention."""
    if template_speaks_tools:
        native = [_with_argument_objects(m) for m in messages]
        return native, ({"tools": [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.parameters}} for t in tool_use.tools]}
            if tool_use else {})
    rendered = []
    for message in messages:
        role = message.get("role")
        if role == "tool":
            rendered.append({"role": "user", "content": f"<tool_response>\n{message.get('content') or ''}\n"
                                                        "</tool_response>"})
        elif role == "assistant" and message.get("tool_calls"):
            functions = [call["function"] for call in _earlier_calls(message)]
            calls = "\n".join(f"{OPEN}\n{json.dumps({'name': f['name'], 'arguments': f['arguments']})}\n{CLOSE}"
                               for f in functions)
            rendered.append({"role": "assistant", "content": "\n".join(filter(None, [message.get("content"), calls]))})
        else:
            rendered.append({k: v for k, v in message.items() if k in ("role", "content")})
    if tool_use:
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {"role": "system", "content": f"{rendered[0]['content']}\n\n{tool_use.system_prompt()}"}
        else:
            rendered.insert(0, {"role": "system", "content": tool_use.system_prompt()})
    return rendered, {}


def _earlier_calls(message: dict) -> list[dict]:
    """An assistant message's `tool_calls`, their arguments as objects (OpenAI sends them as JSON
    strings; templates read objects); refused, as the client's, where malformed."""
    calls = message["tool_calls"]
    if not isinstance(calls, list) or not all(
            isinstance(call, dict) and isinstance(call.get("function"), dict)
            and isinstance(call["function"].get("name"), str) for call in calls):
        raise InvalidRequest('an assistant message\'s tool_calls must be a list of {"type": "function", '
                             '"function": {"name": ..., "arguments": ...}}', param="messages")
    return [{**call, "function": {**call["function"], "arguments": _arguments(call["function"])}} for call in calls]


def _arguments(function: dict):
    arguments = function.get("arguments") or "{}"
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        raise InvalidRequest("an assistant tool call's arguments are not JSON", param="messages") from None


def _with_argument_objects(message: dict) -> dict:
    """HF templates read a call's arguments as an object."""
    return {**message, "tool_calls": _earlier_calls(message)} if message.get("tool_calls") else message


class ToolCallParser:
    """Streamed text in, plain text and completed OpenAI tool calls out."""

    def __init__(self) -> None:
        self.pending = ""  # text that may be (the start of) a call
        self.calls = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        self.pending += text
        out, calls = [], []
        while True:
            start = self.pending.find(OPEN)
            if start < 0:
                keep = 0 if final else _partial_prefix(self.pending, OPEN)
                out.append(self.pending[:len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
                break
            out.append(self.pending[:start])
            end = self.pending.find(CLOSE, start)
            if end < 0:
                self.pending = self.pending[start:]
                if final:  # an unfinished call (max_tokens): left as text
                    out.append(self.pending)
                    self.pending = ""
                break
            body = self.pending[start + len(OPEN):end]
            self.pending = self.pending[end + len(CLOSE):]
            call = _parsed(body)
            if call is None:
                out.append(f"{OPEN}{body}{CLOSE}")
                continue
            calls.append({"index": self.calls, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}})
            self.calls += 1
        text = "".join(out)
        return ("" if self.calls and not text.strip() else text), calls  # no blank content beside calls


def _parsed(body: str) -> dict | None:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments"), dict):
        return call
    return None


def _partial_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0
