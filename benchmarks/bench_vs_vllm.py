"""`servegate bench` checked against `vllm bench serve`, on the same live vLLM server (its CPU
build, `backends/peers.py`), the same trace:

    python benchmarks/bench_vs_vllm.py [--pairs 3] [--num-prompts 48] [--request-rate 2]

Each pair writes one JSONL trace both tools read (Mooncake's fields: `timestamp` in ms,
`input_length` 256, `output_length` 64, `hash_ids` unique per request, so no prefix is shared),
Poisson arrivals at the rate, and runs both against it, greedy with ignore_eos: vLLM's
`--dataset-name timed_trace --temperature 0` (its bench otherwise leaves sampling to the
server's default, temperature 1), servegate's `--dataset trace`, each with the pair's seed for
the prompts' tokens (a run that reused another's prompts would hit the prefix cache). Each row of
vLLM's own `/metrics` (TTFT, TPOT and end-to-end histograms, prefix-cache counters) over each
run says what the server saw. The order alternates from pair to
pair; the server is warmed up first (vLLM compiles for new batch shapes during its first
requests). Prints request and output throughput, mean TTFT, TPOT and end-to-end latency side by
side, with servegate / vLLM.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.measure.arrivals import arrival_times  # noqa: E402
from advisor.measure.baselines import free_port  # noqa: E402
from backends import peers  # noqa: E402
from backends.builtin.worker.loader import default_model_path, gguf_to_hf_dir  # noqa: E402
from backends.launch import supervised  # noqa: E402
from backends.openai_compat import Samples  # noqa: E402

COMPARED = ("total_input_tokens", "total_output_tokens", "duration", "request_throughput", "output_throughput",
            "mean_ttft_ms", "mean_tpot_ms", "mean_e2el_ms")


def write_trace(path: Path, n: int, rate: float, seed: int) -> None:
    offsets = arrival_times(n, rate, seed=seed)
    blocks = 256 // 16  # vLLM expands each hash id into 16 tokens
    path.write_text("".join(json.dumps({"timestamp": round((t - offsets[0]) * 1000, 3), "input_length": 256,
                                        "output_length": 64, "hash_ids": list(range(i * blocks, (i + 1) * blocks))})
                            + "\n" for i, t in enumerate(offsets)))


def vllm_bench(url: str, tokenizer: Path, trace: Path, n: int, seed: int, out: Path) -> dict:
    vllm = peers.vllm_python().parent / "vllm"
    result = subprocess.run(
        [str(vllm), "bench", "serve", "--backend", "vllm", "--base-url", url, "--model", "smollm2",
         "--tokenizer", str(tokenizer), "--dataset-name", "timed_trace", "--dataset-path", str(trace),
         "--timed-trace-sec-multiplier", "0.001", "--num-prompts", str(n), "--seed", str(seed),
         # greedy, as servegate's bench asks (its own default is the server's sampling)
         "--ignore-eos", "--temperature", "0",
         "--percentile-metrics", "ttft,tpot,itl,e2el", "--disable-tqdm", "--save-result",
         "--result-dir", str(out.parent), "--result-filename", out.name],
        env={**os.environ, **peers.vllm_env()}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if result.returncode:  # its stderr only then: its import-time noise has no newline and ran into the table
        sys.exit(f"vllm bench serve failed:\n{result.stderr[-4000:]}")
    return json.loads(out.read_text())


def servegate_bench(url: str, tokenizer: Path, trace: Path, n: int, seed: int, out: Path) -> dict:
    """The seed draws the prompts' text: a run that reused an earlier run's prompts would hit
    the server's prefix cache."""
    subprocess.run([sys.executable, "-m", "gateway", "bench", "--base-url", url, "--model", "smollm2",
                    "--tokenizer", str(tokenizer), "--dataset", "trace", "--trace", str(trace), "--num-prompts",
                    str(n), "--seed", str(seed), "--output", str(out)], check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


SERVER = {"mean_ttft_ms": "vllm:time_to_first_token_seconds",
          "mean_tpot_ms": "vllm:request_time_per_output_token_seconds",
          "mean_e2el_ms": "vllm:e2e_request_latency_seconds"}


def server_figures(url: str) -> Samples:
    """vLLM's own figures: its histograms' sums and counts, its prefix-cache counters."""
    return Samples.parse(httpx.get(f"{url}/metrics", timeout=30).text)


def server_view(before: Samples, after: Samples) -> dict[str, float]:
    """What the server itself measured over one run: mean TTFT, TPOT, end to end, prefix hit rate."""
    def delta(name: str) -> float:
        return after.total(name) - before.total(name)

    view = {ours: 1000 * delta(f"{theirs}_sum") / delta(f"{theirs}_count")
            for ours, theirs in SERVER.items() if delta(f"{theirs}_count")}
    queries = delta("vllm:prefix_cache_queries_total")
    view["prefix_hit_rate"] = delta("vllm:prefix_cache_hits_total") / queries if queries else 0.0
    return view


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--request-rate", type=float, default=2.0)
    args = parser.parse_args()
    model = gguf_to_hf_dir(default_model_path())
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    print("| pair | tool | " + " | ".join(COMPARED) + " |")
    print("|---|---|" + "---|" * len(COMPARED))
    with supervised(peers.vllm_command(model, port, "smollm2"), url, "/health", peers.vllm_env(), 900), \
            tempfile.TemporaryDirectory() as tmp:
        warmup = Path(tmp) / "warmup.jsonl"  # a whole run's load, so vLLM compiles its batch shapes first
        write_trace(warmup, args.num_prompts, args.request_rate, seed=1000)
        servegate_bench(url, model, warmup, args.num_prompts, 1000, Path(tmp) / "warmup.json")
        for pair in range(1, args.pairs + 1):
            trace = Path(tmp) / f"trace-{pair}.jsonl"
            write_trace(trace, args.num_prompts, args.request_rate, seed=pair)
            runs = {"vllm": vllm_bench, "servegate": servegate_bench}
            order = ["vllm", "servegate"] if pair % 2 else ["servegate", "vllm"]
            done, seen = {}, {}
            for name in order:
                before = server_figures(url)
                done[name] = runs[name](url, model, trace, args.num_prompts, pair, Path(tmp) / f"{name}-{pair}.json")
                seen[name] = server_view(before, server_figures(url))
            theirs, ours = done["vllm"], done["servegate"]
            for tool, result in (("vllm bench serve", theirs), ("servegate bench", ours)):
                print(f"| {pair} | {tool} | " + " | ".join(f"{result[k]:.2f}" for k in COMPARED) + " |")
            print(f"| {pair} | servegate / vLLM | " + " | ".join(f"{ours[k] / theirs[k]:.2f}" for k in COMPARED) + " |",
                  flush=True)
            for name in order:  # the server's own view of each run: which client saw what happened
                print(f"| {pair} | vLLM's /metrics during {name}'s run | " + " | ".join(
                    f"{seen[name][k]:.2f}" if k in seen[name] else "" for k in COMPARED) +
                      f" | prefix hit rate {seen[name]['prefix_hit_rate']:.3f}", flush=True)


if __name__ == "__main__":
    main()
