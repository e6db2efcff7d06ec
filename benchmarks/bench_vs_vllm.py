"""`servegate bench` checked against `vllm bench serve`, on the same live vLLM server (its CPU
build, `backends/peers.py`), the same trace:

    python benchmarks/bench_vs_vllm.py [--pairs 3] [--num-prompts 48] [--request-rate 2]

Each pair writes one JSONL trace both tools read (Mooncake's fields: `timestamp` in ms,
`input_length` 256, `output_length` 64, `hash_ids` unique per request, so no prefix is shared),
Poisson arrivals at the rate, and runs both against it, greedy with ignore_eos: vLLM's
`--dataset-name timed_trace`, servegate's `--dataset trace`. The order alternates from pair to
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.bench.arrivals import arrival_times  # noqa: E402
from advisor.bench.baselines import free_port  # noqa: E402
from backends import peers  # noqa: E402
from backends.builtin.loader import default_model_path, gguf_to_hf_dir  # noqa: E402
from backends.launch import supervised  # noqa: E402

COMPARED = ("total_input_tokens", "total_output_tokens", "duration", "request_throughput", "output_throughput",
            "mean_ttft_ms", "mean_tpot_ms", "mean_e2el_ms")


def write_trace(path: Path, n: int, rate: float, seed: int) -> None:
    offsets = arrival_times(n, rate, seed=seed)
    blocks = 256 // 16  # vLLM expands each hash id into 16 tokens
    path.write_text("".join(json.dumps({"timestamp": round((t - offsets[0]) * 1000, 3), "input_length": 256,
                                        "output_length": 64, "hash_ids": list(range(i * blocks, (i + 1) * blocks))})
                            + "\n" for i, t in enumerate(offsets)))


def vllm_bench(url: str, tokenizer: Path, trace: Path, n: int, out: Path) -> dict:
    vllm = peers.vllm_python().parent / "vllm"
    subprocess.run([str(vllm), "bench", "serve", "--backend", "vllm", "--base-url", url, "--model", "smollm2",
                    "--tokenizer", str(tokenizer), "--dataset-name", "timed_trace", "--dataset-path", str(trace),
                    "--timed-trace-sec-multiplier", "0.001", "--num-prompts", str(n), "--ignore-eos",
                    "--percentile-metrics", "ttft,tpot,itl,e2el", "--disable-tqdm", "--save-result",
                    "--result-dir", str(out.parent), "--result-filename", out.name],
                   check=True, env={**os.environ, **peers.vllm_env()}, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def servegate_bench(url: str, tokenizer: Path, trace: Path, n: int, out: Path) -> dict:
    subprocess.run([sys.executable, "-m", "gateway", "bench", "--base-url", url, "--model", "smollm2",
                    "--tokenizer", str(tokenizer), "--dataset", "trace", "--trace", str(trace), "--num-prompts",
                    str(n), "--output", str(out)], check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


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
        warmup = Path(tmp) / "warmup.jsonl"
        write_trace(warmup, 16, 8.0, seed=0)
        servegate_bench(url, model, warmup, 16, Path(tmp) / "warmup.json")
        for pair in range(1, args.pairs + 1):
            trace = Path(tmp) / f"trace-{pair}.jsonl"
            write_trace(trace, args.num_prompts, args.request_rate, seed=pair)
            runs = {"vllm": lambda: vllm_bench(url, model, trace, args.num_prompts, Path(tmp) / f"vllm-{pair}.json"),
                    "servegate": lambda: servegate_bench(url, model, trace, args.num_prompts,
                                                         Path(tmp) / f"servegate-{pair}.json")}
            order = ["vllm", "servegate"] if pair % 2 else ["servegate", "vllm"]
            done = {name: runs[name]() for name in order}
            theirs, ours = done["vllm"], done["servegate"]
            for tool, result in (("vllm bench serve", theirs), ("servegate bench", ours)):
                print(f"| {pair} | {tool} | " + " | ".join(f"{result[k]:.2f}" for k in COMPARED) + " |")
            print(f"| {pair} | servegate / vLLM | " + " | ".join(f"{ours[k] / theirs[k]:.2f}" for k in COMPARED) + " |",
                  flush=True)


if __name__ == "__main__":
    main()
