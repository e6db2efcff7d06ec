"""Adapter-affinity routing against round-robin: two built-in engine replicas behind one gateway
route, 6 LoRA adapters registered for it and room for 2 in each replica's compute slots, the same
load sent once per policy (fresh replicas each time):

    python benchmarks/adapter_routing.py [--adapters 6] [--slots 2] [--groups 14] [--prompts 56]
        [--concurrency 8]

The adapters are made with PEFT on the default model (rank 8, attention's projections). The load
is the shared-prefix dataset with one model per group (the base and each adapter in turn,
`servegate bench --lora-modules`), 256-token system prompts, 32-token questions, 32 output tokens,
greedy. Affinity sends an adapter's request to the replica holding it in a slot, else to one that
has it loaded, before one that must load it (`adapter_affinity`, on by default, weighted among
equals); round-robin takes the replicas in turn whatever they hold. Reported: the slot loads
(adapters copied into a compute slot, summed over the replicas: each is a step that waited for its
adapter), and TTFT percentiles.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.measure.baselines import free_port, servegate_env  # noqa: E402
from backends.builtin.worker.loader import default_model_path, gguf_to_hf_dir  # noqa: E402
from backends.launch import supervised  # noqa: E402
from backends.openai_compat import Samples  # noqa: E402
from tests.lora_adapters import make_adapter  # noqa: E402

SERVEGATE = [sys.executable, "-m", "gateway"]
TARGETS = [{"backend": "r1"}, {"backend": "r2"}]
ROUTES = {"adapter affinity": {"targets": TARGETS},
          "round-robin": {"targets": TARGETS, "balance": "round-robin", "adapter_affinity": False}}


def run(policy: str, args, adapters: dict[str, str]) -> dict:
    replica = {"kind": "builtin", "options": {"enable_lora": True, "max_loras": args.slots, "max_lora_rank": 8}}
    entries = [{"name": name, "served_name": name, **replica} for name in ("r1", "r2")]
    with servegate_env() as (env, key), tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, **env, "SERVEGATE_ROUTE_SEED": "1"}
        config, route, out = Path(tmp) / "servegate.yaml", Path(tmp) / "route.yaml", Path(tmp) / "bench.json"
        config.write_text(yaml.safe_dump({"backends": entries}))
        route.write_text(yaml.safe_dump(ROUTES[policy]))
        subprocess.run([*SERVEGATE, "db", "upgrade"], env=env, check=True, capture_output=True)
        subprocess.run([*SERVEGATE, "routes", "deploy", "chat", "-f", str(route), "--config", str(config)], env=env,
                       check=True)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        serve = [*SERVEGATE, "serve", "--config", str(config), "--port", str(port), "--log-level", "warning"]
        with supervised(serve, url, "/ready", env, 600):
            for name, path in adapters.items():  # the operator's, for the tenant the bench calls as
                httpx.post(f"{url}/admin/adapters", headers={"Authorization": f"Bearer {key}"}, json={
                    "name": name, "base": "chat", "path": path, "tenants": ["default"]}).raise_for_status()
            subprocess.run([*SERVEGATE, "bench", "--target", url, "--api-key", key, "--model", "chat",
                            "--dataset", "shared-prefix", "--gsp-num-groups", str(args.groups),
                            "--num-prompts", str(args.prompts), "--gsp-system-prompt-len", "256",
                            "--gsp-question-len", "32", "--gsp-output-len", "32", "--max-concurrency",
                            str(args.concurrency), "--lora-modules", ",".join(adapters), "--num-warmups", "0",
                            "--output", str(out)], env=env, check=True)
            scraped = Samples.parse(httpx.get(f"{url}/metrics").text)
        result = json.loads(out.read_text())
        result["slot_loads"] = scraped.total("servegate_backend_lora_slot_loads_total")
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=6)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--groups", type=int, default=14)
    parser.add_argument("--prompts", type=int, default=56)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="adapters-") as tmp:
        base = gguf_to_hf_dir(default_model_path())
        adapters = {f"a{i}": str(make_adapter(base, Path(tmp) / f"a{i}", 8, ["q_proj", "k_proj", "v_proj", "o_proj"],
                                              seed=i)) for i in range(args.adapters)}
        results = {policy: run(policy, args, adapters) for policy in ROUTES}
    print("\n| routing | slot loads | p50 TTFT ms | p99 TTFT ms | output tok/s | errors |")
    print("|---|---|---|---|---|---|")
    for policy, r in results.items():
        print(f"| {policy} | {r['slot_loads']:.0f} | {r['median_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | "
              f"{r['output_throughput']:.1f} | {sum(e is not None for e in r['errors'])} |")


if __name__ == "__main__":
    main()
