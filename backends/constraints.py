"""A request's output constraint, whichever way the client spelled it: OpenAI's `response_format`,
vLLM's `structured_outputs` or the `guided_*` fields it took before, TGI's or llama-server's
`grammar`. One parsed form
(`Constraint`) that the built-in engine compiles into token masks and that an adapter spells
the way its runtime reads it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from .base import InvalidRequest

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]

# vLLM's `StructuredOutputsParams` fields (vllm/sampling_params.py, 0.32) -> kind; its older
# top-level `guided_*` names take the same values.
_VLLM_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
               "json_object": "json_object"}
_GUIDED = {f"guided_{name}": kind for name, kind in _VLLM_KINDS.items()}
# `grammar`: TGI's `{"type": "json" | "regex" | "json_schema", "value": ...}` (its GrammarType), or
# llama-server's grammar text.
FIELDS = frozenset({"response_format", "structured_outputs", "grammar", *_GUIDED})


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
    if name == "grammar":
        return _tgi_grammar(value) if isinstance(value, dict) else _typed("grammar", value, name)
    return _typed(_GUIDED[name], value, name)


def _tgi_grammar(value: dict) -> Constraint:
    kind, inner = value.get("type"), value.get("value")
    if kind == "json":
        return _typed("json_schema", inner, "grammar.value")
    if kind == "json_schema" and isinstance(inner, dict):
        return _typed("json_schema", inner.get("schema"), "grammar.value.schema")
    if kind == "regex":
        return _typed("regex", inner, "grammar.value")
    raise InvalidRequest("grammar.type must be json, json_schema or regex", param="grammar")


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


def respelled(extra: dict[str, Any], runtime: str) -> dict[str, Any]:
    """`extra` with its structured-output fields in the spelling `runtime` reads: vLLM 0.32 only
    `structured_outputs` (its `guided_*` fields are gone, `vllm/sampling_params.py`); SGLang its
    top-level `json_schema`, `regex` and `ebnf` (`srt/entrypoints/openai/protocol.py`); llama-server
    `json_schema` and a GBNF `grammar` (`tools/server/server-common.cpp`); TGI its GrammarType as
    `grammar` (its OpenAPI spec: `/generate`'s parameter; its chat route reads the same object as
    `response_format`). OpenAI's `response_format` stays where the runtime reads it. Other
    runtimes get `extra` as it is. InvalidRequest naming the field where the runtime has no way
    to say what was asked."""
    spell = _SPELLINGS.get(runtime)
    given = {name for name in FIELDS if extra.get(name) not in (None, {}, False)}
    if spell is None or given <= _NATIVE[runtime]:
        return extra
    constraint = constraint_of(extra)
    kept = {key: value for key, value in extra.items() if key not in FIELDS}
    return kept | spell(constraint) if constraint else kept


def _vllm(c: Constraint) -> dict:
    name = next(name for name, kind in _VLLM_KINDS.items() if kind == c.kind)
    value = True if c.kind == "json_object" else json.loads(c.value) if c.kind in ("json_schema", "choice") else c.value
    return {"structured_outputs": {name: value}}


def _sglang(c: Constraint) -> dict:
    if c.kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if c.kind == "choice":
        return {"regex": _alternatives(c)}
    return {{"json_schema": "json_schema", "regex": "regex", "grammar": "ebnf"}[c.kind]: c.value}


def _llama_server(c: Constraint) -> dict:
    if c.kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if c.kind == "json_schema":
        return {"json_schema": json.loads(c.value)}
    if c.kind == "choice":
        return {"grammar": "root ::= " + " | ".join(json.dumps(choice) for choice in json.loads(c.value))}
    if c.kind == "grammar" and "::=" in c.value:
        return {"grammar": c.value}
    what = "a regex" if c.kind == "regex" else "a Lark grammar (only GBNF)"
    raise InvalidRequest(f"{c.source}: llama-server takes no {what}", param=c.source)


def _tgi(c: Constraint) -> dict:
    if c.kind in ("regex", "choice"):
        return {"grammar": {"type": "regex", "value": c.value if c.kind == "regex" else _alternatives(c)}}
    if c.schema is not None:
        return {"grammar": {"type": "json", "value": c.schema}}
    raise InvalidRequest(f"{c.source}: TGI takes no grammar but a JSON schema or a regex", param=c.source)


def _alternatives(c: Constraint) -> str:
    return "(" + "|".join(re.escape(choice) for choice in json.loads(c.value)) + ")"


_SPELLINGS = {"vllm": _vllm, "sglang": _sglang, "llama-server": _llama_server, "tgi": _tgi}
# What each runtime reads as it is: OpenAI's response_format (TGI's chat route reads its own shape).
_NATIVE = {"vllm": {"response_format", "structured_outputs"}, "sglang": {"response_format"},
           "llama-server": {"response_format"}, "tgi": set()}
