"""The advisor's roofline against measurement on this machine: estimated single-sequence decode
tokens/s of the built-in engine and of llama-cpp-python on the default model (hardware `local`,
measured with the model's row width) beside what `servegate bench` measures (1000 / median TPOT
at concurrency 1), twice: each runtime in process (`--backend`, the runtime alone) and each as
the server its users run (`--compare`: `servegate serve`, llama-cpp-python's OpenAI server), where
the HTTP server and the bench client share the machine's cores with the runtime.

Usage: python benchmarks/advisor_roofline.py [--prompt 128] [--output 128] [--num-prompts 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from advisor.advise import Workload, advise
from advisor.hardware import local
from advisor.model_facts import resolve
from backends.default_model import default_model_path

RUNTIMES = ("builtin", "llama-cpp")  # the advisor's runtime ids, also bench's backend and peer names
BENCH = [sys.executable, "-c", "from gateway.cli import app; app()", "bench"]


def median_tpots(args, *target: str) -> dict:
    """{name: median TPOT ms} from one bench run (`--backend NAME` or `--compare A,B`)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        subprocess.run([*BENCH, *target, "--max-concurrency", "1", "--random-input-len", str(args.prompt),
                        "--random-output-len", str(args.output), "--num-prompts", str(args.num_prompts),
                        "--output", str(out)], check=True)
        result = json.loads(out.read_text())
    if "compare" in result:
        return {name: summary["median_tpot_ms"] for name, summary in result["compare"].items()}
    return {target[1]: result["median_tpot_ms"]}


def estimates(args) -> tuple[float, dict]:
    """This machine measured afresh (its bandwidth drifts with its neighbours' load), then the
    advisor's decode estimate per runtime: (bandwidth GB/s, {runtime: tok/s})."""
    local.cache_clear()
    model = resolve(str(default_model_path()))
    hardware = local(model.hidden_size)
    report = advise(model, hardware, 1, Workload(prompt_tokens=args.prompt, output_tokens=args.output, concurrency=1),
                    runtimes=list(RUNTIMES))
    return hardware.bandwidth_gbs, {c.runtime: c.estimates["decode_tokens_per_s_single"] for c in report.candidates}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="estimate-then-measure rounds; the median ratio is kept")
    args = parser.parse_args()

    rows, ratios = [], {(r, how): [] for r in RUNTIMES for how in ("in process", "server")}
    for round_ in range(1, args.rounds + 1):
        bandwidth, estimated = estimates(args)
        measured = {"in process": {}, "server": median_tpots(args, "--compare", ",".join(RUNTIMES))}
        for runtime in RUNTIMES:
            measured["in process"] |= median_tpots(args, "--backend", runtime)
        for runtime in RUNTIMES:
            cells = []
            for how, tpots in measured.items():
                ratio = estimated[runtime] * tpots[runtime] / 1000
                ratios[runtime, how].append(ratio)
                cells.append(f"{1000 / tpots[runtime]:.1f} | {ratio:.2f}")
            rows.append(f"| {round_} | {bandwidth:.1f} | {runtime} | {estimated[runtime]:.1f} | {' | '.join(cells)} |")
    print("\n| round | local GB/s | runtime | estimated decode tok/s | measured in process | estimate / measured "
          "| measured as a server | estimate / measured |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print("\n| runtime | median estimate / measured, in process | median estimate / measured, as a server |")
    print("|---|---|---|")
    for runtime in RUNTIMES:
        cells = [f"{statistics.median(ratios[runtime, how]):.2f}" for how in ("in process", "server")]
        print(f"| {runtime} | " + " | ".join(f"{c} ({'within' if abs(float(c) - 1) <= 0.35 else 'outside'} 35%)"
                                            for c in cells) + " |")


if __name__ == "__main__":
    main()
