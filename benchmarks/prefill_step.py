"""Prefill-step cost of the built-in engine on the default model: one engine step that computes
`--prompts` fresh prompts of `--length` tokens each (no prefix-cache hits), and where its time goes.

Usage: python benchmarks/prefill_step.py [--prompts 4] [--length 512] [--dtype auto|float32|bfloat16] [--profile]
--profile prints the top operators of one more step (torch.profiler; the native kernels are not
operators: their time is what the table leaves of the step).
"""

from __future__ import annotations

import argparse
import time

import torch

from backends.builtin.config import EngineConfig
from backends.builtin.engine import LLMEngine
from backends.builtin.sequence import SamplingParams


def prefill_step_s(engine: LLMEngine, prompts: int, length: int, salt: int) -> float:
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for i in range(prompts):  # each salt's prompts differ from every other's: nothing is cached
        engine.add_request(f"{salt}-{i}", [(i * 131 + j * 7 + salt * 977) % 40000 + 100 for j in range(length)],
                           params)
    start = time.perf_counter()
    engine.step()
    elapsed = time.perf_counter() - start
    for i in range(prompts):
        engine.abort(f"{salt}-{i}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16")
    parser.add_argument("--profile", action="store_true", help="the top operators of one more step")
    args = parser.parse_args()
    tokens = args.prompts * args.length
    engine = LLMEngine(EngineConfig(dtype=args.dtype, max_num_batched_tokens=tokens))
    prefill_step_s(engine, args.prompts, args.length, 0)
    steps = [prefill_step_s(engine, args.prompts, args.length, salt) for salt in (1, 2, 3)]
    print(f"prefill step, {args.prompts} x {args.length} tokens ({engine.runner.dtype}, chunks to "
          f"{'the chunk kernel' if engine.runner.chunk_kernel else 'SDPA'}): "
          + ", ".join(f"{s * 1000:.0f}" for s in steps) + f" ms; {tokens / min(steps):.0f} tokens/s at best")
    if args.profile:
        profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        with profile:
            prefill_step_s(engine, args.prompts, args.length, 4)
        print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))


if __name__ == "__main__":
    main()
