"""TTFT with a 1,000-token shared prefix: warm prefix cache versus cold (caching off), same server build.

Sequential requests (concurrency 1) so that TTFT is prefill time, not queueing.
Usage: python benchmarks/prefix_warm_cold.py [--prefix 1000] [--requests 10]
"""

from __future__ import annotations

import argparse
import asyncio

from advisor.measure.baselines import free_port, servegate_command, server_process
from advisor.measure.cli import load_tokenizer
from advisor.measure.datasets import shared_prefix_dataset
from advisor.measure.metrics import summarize
from advisor.measure.runner import run_workload
from advisor.measure.targets import OpenAITarget


async def measure(url: str, conversations) -> dict:
    target = OpenAITarget(url)
    await target.prepare()
    try:
        results, duration = await run_workload(target, conversations, max_concurrency=1)
    finally:
        await target.close()
    return summarize(results[1:], duration)  # the first request warms the cache in both runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prefix", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=10)
    args = parser.parse_args()
    conversations = shared_prefix_dataset(load_tokenizer(None), 1, args.requests, args.prefix, 32, 8, seed=0)
    figures = {}
    for label, extra in (("warm", []), ("cold", ["--no-prefix-caching"])):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with server_process(servegate_command(port) + extra, url, "/ready"):
            figures[label] = asyncio.run(measure(url, conversations))
    for label, s in figures.items():
        print(f"{label}: p50 TTFT {s['median_ttft_ms']:.1f} ms, p99 {s['p99_ttft_ms']:.1f} ms, "
              f"cached prompt tokens {s['total_cached_tokens']}")
    print(f"warm / cold p50 TTFT: {figures['warm']['median_ttft_ms'] / figures['cold']['median_ttft_ms']:.3f}")


if __name__ == "__main__":
    main()
