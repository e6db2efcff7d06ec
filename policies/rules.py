"""A small rules engine: declarative rules whose conditions are CEL expressions (the
`common-expression-language` package; never Python eval), checked when they are loaded.

A rules file declares the fields its conditions may read and their types, then the rules:

    fields: {runtime.id: string, workload.prefix_reuse: double, ...}
    rules:
      - id: maintenance-mode
        kind: exclude            # exclude | score | warn | note
        when: workload.new_deployment && !runtime.maintained
        reason: "{runtime.name} is in maintenance mode"
        cite: maintained         # a support-matrix cell whose source the report shows

Loading fails, naming the rule, on a syntax error, a field the file does not declare, a type
error against the declared types, a condition that is not a boolean, or a rule that can never
fire (a condition always false, or one an earlier exclusion already acts on)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

import cel
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

RULES = Path(__file__).parent / "rules"
SAMPLES = {"string": "", "int": 0, "double": 0.0, "bool": False, "list": [], "map": {}}
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_PATHS = re.compile(r"(?<![\w.])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(\s*\()?")
_BOUND = re.compile(r"\.(?:all|exists|exists_one|map|filter)\(\s*([A-Za-z_]\w*)\s*,")
_KEYWORDS = {"true", "false", "null", "in"}
_PLACEHOLDER = re.compile(r"\{([\w.]+)\}")


class RuleError(ValueError):
    """A rule that cannot be used; the message names the file, the rule and the problem."""


class Rule(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    kind: Literal["exclude", "score", "warn", "note"]
    when: str
    reason: str  # {field.path} placeholders are filled from the context
    score: float = 0.0  # for kind: score
    cite: str | None = None  # a support-matrix cell path, e.g. features.prefix_caching
    program: object = Field(default=None, exclude=True)


class RulesFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    fields: dict[str, Literal["string", "int", "double", "bool", "list", "map"]]
    rules: list[Rule]


@dataclass(frozen=True)
class Fired:
    rule: Rule
    reason: str


class RuleSet:
    def __init__(self, fields: dict[str, str], rules: list[Rule], name: str = "rules") -> None:
        self.fields, self.rules, self.name = fields, rules, name
        ids = [r.id for r in rules]
        if duplicated := sorted({i for i in ids if ids.count(i) > 1}):
            raise RuleError(f"{name}: rule ids used twice: {', '.join(duplicated)}")
        sample = nest({path: SAMPLES[kind] for path, kind in fields.items()})
        excluding: dict[str, str] = {}  # condition -> the exclude rule that acts on it first
        for rule in rules:
            self._check(rule, sample)
            condition = " ".join(rule.when.split())
            if condition in excluding:
                raise RuleError(f"{name}: rule {rule.id!r} is unreachable: rule {excluding[condition]!r} excludes "
                                "first on the same condition")
            if rule.kind == "exclude":
                excluding[condition] = rule.id

    @classmethod
    def load(cls, path: Path) -> RuleSet:
        try:
            data = RulesFile.model_validate(yaml.safe_load(path.read_text()))
        except (ValidationError, yaml.YAMLError) as exc:
            raise RuleError(f"{path.name}: {exc}") from exc
        return cls(data.fields, data.rules, path.name)

    def _check(self, rule: Rule, sample: dict) -> None:
        where = f"{self.name}: rule {rule.id!r}"
        try:
            rule.program = cel.compile(rule.when)
        except ValueError as exc:
            raise RuleError(f"{where}: {exc}") from exc
        for path in references(rule.when) | set(_PLACEHOLDER.findall(rule.reason)):
            if path not in self.fields and not any(f.startswith(path + ".") for f in self.fields):
                known = ", ".join(sorted(self.fields))
                raise RuleError(f"{where}: unknown field {path!r} (declared: {known})")
        try:
            result = rule.program.execute(sample)
        except (TypeError, RuntimeError, KeyError, ValueError) as exc:
            raise RuleError(f"{where}: type error in {rule.when!r}: {exc}") from exc
        if not isinstance(result, bool):
            raise RuleError(f"{where}: the condition must be a boolean, not {type(result).__name__}")
        if not references(rule.when) and result is False:
            raise RuleError(f"{where} is unreachable: its condition is always false")

    def evaluate(self, context: dict) -> list[Fired]:
        """The rules that fire on `context` (a nested dict holding every declared field)."""
        fired = []
        for rule in self.rules:
            try:
                matched = rule.program.execute(context)
            except (TypeError, RuntimeError, KeyError, ValueError) as exc:
                raise RuleError(f"{self.name}: rule {rule.id!r} failed on this input: {exc}") from exc
            if matched:
                fired.append(Fired(rule, render(rule.reason, context)))
        return fired


@cache
def named(name: str) -> RuleSet:
    """A shipped rules file by name (policies/rules/<name>.yaml), loaded and checked once."""
    path = RULES / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in RULES.glob("*.yaml")))
        raise RuleError(f"no rules file {name!r} in policies/rules (known: {known})")
    return RuleSet.load(path)


def references(expression: str) -> set[str]:
    """The field paths a CEL expression reads: dotted identifiers outside string literals, less
    function and method names and the variables macros bind."""
    text = _STRINGS.sub('""', expression)
    bound = set(_BOUND.findall(text))
    paths = set()
    for match in _PATHS.finditer(text):
        path, call = match[1], match[2]
        if call:  # f(...) or x.method(...): the receiver is the reference
            path = path.rpartition(".")[0]
        if path and path.split(".")[0] not in bound | _KEYWORDS:
            paths.add(path)
    return paths


def nest(flat: dict[str, object]) -> dict:
    """{"a.b": 1} -> {"a": {"b": 1}}"""
    out: dict = {}
    for path, value in flat.items():
        node = out
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def render(template: str, context: dict) -> str:
    def lookup(match: re.Match) -> str:
        value: object = context
        for part in match[1].split("."):
            value = value.get(part, "") if isinstance(value, dict) else ""
        return f"{value:g}" if isinstance(value, float) else str(value)

    return _PLACEHOLDER.sub(lookup, template)
