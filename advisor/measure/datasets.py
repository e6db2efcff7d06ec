"""Benchmark workloads, generated from a seed or replayed from a trace.

Every workload is a list of conversations; a single request is a one-turn conversation. The
prompt of turn k is the shared prefix, then every earlier turn's text and the reply the target
actually gave, then turn k's text: multi-turn traffic carries its history, as chat clients do.
Prompts are plain text, so every target (OpenAI completions, TGI, in process) gets the same bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

DATASETS = ("random", "shared-prefix", "multi-turn", "trace")


@dataclass
class Turn:
    text: str
    max_tokens: int


@dataclass
class Conversation:
    turns: list[Turn]
    prefix: str = ""  # e.g. a system prompt shared by a group
    arrival: float | None = None  # seconds, from a trace
    replies: list[str] = field(default_factory=list)  # filled while the benchmark runs
    model: str | None = None  # what it asks for (a LoRA adapter); None: the target's model

    def prompt(self, turn: int) -> str:
        parts = [self.prefix]
        for i in range(turn):
            parts += [self.turns[i].text, self.replies[i] if i < len(self.replies) else ""]
        return "".join(parts + [self.turns[turn].text])


class TextMaker:
    """Random text of about N tokens for a tokenizer (random ids, decoded, re-encoded, cut)."""

    def __init__(self, tokenizer, seed: int) -> None:
        self.tokenizer = tokenizer
        self.rng = np.random.default_rng(seed)
        special = set(getattr(tokenizer, "all_special_ids", []))
        self.vocab = np.array([i for i in range(len(tokenizer)) if i not in special and i >= 100])

    def __call__(self, num_tokens: int) -> str:
        ids = self.rng.choice(self.vocab, size=num_tokens).tolist()
        text = self.tokenizer.decode(ids)
        return self.tokenizer.decode(self.tokenizer.encode(text, add_special_tokens=False)[:num_tokens])


def _lengths(rng, mean: int, range_ratio: float, n: int) -> list[int]:
    low, high = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=n).tolist()


def random_dataset(tokenizer, num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                   seed: int = 0) -> list[Conversation]:
    make, rng = TextMaker(tokenizer, seed), np.random.default_rng(seed + 1)
    ins, outs = _lengths(rng, input_len, range_ratio, num_prompts), _lengths(rng, output_len, range_ratio, num_prompts)
    return [Conversation([Turn(make(i), o)]) for i, o in zip(ins, outs)]


def shared_prefix_dataset(tokenizer, num_groups: int, prompts_per_group: int, system_prompt_len: int,
                          question_len: int, output_len: int, seed: int = 0) -> list[Conversation]:
    """Like SGLang's generated-shared-prefix: groups of requests sharing a system prompt, shuffled."""
    make = TextMaker(tokenizer, seed)
    prefixes = [make(system_prompt_len) for _ in range(num_groups)]
    conversations = [Conversation([Turn(make(question_len), output_len)], prefix=p)
                     for p in prefixes for _ in range(prompts_per_group)]
    order = np.random.default_rng(seed + 1).permutation(len(conversations))
    return [conversations[i] for i in order]


def multi_turn_dataset(tokenizer, num_conversations: int, turns: int, input_len: int, output_len: int,
                       seed: int = 0) -> list[Conversation]:
    make = TextMaker(tokenizer, seed)
    return [Conversation([Turn(make(input_len), output_len) for _ in range(turns)])
            for _ in range(num_conversations)]


def trace_dataset(path: str | Path, tokenizer=None, seed: int = 0) -> list[Conversation]:
    """JSONL, one request a line: arrival as `arrival` (s) or `timestamp` (ms, Mooncake traces);
    the prompt as `prompt` (text) or `input_length`/`prompt_tokens` (random text of that size);
    the output as `output_length`/`max_tokens`."""
    make = TextMaker(tokenizer, seed) if tokenizer is not None else None
    conversations = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            arrival = row["arrival"] if "arrival" in row else row["timestamp"] / 1000.0
            output = int(row.get("output_length", row.get("max_tokens", 0)))
            if "prompt" in row:
                text = str(row["prompt"])
            else:
                if make is None:
                    raise ValueError("token counts need a tokenizer")
                text = make(int(row.get("input_length", row.get("prompt_tokens", 0))))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{number}: bad trace line ({exc})") from None
        if output < 1 or not text:
            raise ValueError(f"{path}:{number}: needs a non-empty prompt and an output length >= 1")
        conversations.append(Conversation([Turn(text, output)], arrival=float(arrival)))
    if not conversations:
        raise ValueError(f"{path}: the trace is empty")
    start = min(c.arrival for c in conversations)
    for c in conversations:
        c.arrival -= start
    return sorted(conversations, key=lambda c: c.arrival)


def spread_models(conversations: list[Conversation], models: list[str | None]) -> None:
    """Give each conversation one of `models`: those sharing a prefix (a shared-prefix group, one
    customer's system prompt) the same one, the groups (or the conversations, where none shares
    one) each the next in turn."""
    groups: dict[str | int, int] = {}
    for i, conversation in enumerate(conversations):
        conversation.model = models[groups.setdefault(conversation.prefix or i, len(groups)) % len(models)]
