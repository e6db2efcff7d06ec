"""How many concurrent 200-token requests a fixed KV budget holds, paged versus reserved.

A paged engine allocates 16-token blocks as tokens arrive; a server that reserves each
request's maximum length up front (4,096 tokens here) holds budget // 4096 at once.
Usage: python benchmarks/kv_capacity.py [--budget 8192] [--requests 64]
"""

from __future__ import annotations

import argparse

from backends.builtin.config import EngineConfig
from backends.builtin.core.engine import LLMEngine
from backends.builtin.core.sequence import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--budget", type=int, default=8192, help="KV cache tokens")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--reservation", type=int, default=4096, help="max length a reserving server sets aside")
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(kv_cache_tokens=args.budget, max_num_seqs=args.requests,
                                    max_num_batched_tokens=4096, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    for i in range(args.requests):  # 100 prompt + 100 output tokens each, no shared prefix
        engine.add_request(f"r{i}", [(i * 977 + j * 13) % 40000 + 100 for j in range(100)], params)
    peak_running, peak_used, fraction_at_peak, fractions = 0, 0, 0.0, []
    while engine.has_work:
        engine.step()
        stats = engine.stats()
        if stats["kv_blocks_used"]:
            fractions.append(stats["kv_live_token_fraction"])
        if stats["kv_blocks_used"] > peak_used:
            peak_used, fraction_at_peak = stats["kv_blocks_used"], stats["kv_live_token_fraction"]
        peak_running = max(peak_running, stats["running"])
    reserved = args.budget // args.reservation
    print(f"KV budget {args.budget} tokens ({engine.kv.num_blocks} blocks of {engine.kv.block_size})")
    print(f"paged: peak concurrent 200-token requests {peak_running}, preemptions {engine.scheduler.num_preemptions}")
    print(f"reserving {args.reservation} tokens per request: {reserved} concurrent")
    print(f"ratio: {peak_running / reserved:.1f}x")
    print(f"live-token fraction of allocated KV slots: at peak use ({peak_used} blocks) {fraction_at_peak:.3f}, "
          f"mean over steps {sum(fractions) / len(fractions):.3f}")


if __name__ == "__main__":
    main()
