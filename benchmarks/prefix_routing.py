"""Prefix-aware routing against weighted random across two built-in engine replicas, on the
`shared-prefix` dataset, one gateway run per policy (fresh caches each time):

    python benchmarks/prefix_routing.py [--groups 24] [--prompts 96] [--concurrency 8] [--kv-cache-tokens 8192]

Each run starts `servegate serve` with two `builtin` backends (the default model) behind a route
`chat`, sends the same workload with `servegate bench`, and reads the prefix-cache hits (cached
prompt tokens the engines report) and the TTFT percentiles. The default sizes put the caches under
pressure, as in production: all the groups' system prompts (24 x 512 tokens) do not fit in one
replica's KV cache (8,192 tokens), half of them do.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.bench.baselines import free_port, servegate_env  # noqa: E402
from backends.launch import supervised  # noqa: E402

SERVEGATE = [sys.executable, "-c", "from gateway.cli import app; app()"]
ROUTES = {
    "weighted random": {"targets": [{"backend": "r1"}, {"backend": "r2"}]},
    "prefix-aware": {"targets": [{"backend": "r1"}, {"backend": "r2"}],
                     "prefix_aware": {"block_chars": 256, "blocks": 8, "max_extra_waiting": 4}},
}


def run(policy: str, args) -> dict:
    with servegate_env() as (env, key), tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, **env, "SERVEGATE_ROUTE_SEED": "1"}
        config, route, out = Path(tmp) / "servegate.yaml", Path(tmp) / "route.yaml", Path(tmp) / "bench.json"
        replica = {"kind": "builtin", "options": {"kv_cache_tokens": args.kv_cache_tokens}}
        config.write_text(yaml.safe_dump({"backends": [{"name": "r1", "served_name": "r1", **replica},
                                                       {"name": "r2", "served_name": "r2", **replica}]}))
        route.write_text(yaml.safe_dump(ROUTES[policy]))
        subprocess.run([*SERVEGATE, "db", "upgrade"], env=env, check=True, capture_output=True)
        subprocess.run([*SERVEGATE, "routes", "deploy", "chat", "-f", str(route), "--config", str(config)], env=env,
                       check=True)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        serve = [*SERVEGATE, "serve", "--config", str(config), "--port", str(port), "--log-level", "warning"]
        with supervised(serve, url, "/ready", env, 600):
            subprocess.run([*SERVEGATE, "bench", "--target", url, "--api-key", key, "--model", "chat",
                            "--dataset", "shared-prefix", "--gsp-num-groups", str(args.groups),
                            "--num-prompts", str(args.prompts), "--gsp-system-prompt-len", "512",
                            "--gsp-question-len", "32", "--gsp-output-len", "16", "--max-concurrency",
                            str(args.concurrency), "--output", str(out)], env=env, check=True)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--kv-cache-tokens", type=int, default=8192)
    args = parser.parse_args()
    results = {policy: run(policy, args) for policy in ROUTES}
    print("\n| routing | prompt tokens | cached prompt tokens | hit rate | p50 TTFT ms | p99 TTFT ms | req/s |")
    print("|---|---|---|---|---|---|---|")
    for policy, r in results.items():
        prompt = r["total_input_tokens"]
        print(f"| {policy} | {prompt} | {r['total_cached_tokens']} | {r['total_cached_tokens'] / prompt:.2f} | "
              f"{r['median_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | {r['request_throughput']:.2f} |")


if __name__ == "__main__":
    main()
