"""A canary to a deliberately slowed vLLM replica, rolled back by the gateway's guard while
clients keep being served:

    python benchmarks/canary_rollback.py [--requests 160] [--concurrency 8] [--canary-share 50]

Two real vLLM servers (its CPU build, `backends/peers.py`), one core each: `fast`, and `slow`, the
same model run with `--max-num-seqs 1`, so it takes one request at a time and the others queue.
`servegate serve` holds both; the route `chat` is deployed with `fast` active, then `slow` as a
canary taking `--canary-share` percent. `servegate bench` then sends the requests at a fixed
concurrency while the guard (policies/rollout.yaml) compares the two versions. Printed: the
requests that failed (none may), the route's history with the guard's rollback and its reason,
and how many requests each version answered.
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
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.measure.baselines import servegate_env  # noqa: E402
from backends import peers  # noqa: E402
from backends.builtin.worker.loader import default_model_path, gguf_to_hf_dir  # noqa: E402
from backends.launch import free_port, supervised  # noqa: E402

SERVEGATE = [sys.executable, "-c", "from gateway.cli import app; app()"]


def answered_by(url: str, key: str) -> dict[str, float]:
    """Requests per backend, from the gateway's own metrics."""
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=30).text
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "servegate_requests_total" and "backend" in sample.labels:
                counts[sample.labels["backend"]] = counts.get(sample.labels["backend"], 0) + sample.value
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--canary-share", type=int, default=50)
    args = parser.parse_args()
    model = gguf_to_hf_dir(default_model_path())
    with peers.vllm_replicas(model, "smollm2", [], ["--max-num-seqs", "1"]) as (fast, slow), \
            servegate_env() as (env, key), tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, **env, "SERVEGATE_ROUTE_SEED": "1"}
        config = Path(tmp) / "servegate.yaml"
        config.write_text(yaml.safe_dump({"backends": [
            {"name": name, "served_name": name, "kind": "vllm", "url": url, "model": "smollm2"}
            for name, url in (("fast", fast), ("slow", slow))]}))
        for version, backend in (("v1", "fast"), ("v2", "slow")):
            (Path(tmp) / f"{version}.yaml").write_text(yaml.safe_dump({"targets": [{"backend": backend}]}))
        subprocess.run([*SERVEGATE, "db", "upgrade"], env=env, check=True, capture_output=True)
        deploy = [*SERVEGATE, "routes", "deploy", "chat", "--config", str(config), "-f"]
        subprocess.run([*deploy, str(Path(tmp) / "v1.yaml")], env=env, check=True, capture_output=True)
        subprocess.run([*deploy, str(Path(tmp) / "v2.yaml"), "--canary", f"{args.canary_share}%"], env=env,
                       check=True, capture_output=True)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        serve = [*SERVEGATE, "serve", "--config", str(config), "--port", str(port), "--log-level", "warning"]
        out = Path(tmp) / "bench.json"
        with supervised(serve, url, "/ready", env, 600):
            subprocess.run([*SERVEGATE, "bench", "--target", url, "--api-key", key, "--model", "chat",
                            "--dataset", "random", "--num-prompts", str(args.requests), "--random-input-len", "128",
                            "--random-output-len", "32", "--max-concurrency", str(args.concurrency), "--output",
                            str(out)], env=env, check=True, stdout=subprocess.DEVNULL)
            served = answered_by(url, key)
        history = json.loads(subprocess.run([*SERVEGATE, "routes", "history", "chat", "--json"], env=env,
                                            check=True, capture_output=True, text=True).stdout)
        result = json.loads(out.read_text())
    print(f"requests: {result['completed']} completed, {result['failed']} failed; "
          f"p50 TTFT {result['median_ttft_ms']:.0f} ms, p99 {result['p99_ttft_ms']:.0f} ms")
    print(f"answered by: {served}")
    for version in history["versions"]:
        print(f"version {version['version']}: {version['status']}, targets {version['spec']['targets']}")
    for change in history["changes"]:
        after = change["after"] or {}
        print(f"{change['at']} {change['actor']}: {change['action']} {change['target']} "
              f"{after.get('reason') or after.get('status') or ''}")


if __name__ == "__main__":
    main()
