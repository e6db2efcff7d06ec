"""What a flood of 7 MB bodies from a tenant over its quota does to everyone else: another
tenant's time to first token and `/health`'s latency, unloaded and under the flood, in one run.

    python benchmarks/hostile_flood.py --flooders 2 --duration 20 --output flood.json
    python benchmarks/hostile_flood.py --checkout /path/to/an/older/checkout   # the same, on its code

`servegate serve` runs the default model on the built-in engine (SQLite, no Redis). The victim
tenant streams short chat completions one after another (8 tokens each) while `/health` is
asked every 50 ms; then the same again while each flooder posts 7 MB bodies in a loop, turn
about to `/tokenize` and `/v1/chat/completions`, with the key of a tenant whose tokens for the
day are spent. The gateway (its API and engine processes) runs on CPU 0, the clients on CPU 1, the
flooders in a process of their own. The result is each phase's p50 and p99 and the flood's over
the unloaded ones.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.measure.baselines import free_port  # noqa: E402
from backends.launch import supervised  # noqa: E402
from gateway.operations.telemetry import percentile  # noqa: E402

FLOOD_BYTES = 7 * 1024 * 1024


async def victim(http: httpx.AsyncClient, key: str, until: float, ttfts: list[float]) -> None:
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 8, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "Name three colours."}]}
    while time.monotonic() < until:
        started = time.monotonic()
        first = None
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=_bearer(key)) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                compact = line.replace(" ", "")
                if first is None and '"content":"' in compact and '"content":""' not in compact:
                    first = time.monotonic() - started
        ttfts.append(first)


async def probe(http: httpx.AsyncClient, until: float, latencies: list[float]) -> None:
    while time.monotonic() < until:
        started = time.monotonic()
        assert (await http.get("/health")).status_code == 200
        latencies.append(time.monotonic() - started)
        await asyncio.sleep(0.05)


async def flooder(http: httpx.AsyncClient, key: str, until: float, bodies: list[tuple[str, bytes]],
                  statuses: Counter) -> None:
    turn = 0
    while time.monotonic() < until:
        path, body = bodies[turn % len(bodies)]
        turn += 1
        try:
            response = await http.post(path, content=body, headers=_bearer(key) | {"content-type": "application/json"})
            statuses[f"{path} {response.status_code}"] += 1
        except httpx.HTTPError as exc:  # a server that closes on an unread body
            statuses[f"{path} {type(exc).__name__}"] += 1


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def flood(url: str, key: str, flooders: int, duration: float, results) -> None:
    """The flooders, in a process of their own: their client work is not the victim's."""
    text = "lorem ipsum " * (FLOOD_BYTES // 12)
    bodies = [("/tokenize", json.dumps({"inputs": text}).encode()),
              ("/v1/chat/completions", json.dumps({"model": "SmolLM2-135M-Instruct", "max_tokens": 8,
                                                   "messages": [{"role": "user", "content": text}]}).encode())]
    statuses = Counter()

    async def run() -> None:
        until = time.monotonic() + duration
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            await asyncio.gather(*(flooder(http, key, until, bodies, statuses) for _ in range(flooders)))

    asyncio.run(run())
    results.put(dict(statuses))


async def measured(url: str, victim_key: str, duration: float) -> tuple[list[float], list[float]]:
    ttfts, health = [], []
    until = time.monotonic() + duration
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        await asyncio.gather(victim(http, victim_key, until, ttfts), probe(http, until, health))
    return ttfts, health


def phase(url: str, victim_key: str, flood_key: str | None, flooders: int, duration: float) -> dict:
    statuses, results = {}, multiprocessing.Queue()
    flooding = multiprocessing.Process(target=flood, args=(url, flood_key, flooders, duration, results)) \
        if flood_key else None
    if flooding:
        flooding.start()
    ttfts, health = asyncio.run(measured(url, victim_key, duration))
    if flooding:
        statuses = results.get()
        flooding.join()
    ms = lambda values, q: round(1000 * percentile(values, q), 1)  # noqa: E731
    return {"victim_requests": len(ttfts), "ttft_p50_ms": ms(ttfts, 50), "ttft_p99_ms": ms(ttfts, 99),
            "health_probes": len(health), "health_p50_ms": ms(health, 50), "health_p99_ms": ms(health, 99),
            "flood": statuses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flooders", type=int, default=2)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of each phase")
    parser.add_argument("--checkout", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the servegate checkout whose gateway runs (default: this one)")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    admin = "sg-bench-" + os.urandom(16).hex()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="servegate-flood-") as home:
        env = {"SERVEGATE_DATABASE_URL": f"sqlite:///{home}/servegate.db", "SERVEGATE_SPOOL_DIR": f"{home}/spool",
               "SERVEGATE_ADMIN_KEY": admin, "PYTHONPATH": str(args.checkout)}
        command = ["taskset", "-c", "0", sys.executable, "-m", "gateway", "serve", "--port", str(port),
                   "--log-level", "warning"]
        os.sched_setaffinity(0, {1})  # the clients (victim, probe, flooders) on the other core
        with supervised(command, url, "/ready", env, 600, cwd=args.checkout):
            keys = {}
            for name, limits in (("victim", {}), ("flooder", {"tokens_per_day": 16})):
                assert httpx.post(f"{url}/admin/tenants", headers=_bearer(admin),
                                  json={"name": name, **limits}).status_code == 201
                keys[name] = httpx.post(f"{url}/admin/keys", headers=_bearer(admin),
                                        json={"tenant": name}).json()["key"]
            spent = httpx.post(f"{url}/v1/completions", headers=_bearer(keys["flooder"]),
                               json={"model": "SmolLM2-135M-Instruct", "prompt": [1, 2], "max_tokens": 14,
                                     "ignore_eos": True})
            assert spent.status_code == 200, spent.text  # the flooder's tokens for the day, spent
            phase(url, keys["victim"], None, 0, 3)  # warm-up
            unloaded = phase(url, keys["victim"], None, 0, args.duration)
            flooded = phase(url, keys["victim"], keys["flooder"], args.flooders, args.duration)
    result = {"checkout": str(args.checkout), "flooders": args.flooders, "duration_s": args.duration,
              "unloaded": unloaded, "flood": flooded,
              "ratio": {k: round(flooded[k] / unloaded[k], 2) for k in ("ttft_p50_ms", "ttft_p99_ms", "health_p50_ms",
                                                                     "health_p99_ms")}}
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
