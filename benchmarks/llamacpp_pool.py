"""The in-process llama.cpp pool: 4 requests one after another against 4 at once, same backend.

    python benchmarks/llamacpp_pool.py --slots 4 --requests 4 --max-tokens 64

Each request is a different prompt, greedy, `max_tokens` tokens at most; the figure is the wall
time of the whole batch and the tokens it produced.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.base import Delta, Finish, GenerateRequest  # noqa: E402
from backends.llamacpp import LlamaCppBackend, LlamaCppConfig  # noqa: E402

PROMPTS = ["Write a story about a lighthouse keeper.", "Explain how tides work, step by step.",
           "List ten uses for a paperclip and explain each.", "Describe a walk through a busy market."]


async def one(backend: LlamaCppBackend, i: int, max_tokens: int) -> int:
    request = GenerateRequest(request_id=f"r{i}", model="m", messages=[{"role": "user", "content": PROMPTS[i % 4]}],
                              max_tokens=max_tokens, temperature=0.0)
    tokens = 0
    async for event in backend.generate(request):
        if isinstance(event, Finish):
            tokens = event.usage.completion_tokens
        assert isinstance(event, (Delta, Finish))
    return tokens


async def main(slots: int, requests: int, max_tokens: int, threads: int) -> None:
    backend = LlamaCppBackend(LlamaCppConfig(slots=slots, n_ctx=2048, n_threads=threads))
    await backend.start()
    await one(backend, 0, 8)  # warm up
    started = time.perf_counter()
    sequential_tokens = [await one(backend, i, max_tokens) for i in range(requests)]
    sequential = time.perf_counter() - started
    started = time.perf_counter()
    concurrent_tokens = await asyncio.gather(*(one(backend, i, max_tokens) for i in range(requests)))
    concurrent = time.perf_counter() - started
    await backend.close()
    print(f"slots={slots} threads/slot={threads or 'auto'} requests={requests} max_tokens={max_tokens}")
    for name, wall, tokens in (("sequential", sequential, sum(sequential_tokens)),
                               ("concurrent", concurrent, sum(concurrent_tokens))):
        print(f"{name}: {wall:.2f} s, {tokens} tokens, {tokens / wall:.1f} tok/s")
    print(f"concurrent / sequential wall time: {concurrent / sequential:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="per slot; 0: the cores shared among the slots")
    args = parser.parse_args()
    asyncio.run(main(args.slots, args.requests, args.max_tokens, args.threads))
