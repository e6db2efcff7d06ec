"""`servegate advise --measure ... --calibrate` against the live vLLM CPU build and the built-in
engine on this machine: the estimate, the measurement, and the estimate again with the derates
learned from it.

    python benchmarks/advise_calibration.py [--concurrency 4] [--num-prompts 16]

Both serve the default model (vLLM its Hugging Face directory, bf16; `servegate serve` the GGUF,
`--dtype auto`), one after the other; `--hardware local` measures this CPU first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.measure.baselines import free_port, servegate_command, servegate_env  # noqa: E402
from backends import peers  # noqa: E402
from backends.builtin.worker.loader import default_model_path, gguf_to_hf_dir  # noqa: E402
from backends.launch import supervised  # noqa: E402


def advise(model: Path, runtime: str, args, env: dict[str, str], measure: str | None = None) -> dict:
    """The report; with `measure`, measured once and calibrated from that measurement."""
    command = [sys.executable, "-m", "gateway", "advise", "--model", str(model), "--hardware", "local",
               "--runtimes", runtime, "--prompt-tokens", str(args.prompt_tokens), "--output-tokens",
               str(args.output_tokens), "--concurrency", str(args.concurrency), "--num-prompts", str(args.num_prompts),
               "--slo-ttft-ms", "10000", "--slo-tpot-ms", "1000", "--format", "json"]
    if measure:
        command += ["--measure", measure, "--calibrate"]
    out = subprocess.run(command, check=True, capture_output=True, text=True, env={**os.environ, **env}).stdout
    return json.loads(out)


def warm_up(url: str, env: dict[str, str], args) -> None:
    """Other prompts than the measured ones (a different seed): the server compiles its batch
    shapes now, and the measurement finds nothing of them in its prefix cache."""
    subprocess.run([sys.executable, "-m", "gateway", "bench", "--base-url", url, "--dataset", "random",
                    "--random-input-len", str(args.prompt_tokens), "--random-output-len", str(args.output_tokens),
                    "--num-prompts", str(2 * args.concurrency), "--max-concurrency", str(args.concurrency),
                    "--seed", "99"], check=True, stdout=subprocess.DEVNULL, env={**os.environ, **env})


def rows(name: str, before: dict, after: dict) -> list[str]:
    e0, c = before["candidates"][0]["estimates"], after["candidates"][0]
    e1, m = c["estimates"], c["measured"]
    return [f"| {name} | {e0['ttft_ms']:.0f} | {e0['tpot_ms']:.1f} | {m['median_ttft_ms']:.0f} | "
            f"{m['median_tpot_ms']:.1f} | {e1['ttft_ms']:.0f} | {e1['tpot_ms']:.1f} |",
            f"| | {after['assumptions']['calibration']} |"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=64)
    args = parser.parse_args()
    gguf = default_model_path()
    hf = gguf_to_hf_dir(gguf)
    print("| runtime | estimated TTFT ms | estimated TPOT ms | measured TTFT ms | measured TPOT ms | "
          "calibrated TTFT ms | calibrated TPOT ms |")
    print("|---|---|---|---|---|---|---|")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with supervised(peers.vllm_command(hf, port, "smollm2"), url, "/health", peers.vllm_env(), 900):
        warm_up(url, {}, args)
        print(*rows("vLLM", advise(hf, "vllm", args, {}), advise(hf, "vllm", args, {}, f"vllm={url}@smollm2")),
              sep="\n", flush=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with servegate_env() as (env, key), supervised(servegate_command(port), url, "/ready", env, 900):
        env = {"OPENAI_API_KEY": key}
        warm_up(url, env, args)
        print(*rows("servegate built-in", advise(gguf, "builtin", args, env),
                    advise(gguf, "builtin", args, env, f"builtin={url}")), sep="\n", flush=True)

if __name__ == "__main__":
    main()
