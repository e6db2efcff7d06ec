"""Prefix-aware routing against weighted random across two replicas, built-in engines or real
vLLM servers (its CPU build, `backends/peers.py`), on the `shared-prefix` dataset, one gateway run
per policy (fresh caches each time):

    python benchmarks/prefix_routing.py [--replicas builtin|vllm] [--groups 24] [--prompts 96]
        [--concurrency 8] [--kv-cache-tokens 8192]

With `--replicas vllm` the two vLLM servers run once, one core each, with KV caches of the same
size (`--num-gpu-blocks-override`), and their prefix caches are reset between policies
(`/reset_prefix_cache`, a dev-mode route); the hit rate is vLLM's own, from its
`vllm:prefix_cache_hits` and `vllm:prefix_cache_queries` counters over the run.

Each run starts `servegate serve` with two `builtin` backends (the default model) behind a route
`chat`, sends the same workload with `servegate bench`, and reads the prefix-cache hits (cached
prompt tokens the engines report) and the TTFT percentiles. The default sizes put the caches under
pressure, as in production: all the groups' system prompts (24 x 512 tokens) do not fit in one
replica's KV cache (8,192 tokens), half of them do.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.measure.baselines import free_port, servegate_env  # noqa: E402
from backends import peers  # noqa: E402
from backends.builtin.worker.loader import default_model_path, gguf_to_hf_dir  # noqa: E402
from backends.launch import supervised  # noqa: E402
from backends.openai_compat import Samples  # noqa: E402

SERVEGATE = [sys.executable, "-c", "from gateway.cli import app; app()"]
ROUTES = {
    "weighted random": {"targets": [{"backend": "r1"}, {"backend": "r2"}]},
    "prefix-aware": {"targets": [{"backend": "r1"}, {"backend": "r2"}],
                     "prefix_aware": {"block_chars": 256, "blocks": 8, "max_extra_waiting": 4}},
}


@contextlib.contextmanager
def replicas(args) -> Iterator[list[dict]]:
    """The two replicas' backend entries, with their servers running where they are servers."""
    if args.replicas == "builtin":
        replica = {"kind": "builtin", "options": {"kv_cache_tokens": args.kv_cache_tokens}}
        yield [{"name": name, "served_name": name, **replica} for name in ("r1", "r2")]
        return
    # vLLM's KV cache as small as the built-in replicas' (cache pressure), in blocks of 32 tokens
    # (its CPU attention takes multiples of 32)
    extra = ["--block-size", "32", "--num-gpu-blocks-override", str(args.kv_cache_tokens // 32)]
    with peers.vllm_replicas(gguf_to_hf_dir(default_model_path()), "smollm2", extra, extra) as urls:
        yield [{"name": name, "served_name": name, "kind": "vllm", "url": url, "model": "smollm2"}
               for name, url in zip(("r1", "r2"), urls)]


def vllm_counters(entries: list[dict]) -> tuple[float, float]:
    """vLLM's own prefix-cache hits and queries (tokens), summed over the replicas."""
    scraped = [Samples.parse(httpx.get(f"{entry['url']}/metrics").text) for entry in entries]
    return (sum(m.total("vllm:prefix_cache_hits_total") for m in scraped),
            sum(m.total("vllm:prefix_cache_queries_total") for m in scraped))


def run(policy: str, args, entries: list[dict]) -> dict:
    with servegate_env() as (env, key), tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, **env, "SERVEGATE_ROUTE_SEED": "1"}
        config, route, out = Path(tmp) / "servegate.yaml", Path(tmp) / "route.yaml", Path(tmp) / "bench.json"
        config.write_text(yaml.safe_dump({"backends": entries}))
        servers = [e for e in entries if "url" in e]
        for entry in servers:  # fresh caches for each policy
            httpx.post(f"{entry['url']}/reset_prefix_cache", timeout=60).raise_for_status()
        before = vllm_counters(servers)
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
        result = json.loads(out.read_text())
        if servers:
            hits, queries = (after - first for after, first in zip(vllm_counters(servers), before))
            result["vllm_prefix_hit_rate"] = hits / queries if queries else None
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--kv-cache-tokens", type=int, default=8192)
    parser.add_argument("--replicas", choices=("builtin", "vllm"), default="builtin")
    args = parser.parse_args()
    with replicas(args) as entries:
        results = {policy: run(policy, args, entries) for policy in ROUTES}
    print("\n| routing | prompt tokens | cached prompt tokens | hit rate | vLLM's hit rate | p50 TTFT ms | p99 TTFT ms "
          "| req/s |")
    print("|---|---|---|---|---|---|---|---|")
    for policy, r in results.items():
        prompt, theirs = r["total_input_tokens"], r.get("vllm_prefix_hit_rate")
        print(f"| {policy} | {prompt} | {r['total_cached_tokens']} | {r['total_cached_tokens'] / prompt:.2f} | "
              f"{'-' if theirs is None else f'{theirs:.2f}'} | {r['median_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | "
              f"{r['request_throughput']:.2f} |")


if __name__ == "__main__":
    main()
