"""The advisor's roofline against measurement on this machine: estimated single-sequence decode
tokens/s of the built-in engine and of llama-cpp-python on the default model (hardware `local`,
measured bandwidth and FLOPS) beside what `servegate bench` measures (1000 / median TPOT at
concurrency 1).

Usage: python benchmarks/advisor_roofline.py [--prompt 128] [--output 128] [--num-prompts 8]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from advisor.advise import Workload, advise
from advisor.hardware import local
from advisor.models import resolve
from backends.builtin.loader import default_model_path

# The advisor's runtime -> the bench peer that runs it on the default model.
PEERS = {"builtin": "builtin", "llama-cpp": "llama-cpp"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=8)
    args = parser.parse_args()

    hardware = local()
    print(f"local: {hardware.bandwidth_gbs:.1f} GB/s matrix-vector bandwidth, {hardware.bf16_tflops * 1000:.0f} GFLOPS "
          "float32 matmul", flush=True)
    report = advise(resolve(str(default_model_path())), hardware, 1,
                    Workload(prompt_tokens=args.prompt, output_tokens=args.output, concurrency=1),
                    runtimes=list(PEERS))
    estimates = {c.runtime: c.estimates["decode_tokens_per_s_single"] for c in report.candidates}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        bench = [sys.executable, "-c", "from gateway.cli import app; app()", "bench"]
        subprocess.run([*bench, "--compare", ",".join(PEERS.values()), "--max-concurrency", "1",
                        "--random-input-len", str(args.prompt), "--random-output-len", str(args.output),
                        "--num-prompts", str(args.num_prompts), "--output", str(out)], check=True)
        measured = {runtime: 1000 / json.loads(out.read_text())["compare"][peer]["median_tpot_ms"]
                    for runtime, peer in PEERS.items()}
    print("\n| runtime | estimated decode tok/s | measured decode tok/s | estimate / measured |")
    print("|---|---|---|---|")
    for runtime in PEERS:
        ratio = estimates[runtime] / measured[runtime]
        print(f"| {runtime} | {estimates[runtime]:.1f} | {measured[runtime]:.1f} | {ratio:.2f} "
              f"({'within' if abs(ratio - 1) <= 0.35 else 'outside'} 35%) |")


if __name__ == "__main__":
    main()
