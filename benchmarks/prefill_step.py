"""Prefill-step cost of the built-in engine on the default model: one engine step that computes
`--prompts` fresh prompts of `--length` tokens each, and where its time goes. With `--cached N`
each prompt follows one shared N-token prefix already in the prefix cache, so the step computes
only the prompts' own tokens, attending the cached prefix too (a burst of questions on a cached
system prompt: `--prompts 15 --length 32 --cached 512`); without it nothing is cached.

Usage: python benchmarks/prefill_step.py [--prompts 4] [--length 512] [--cached 0] [--steps 3]
    [--dtype auto|float32|bfloat16] [--chunks auto|kernel|sdpa] [--contend BUSY/PERIOD] [--profile]
--chunks sends prompt chunks where the engine would (auto), to the chunk kernel, or to SDPA over
their gathered context, to compare the two on one CPU (`kernels.chunk_kernel_serves` picks).
--contend 20/30 times the steps beside another process that spins 20 ms of every 30 (a whole core:
--contend 1/1), as the API process and a client on the same machine take a core where one wave of
requests ends and the next arrives: what such a core costs a step.
--profile prints the top operators of one more step (torch.profiler; the native kernels are not
operators: their time is what the table leaves of the step).
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time

import torch

from backends.builtin.config import EngineConfig
from backends.builtin.core.engine import LLMEngine
from backends.builtin.core.sequence import SamplingParams
from backends.builtin.worker import kernels


def prefill_step_s(engine: LLMEngine, prompts: int, length: int, salt: int, prefix: list[int]) -> float:
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for i in range(prompts):  # each salt's prompts differ from every other's: only `prefix` is cached
        engine.add_request(f"{salt}-{i}",
                           prefix + [(i * 131 + j * 7 + salt * 977) % 40000 + 100 for j in range(length)], params)
    start = time.perf_counter()
    engine.step()
    elapsed = time.perf_counter() - start
    for i in range(prompts):
        engine.abort(f"{salt}-{i}")
    return elapsed


def busy_period(spec: str) -> tuple[float, float]:
    """`BUSY/PERIOD` in ms, as seconds."""
    try:
        busy, period = (float(part) / 1000 for part in spec.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BUSY/PERIOD in ms, like 20/30; got {spec!r}") from None
    if not 0 < busy <= period:
        raise argparse.ArgumentTypeError(f"BUSY must be over 0 and at most PERIOD; got {spec!r}")
    return busy, period


@contextlib.contextmanager
def contended(busy_period_s: tuple[float, float] | None):
    """Another process spinning `busy` of every `period` seconds while the block runs (none: nothing)."""
    if busy_period_s is None:
        yield
        return
    busy, period = busy_period_s
    spin = ("import time\nwhile True:\n    start = time.perf_counter()\n"
            f"    while time.perf_counter() - start < {busy}: pass\n    time.sleep({period - busy})")
    process = subprocess.Popen([sys.executable, "-c", spin])
    try:
        yield
    finally:
        process.kill()
        process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--cached", type=int, default=0,
                        help="tokens of a shared prefix already cached (its whole KV blocks)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16")
    parser.add_argument("--chunks", default="auto", choices=("auto", "kernel", "sdpa"),
                        help="where prompt chunks go: as the engine picks, the chunk kernel, or SDPA")
    parser.add_argument("--contend", type=busy_period, metavar="BUSY/PERIOD",
                        help="time the steps beside a process that spins BUSY ms of every PERIOD ms")
    parser.add_argument("--profile", action="store_true", help="the top operators of one more step")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    tokens = args.prompts * args.length
    engine = LLMEngine(EngineConfig(dtype=args.dtype, max_num_batched_tokens=tokens))
    if args.chunks != "auto":
        if args.chunks == "kernel" and not (engine.runner.use_kernel and kernels.load().chunk_attention_native()):
            parser.error("the chunk kernel is not built on this CPU (it needs AVX-512)")
        engine.runner.chunk_kernel = args.chunks == "kernel"
    prefix = [(j * 13) % 40000 + 50 for j in range(args.cached)]
    if prefix:  # its full blocks stay in the prefix cache once it finishes (chunked if over the budget)
        engine.generate([prefix], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    prefill_step_s(engine, args.prompts, args.length, 0, prefix)
    with contended(args.contend):
        steps = [prefill_step_s(engine, args.prompts, args.length, salt, prefix)
                 for salt in range(1, args.steps + 1)]
    beside = f", beside a process spinning {args.contend[0] * 1000:g} of every {args.contend[1] * 1000:g} ms" \
        if args.contend else ""
    print(f"prefill step, {args.prompts} x {args.length} tokens after {args.cached} cached{beside} "
          f"({engine.runner.dtype}, chunks to "
          f"{'the chunk kernel' if engine.runner.chunk_kernel else 'SDPA'}): "
          + ", ".join(f"{s * 1000:.0f}" for s in steps) + f" ms; {tokens / min(steps):.0f} tokens/s at best")
    if args.profile:
        profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        with profile:
            prefill_step_s(engine, args.prompts, args.length, args.steps + 1, prefix)
        print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))


if __name__ == "__main__":
    main()
