"""A request's output constraint, whichever way the client spelled it: OpenAI's `response_format`,
vLLM's `structured_outputs`, or the `guided_*` fields vLLM took before it. One parsed form
(`Constraint`) that the built-in engine compiles into token masks and that an adapter spells
the way its runtime reads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from .base import InvalidRequest

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]

# vLLM's `StructuredOutputsParams` fields (vllm/sampling_params.py, 0.32) -> kind; its older
# top-level `guided_*` names take the same values.
_VLLM_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
               "json_object": "json_object"}
_GUIDED = {f"guided_{name}": kind for name, kind in _VLLM_KINDS.items()}
FIELDS = frozenset({"response_format", "structured_outputs", *_GUIDED})


@dataclass(frozen=True)
class Constraint:
    """What the output must match. `value`: the JSON schema as JSON text, the regex, the grammar
    (Lark or GBNF), or the choices as a JSON list; empty for any JSON object."""

    kind: Kind
    value: str = ""
    source: str = field(default="", compare=False)  # the request field it came from

    @property
    def schema(self) -> dict | None:
        """The JSON schema, for the JSON kinds."""
        if self.kind == "json_object":
            return {"type": "object"}
        return json.loads(self.value) if self.kind == "json_schema" else None


def constraint_of(extra: dict[str, Any]) -> Constraint | None:
    """The request's constraint, or None; InvalidRequest naming the field when it is malformed or
    when two fields ask for one."""
    given = [name for name in FIELDS if extra.get(name) not in (None, {}, False)]
    if not given:
        return None
    if len(given) > 1:
        raise InvalidRequest(f"give one of {', '.join(sorted(given))}, not several", param=sorted(given)[1])
    name = given[0]
    value = extra[name]
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        if not isinstance(value, dict):
            raise InvalidRequest("structured_outputs must be an object", param=name)
        kinds = [key for key in _VLLM_KINDS if value.get(key) not in (None, False)]
        if len(kinds) != 1:
            raise InvalidRequest(f"structured_outputs must set exactly one of {', '.join(_VLLM_KINDS)}", param=name)
        return _typed(_VLLM_KINDS[kinds[0]], value[kinds[0]], f"structured_outputs.{kinds[0]}")
    return _typed(_GUIDED[name], value, name)


def _response_format(value: Any) -> Constraint | None:
    param = "response_format"
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object", source=param)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise InvalidRequest("response_format.json_schema must be an object with a `schema` object", param=param)
        # OpenAI: a json_schema without `schema` allows any JSON object.
        return Constraint("json_schema", json.dumps(spec.get("schema") or {"type": "object"}), param)
    raise InvalidRequest("response_format.type must be text, json_object or json_schema", param=param)


def _typed(kind: Kind, value: Any, name: str) -> Constraint:
    source = name.split(".")[0]
    if kind == "json_object":
        return Constraint("json_object", source=source)
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise InvalidRequest(f"{name} is not valid JSON: {exc}", param=source) from exc
        if not isinstance(value, dict):
            raise InvalidRequest(f"{name} must be a JSON object", param=source)
        return Constraint(kind, json.dumps(value), source)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise InvalidRequest(f"{name} must be a non-empty list of strings", param=source)
        return Constraint(kind, json.dumps(value), source)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{name} must be a non-empty string", param=source)
    return Constraint(kind, value, source)
