"""The tools a chat request offers and how they reach the model: through its chat template where the
template speaks a tool format (`chat_formats`), else through a system prompt that lists them in
`<tools>` and asks for the Hermes format (Qwen 2.5's own wording), with earlier calls and tool
results written back the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from backends.base import InvalidRequest

if TYPE_CHECKING:
    from backends.builtin.chat_formats import ChatFormat


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


def render(messages: list[dict], tool_use: ToolUse | None, chat_format: ChatFormat) -> tuple[list[dict], dict]:
    """The messages and template arguments that put tools, earlier calls and their results before
    the model: the template's own way where it has one, else the system-prompt convention."""
    if chat_format.native_tools:
        native = [chat_format.tools.history(_for_template(m)) for m in messages]
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
            calls = "\n".join(chat_format.tools.written(call["function"]) for call in _earlier_calls(message))
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


def _for_template(message: dict) -> dict:
    """A message as HF templates read it: text content (a call's message may have none) and each
    call's arguments as an object."""
    message = {**message, "content": message.get("content") or ""}
    return {**message, "tool_calls": _earlier_calls(message)} if message.get("tool_calls") else message
