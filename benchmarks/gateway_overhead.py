"""What a gateway adds to every request: servegate and LiteLLM's proxy, side by side, in front
of the same instant upstream, at the same open-loop request rates, in one run.

    python benchmarks/gateway_overhead.py --litellm /opt/litellm/bin/litellm \\
        --rates 5,20,50,100,200 --duration 10 --output overhead.json

The upstream is an OpenAI-compatible stub that answers at once (8 content chunks when
streamed). Every rate is sent three times: straight to the stub, through servegate, through
LiteLLM; half the requests stream. Added latency is the gateway's percentile minus the
direct one (time to first content byte for streams, whole response otherwise). Both
gateways check a key and enforce rate limits: servegate a tenant key with rpm/tpm quotas,
LiteLLM its master key with per-model rpm/tpm. Each gateway runs alone on CPU 0; the stub
and this load generator share CPU 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.measure.baselines import free_port  # noqa: E402
from advisor.measure.stub import CHUNKS, MODEL  # noqa: E402
from backends.launch import supervised  # noqa: E402

FIRST_CONTENT = re.compile(rb'"content":\s*"[^"]')  # a chunk with text (not the empty role chunk)


# -- the gateways ----------------------------------------------------------------------------------
@contextlib.contextmanager
def process(command: list[str], url: str, ready: str, env: dict | None = None, cpu: int | None = None,
            headers: dict | None = None):
    """A gateway or the stub, pinned to `cpu`; yields its process for CPU and memory figures."""
    prefix = ["taskset", "-c", str(cpu)] if cpu is not None else []
    with supervised(prefix + command, url, ready, env, 180, headers) as proc:
        yield psutil.Process(proc.pid)


def servegate(stub_url: str, home: Path, port: int):
    key = "sg-bench-" + os.urandom(16).hex()
    config = home / "servegate.yaml"
    config.write_text(f"backends:\n  - name: stub\n    kind: openai\n    url: {stub_url}\n    model: {MODEL}\n")
    env = {"SERVEGATE_DATABASE_URL": f"sqlite:///{home}/servegate.db", "SERVEGATE_SPOOL_DIR": str(home / "spool"),
           "SERVEGATE_ADMIN_KEY": key}
    exe = [sys.executable, "-m", "gateway"]
    subprocess.run([*exe, "db", "upgrade"], env={**os.environ, **env}, check=True, capture_output=True)
    subprocess.run([*exe, "tenants", "create", "bench", "--rpm", "10000000", "--tpm", "10000000000"],
                   env={**os.environ, **env}, check=True, capture_output=True)
    made = subprocess.run([*exe, "keys", "create", "--tenant", "bench"], env={**os.environ, **env}, check=True,
                          capture_output=True, text=True)
    tenant_key = made.stdout.strip().splitlines()[-1]
    command = [*exe, "serve", "--config", str(config), "--port", str(port)]
    return command, env, tenant_key


def litellm(exe: str, stub_url: str, home: Path, port: int):
    key = "sk-" + os.urandom(24).hex()
    config = home / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{MODEL}\n"
        f"      api_base: {stub_url}/v1\n"
        "      api_key: unused\n"
        "      rpm: 10000000\n"
        "      tpm: 10000000000\n"
        "general_settings:\n"
        f"  master_key: {key}\n")
    env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}
    command = [exe, "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"]
    return command, env, key


# -- the load ----------------------------------------------------------------------------------------
async def run_rate(url: str, key: str, rate: float, duration: float, seed: int) -> dict:
    rng = random.Random(seed)
    results: list[tuple[bool, float, float] | None] = []
    headers = {"Authorization": f"Bearer {key}", "content-type": "application/json"}
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
        async def one(stream: bool) -> None:
            body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello there"}],
                               "max_tokens": CHUNKS, "stream": stream}).encode()
            start = time.perf_counter()
            first = None
            try:
                async with session.post(f"{url}/v1/chat/completions", data=body,
                                        timeout=aiohttp.ClientTimeout(total=60)) as response:
                    if response.status != 200:
                        results.append(None)
                        await response.read()
                        return
                    async for line in response.content:
                        if first is None and (not stream or FIRST_CONTENT.search(line)):
                            first = time.perf_counter()
                end = time.perf_counter()
            except (aiohttp.ClientError, TimeoutError):
                results.append(None)
                return
            results.append((stream, (first or end) - start, end - start))

        tasks, t0, at = [], time.perf_counter(), 0.0
        while at < duration:
            at += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            tasks.append(asyncio.create_task(one(len(tasks) % 2 == 0)))
        sent_for = time.perf_counter() - t0
        await asyncio.gather(*tasks)
    done = [r for r in results if r is not None]
    ttft = [r[1] * 1000 for r in done]
    e2e = [r[2] * 1000 for r in done]
    return {"rate": rate, "achieved_rate": len(tasks) / sent_for, "requests": len(tasks),
            "errors": len(results) - len(done), "ttft_ms": percentiles(ttft), "e2e_ms": percentiles(e2e)}


def percentiles(values: list[float]) -> dict[str, float]:
    if len(values) < 2:
        return {"p50": float("nan"), "p95": float("nan"), "p99": float("nan")}
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": statistics.median(values), "p95": q[94], "p99": q[98]}


async def measure(url: str, key: str, rates: list[float], duration: float, proc: psutil.Process | None) -> list[dict]:
    rows = []
    await run_rate(url, key, 5, 2, seed=0)  # warm up connections, caches and lazy imports
    for i, rate in enumerate(rates):
        cpu0 = proc.cpu_times() if proc else None
        rss, stop = [], asyncio.Event()

        async def sample_rss(rss: list[int], stop: asyncio.Event) -> None:
            while not stop.is_set():
                if proc:
                    rss.append(sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]))
                await asyncio.sleep(0.25)

        sampler = asyncio.create_task(sample_rss(rss, stop))
        started = time.perf_counter()
        row = await run_rate(url, key, rate, duration, seed=i + 1)
        wall = time.perf_counter() - started
        stop.set()
        await sampler
        if proc:
            cpu1 = proc.cpu_times()
            row["cpu_percent"] = 100 * ((cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)) / wall
            row["rss_mb"] = max(rss) / 2**20
        rows.append(row)
        print(f"  {url} rate {rate:g}: ttft p50/p99 {row['ttft_ms']['p50']:.1f}/{row['ttft_ms']['p99']:.1f} ms, "
              f"errors {row['errors']}", file=sys.stderr)
    return rows


def added(via: list[dict], direct: list[dict]) -> list[dict]:
    out = []
    for v, d in zip(via, direct):
        out.append({"rate": v["rate"], "errors": v["errors"], "achieved_rate": v["achieved_rate"],
                    **{f"added_ttft_{p}_ms": v["ttft_ms"][p] - d["ttft_ms"][p] for p in ("p50", "p95", "p99")},
                    **{f"added_e2e_{p}_ms": v["e2e_ms"][p] - d["e2e_ms"][p] for p in ("p50", "p95", "p99")},
                    "cpu_percent": v.get("cpu_percent"), "rss_mb": v.get("rss_mb")})
    return out


def sustained(rows: list[dict], metric: str, budget_ms: float = 50.0) -> float:
    """The highest rate before the first one whose p99 added `metric` latency (ttft or e2e)
    breaks the budget or that had errors; 0 when even the lowest rate breaks it."""
    best = 0.0
    for row in rows:
        if row["errors"] or row[f"added_{metric}_p99_ms"] >= budget_ms:
            break
        best = row["rate"]
    return best


def summarize(report: dict) -> None:
    for name in ("servegate", "litellm"):
        if name in report:
            rows = report[name]["added"]
            report[name]["sustained_rate"] = {metric: sustained(rows, metric) for metric in ("ttft", "e2e")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--litellm", help="the `litellm` executable (pip install 'litellm[proxy]'); omit to skip")
    parser.add_argument("--rates", default="5,20,50,100,200")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    os.sched_setaffinity(0, {1})
    report: dict = {"rates": rates, "duration_s": args.duration, "chunks": CHUNKS}
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        stub_port = free_port()
        stub_url = f"http://127.0.0.1:{stub_port}"
        stub_cmd = [sys.executable, "-m", "uvicorn", "advisor.measure.stub:app", "--port", str(stub_port),
                    "--log-level", "warning", "--no-access-log"]
        root = str(Path(__file__).resolve().parents[1])
        with process(stub_cmd, stub_url, "/health", env={"PYTHONPATH": root}, cpu=1):
            print("direct", file=sys.stderr)
            direct = asyncio.run(measure(stub_url, "unused", rates, args.duration, None))
            report["direct"] = direct
            port = free_port()
            command, env, key = servegate(stub_url, home, port)
            with process(command, f"http://127.0.0.1:{port}", "/ready", env=env, cpu=0) as proc:
                print("servegate", file=sys.stderr)
                via = asyncio.run(measure(f"http://127.0.0.1:{port}", key, rates, args.duration, proc))
            report["servegate"] = {"raw": via, "added": added(via, direct)}
            if args.litellm:
                port = free_port()
                command, env, key = litellm(args.litellm, stub_url, home, port)
                with process(command, f"http://127.0.0.1:{port}", "/health/liveliness", env=env, cpu=0,
                             headers={"Authorization": f"Bearer {key}"}) as proc:
                    print("litellm", file=sys.stderr)
                    via = asyncio.run(measure(f"http://127.0.0.1:{port}", key, rates, args.duration, proc))
                report["litellm"] = {"raw": via, "added": added(via, direct)}
    summarize(report)
    text = json.dumps(report, indent=2)
    if args.output:
        args.output.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
