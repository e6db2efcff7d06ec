"""What each runtime's scheduler puts in a step, by its defaults: how many sequences may run, how
many tokens one step may carry, whether prefill chunks ride along with decodes ("mixed") or run
in steps of their own that pause decoding ("prefill_first"), and what happens when the KV cache
runs out (preempt the newest and recompute it later, or admit only what is sure to fit).
Sources: policies/catalog/schedulers.yaml, one per default, with the file it is read from."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

from ..hardware import Hardware

CATALOG = Path(__file__).resolve().parents[2] / "policies" / "catalog" / "schedulers.yaml"


@dataclass(frozen=True)
class Scheduler:
    runtime: str
    max_seqs: int  # running sequences at most
    step_tokens: int  # tokens one step may carry (the chunked-prefill budget, or the max tokens of a batch)
    policy: str  # mixed | prefill_first
    chunked: bool  # a prompt longer than the budget is split across steps (else it waits for a step of its own)
    # Share of each request's output the cache must hold free before it is admitted: 0 allocates
    # as it goes (and preempts the newest when full), 1 guarantees no eviction.
    reserve_output: float
    # One KV cache shared by every slot, each decode attending over all its cells under a mask
    # (llama.cpp's unified cache): attention grows with every sequence's context, not its own.
    unified_kv: bool = False


@cache
def _catalogue() -> dict:
    return yaml.safe_load(CATALOG.read_text())


def scheduler(runtime: str, hw: Hardware) -> Scheduler:
    """The runtime's defaults on this device: its `rules` pick by the device's memory (GiB) and
    family, as vLLM, SGLang and LMDeploy size their batches."""
    entry = _catalogue()["runtimes"].get(runtime) or _catalogue()["runtimes"]["vllm"]
    values = {k: v for k, v in entry.items() if k in Scheduler.__dataclass_fields__}
    for rule in entry.get("rules", ()):
        if (hw.gpu and hw.memory_gib >= rule.get("at_least_gib", 0)
                and hw.family.startswith(rule.get("family", "")) and hw.family != rule.get("not_family")):
            values |= {k: v for k, v in rule.items() if k in Scheduler.__dataclass_fields__}
    if not hw.gpu:
        values |= entry.get("cpu", {})
    return Scheduler(runtime=runtime, **values)
