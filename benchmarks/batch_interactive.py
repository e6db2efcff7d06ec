"""Interactive latency while a batch runs, and the batch across a gateway restart:

    python benchmarks/batch_interactive.py [--lines 2000] [--prompts 40] [--rate 0.5]

`servegate serve` on the built-in engine with the default model. The interactive load is
`servegate bench`'s random dataset (128-token prompts, 32 output tokens, Poisson arrivals at
--rate), measured alone, then again while a batch of --lines chat completions (a short question
each, 16 output tokens, greedy) runs through /v1/files and /v1/batches. Once half the batch's lines
are answered the gateway is stopped (SIGTERM) and started again on the same database. Reported: the
interactive TTFT and TPOT percentiles with and without the batch, the batch's completion time
(restart included), and whether every line was answered exactly once: each custom id once in the
output, and the usage ledger holding one batch row per line (no line run twice).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.measure.baselines import free_port, servegate_env  # noqa: E402
from backends.launch import supervised  # noqa: E402

SERVEGATE = [sys.executable, "-m", "gateway"]
MODEL = "SmolLM2-135M-Instruct"
TOPICS = ("rivers", "prime numbers", "volcanoes", "the moon", "bread", "bees", "glaciers", "chess", "tea", "owls")


def batch_lines(count: int) -> bytes:
    rows = ({"custom_id": f"q-{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": MODEL, "max_tokens": 16, "temperature": 0,
        "messages": [{"role": "user", "content": f"Question {i}: name one fact about {TOPICS[i % len(TOPICS)]}."}]}}
        for i in range(count))
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def interactive(url: str, key: str, args, out: Path) -> dict:
    subprocess.run([*SERVEGATE, "bench", "--target", url, "--api-key", key, "--model", MODEL, "--dataset", "random",
                    "--random-input-len", "128", "--random-output-len", "32", "--num-prompts", str(args.prompts),
                    "--request-rate", str(args.rate), "--num-warmups", "1", "--seed", "1", "--output", str(out)],
                   check=True, capture_output=True)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--rate", type=float, default=0.5)
    args = parser.parse_args()
    with servegate_env() as (env, key), tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, **env}
        subprocess.run([*SERVEGATE, "db", "upgrade"], env=env, check=True, capture_output=True)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        serve = [*SERVEGATE, "serve", "--port", str(port), "--log-level", "warning"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=5)
        with supervised(serve, url, "/ready", env, 900):
            alone = interactive(url, key, args, Path(tmp) / "alone.json")
            source = client.files.create(file=("lines.jsonl", io.BytesIO(batch_lines(args.lines))), purpose="batch")
            started = time.monotonic()
            batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")
            alongside = interactive(url, key, args, Path(tmp) / "alongside.json")
            answered_alongside = client.batches.retrieve(batch.id).request_counts.completed
            print(f"interactive runs done at {time.monotonic() - started:.0f} s; {answered_alongside} lines answered",
                  flush=True)
            while client.batches.retrieve(batch.id).request_counts.completed < args.lines // 2:
                time.sleep(0.5)
            print(f"restarting the gateway at {time.monotonic() - started:.0f} s", flush=True)
        with supervised(serve, url, "/ready", env, 900):
            at_restart = client.batches.retrieve(batch.id).request_counts.completed
            while (done := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired",
                                                                               "cancelled"):
                time.sleep(1)
            took = time.monotonic() - started
            output = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()] \
                if done.output_file_id else []
            usage = httpx.get(f"{url}/admin/usage", params={"tenant": "default", "limit": 10_000},
                              headers={"Authorization": f"Bearer {key}"}, timeout=60).json()["records"]
    ids = [o["custom_id"] for o in output]
    batch_rows = sum(1 for r in usage if r["api"] == "batch")
    print("\n| interactive load | p50 TTFT ms | p99 TTFT ms | p50 TPOT ms | p99 TPOT ms | requests |")
    print("|---|---|---|---|---|---|")
    for label, r in (("alone", alone), ("with the batch running", alongside)):
        print(f"| {label} | {r['median_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | {r['median_tpot_ms']:.1f} | "
              f"{r['p99_tpot_ms']:.1f} | {r['completed']} |")
    print(f"\nbatch: {args.lines} lines, {done.status} in {took:.0f} s ({args.lines / took:.1f} lines/s), "
          f"{answered_alongside} answered during the interactive run, {at_restart} when the gateway came back")
    print(f"exactly once: {len(ids)} answers, {len(set(ids))} distinct custom ids of {args.lines}; "
          f"{batch_rows} batch rows in the ledger; errors: {done.request_counts.failed}")


if __name__ == "__main__":
    main()
