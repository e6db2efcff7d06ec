"""Many LoRA adapters at once: the built-in engine against vLLM's CPU build (`backends/peers.py`)
with the same adapters, and against its own base-only figure, on the shared-prefix load at
concurrency 16; then the time to load an adapter at run time on each.

    python benchmarks/lora_serving.py [--adapters 8] [--rank 16] [--num-prompts 36]

The adapters are made here with PEFT on the default model (random factors, `init_lora_weights`
off, ranks alternating rank and rank/2, targets alternating attention's four projections and all
seven). The load has one group per model (the base and each adapter: one customer's system prompt
goes with its adapter), 512-token system prompts, 32-token questions, 64 output tokens, greedy.
Three `servegate bench` runs follow one another: the engine with no adapter (every group to the
base), the engine with the adapters, vLLM with them (`--enable-lora --max-loras N
--max-lora-rank R --lora-modules ...`). Loading at run time: the engine's `load_adapter` (weights
read into host memory) plus the first request's extra time over the base's (the copy into a compute
slot); vLLM's `POST /v1/load_lora_adapter` (with VLLM_ALLOW_RUNTIME_LORA_UPDATING) plus its first
request's extra time likewise. Both systems run bf16 where the CPU has it, as in the engine's
main comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.measure.baselines import free_port  # noqa: E402
from backends import peers  # noqa: E402
from backends.base import Adapter, GenerateRequest  # noqa: E402
from backends.builtin import BuiltinBackend, EngineConfig  # noqa: E402
from backends.builtin.worker.loader import default_model_path, gguf_to_hf_dir  # noqa: E402
from backends.launch import supervised  # noqa: E402
from tests.lora_adapters import make_adapter  # noqa: E402

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]


def adapters(directory: Path, count: int, rank: int) -> dict[str, str]:
    base = gguf_to_hf_dir(default_model_path())
    return {f"a{i}": str(make_adapter(base, directory / f"a{i}", rank if i % 2 else rank // 2,
                                      ALL if i % 2 else ATTENTION, seed=i)) for i in range(count)}


def bench(compare: str, system_args: list[str], args, out: Path, lora_modules: list[str] = ()) -> dict:
    command = [sys.executable, "-m", "gateway", "bench", "--compare", compare, "--dataset", "shared-prefix",
               "--num-prompts", str(args.num_prompts), "--gsp-num-groups", str(args.adapters + 1),
               "--gsp-system-prompt-len", "512", "--gsp-question-len", "32", "--gsp-output-len", "64",
               "--max-concurrency", "16", "--num-warmups", "2", "--output", str(out)]
    command += [f"--system-args={spec}" for spec in system_args]
    if lora_modules:
        command += ["--lora-modules", ",".join(lora_modules)]
    subprocess.run(command, check=True)
    return json.loads(out.read_text())["compare"]


async def engine_load_times(paths: dict[str, str], rank: int) -> list[tuple[float, float]]:
    """(load_adapter s, first request's extra s over the base's) per adapter, on the engine."""
    backend = BuiltinBackend(EngineConfig(enable_lora=True, max_loras=len(paths), max_lora_rank=rank), name="engine")
    await backend.start()

    async def one_token(adapter: str | None) -> float:
        started = time.perf_counter()
        request = GenerateRequest(request_id=f"t-{time.perf_counter_ns()}", prompt="Hello", max_tokens=1,
                                  temperature=0.0, adapter=adapter)
        async for _ in backend.generate(request):
            pass
        return time.perf_counter() - started

    try:
        await one_token(None)
        times = []
        for name, path in paths.items():
            started = time.perf_counter()
            await backend.load_adapter(Adapter(name, path))
            loaded = time.perf_counter() - started
            first, base = await one_token(name), await one_token(None)
            times.append((loaded, first - base))
        return times
    finally:
        await backend.close()


def vllm_load_times(paths: dict[str, str], rank: int) -> list[tuple[float, float]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = peers.vllm_command(gguf_to_hf_dir(default_model_path()), port, "smollm2",
                                 extra=["--enable-lora", "--max-loras", str(len(paths)), "--max-lora-rank", str(rank)])
    env = peers.vllm_env() | {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    with supervised(command, url, "/health", env, 900), httpx.Client(base_url=url, timeout=120) as client:
        def one_token(model: str) -> float:
            started = time.perf_counter()
            client.post("/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 1,
                                                 "temperature": 0}).raise_for_status()
            return time.perf_counter() - started

        one_token("smollm2")
        times = []
        for name, path in paths.items():
            started = time.perf_counter()
            client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}).raise_for_status()
            loaded = time.perf_counter() - started
            first, base = one_token(name), one_token("smollm2")
            times.append((loaded, first - base))
        return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=36)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        paths = adapters(Path(tmp), args.adapters, args.rank)
        names = list(paths)
        slots = ["--max-loras", str(args.adapters), "--max-lora-rank", str(args.rank)]
        ours = " ".join([*slots, *(f"--lora {name}={path}" for name, path in paths.items())])
        theirs = " ".join(["--enable-lora", *slots, "--lora-modules", *(f"{n}={p}" for n, p in paths.items())])
        base = bench("builtin", [], args, Path(tmp) / "base.json")["builtin"]
        lora = bench("builtin,vllm", [f"builtin={ours}", f"vllm={theirs}"], args, Path(tmp) / "lora.json", names)
        loads = {"servegate": asyncio.run(engine_load_times(paths, args.rank)),
                 "vLLM": vllm_load_times(paths, args.rank)}
    rows = {"servegate, base only": base, "servegate, adapters": lora["builtin"], "vLLM, adapters": lora["vllm"]}
    print("\n| system | output tok/s | p50 TTFT ms | p50 TPOT ms | errors |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['output_throughput']:.1f} | {r['median_ttft_ms']:.0f} | {r['median_tpot_ms']:.1f} | "
              f"{sum(e is not None for e in r['errors'])} |")
    ours_tps = lora["builtin"]["output_throughput"]
    print(f"\nservegate with {args.adapters} adapters / base only: {ours_tps / base['output_throughput']:.2f}x; "
          f"/ vLLM with the same adapters: {ours_tps / lora['vllm']['output_throughput']:.2f}x")
    for system, times in loads.items():
        print(f"{system}: load at run time median {statistics.median(t for t, _ in times) * 1000:.0f} ms, "
              f"first request's extra median {statistics.median(f for _, f in times) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
