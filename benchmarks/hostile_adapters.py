"""What a tenant registering hostile LoRA adapters does to everyone else: another tenant's time to
first token, `/health`'s latency and `/ready`, unloaded and while the hostile tenant works, in one run.

    python benchmarks/hostile_adapters.py --duration 20 --output hostile.json

`servegate serve --enable-lora` runs the default model on the built-in engine (SQLite, no Redis),
with a tenant adapter directory. The victim tenant streams short chat completions one after
another (8 tokens each) while `/health` and `/ready` are asked every 50 ms; then the same again
while the hostile tenant, in a process of its own, loops over the malformed adapters of
`tests/test_hostile_adapters.py` (garbage weights, configs of the wrong types, patterns that do not
compile, tensors that are not factors...), registering each (refused at registration), and calls
an adapter that is well formed but not the model's shape (refused when the engine first loads it).
The gateway runs on CPU 0, the clients on CPU 1. The result is each phase's p50 and p99, the
hostile phase's over the unloaded one, and the statuses the hostile tenant got.
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
from benchmarks.hostile_flood import _bearer, probe, victim  # noqa: E402
from gateway.operations.telemetry import percentile  # noqa: E402
from tests.lora_adapters import write_adapter  # noqa: E402
from tests.test_hostile_adapters import MALFORMED, malformed  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


async def ready_probe(http: httpx.AsyncClient, until: float, statuses: Counter) -> None:
    while time.monotonic() < until:
        statuses[(await http.get("/ready")).status_code] += 1
        await asyncio.sleep(0.05)


def hostile(url: str, key: str, root: Path, duration: float, results) -> None:
    """Registrations of every malformed kind in turn, and calls of an adapter that does not fit."""
    statuses = Counter()

    async def run() -> None:
        until, turn = time.monotonic() + duration, 0
        async with httpx.AsyncClient(base_url=url, timeout=300, headers=_bearer(key)) as http:
            while time.monotonic() < until:
                kind = list(MALFORMED)[turn % len(MALFORMED)]
                path = malformed(kind, root / "hostile" / f"p{turn}")
                answer = await http.post("/admin/adapters", json={"name": f"p{turn}", "base": MODEL,
                                                                  "path": str(path)})
                statuses[f"register {answer.status_code}"] += 1
                answer = await http.post("/v1/completions", json={"model": "misfit", "prompt": "hi", "max_tokens": 4})
                statuses[f"misfit {answer.status_code}"] += 1
                turn += 1

    asyncio.run(run())
    results.put(dict(statuses))


async def measured(url: str, victim_key: str, duration: float):
    ttfts, health, ready = [], [], Counter()
    until = time.monotonic() + duration
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        await asyncio.gather(victim(http, victim_key, until, ttfts), probe(http, until, health),
                             ready_probe(http, until, ready))
    return ttfts, health, ready


def phase(url: str, victim_key: str, hostile_key: str | None, root: Path, duration: float) -> dict:
    statuses, results = {}, multiprocessing.Queue()
    working = multiprocessing.Process(target=hostile, args=(url, hostile_key, root, duration, results)) \
        if hostile_key else None
    if working:
        working.start()
    ttfts, health, ready = asyncio.run(measured(url, victim_key, duration))
    if working:
        statuses = results.get()
        working.join()
    ms = lambda values, q: round(1000 * percentile(values, q), 1)  # noqa: E731
    return {"victim_requests": len(ttfts), "ttft_p50_ms": ms(ttfts, 50), "ttft_p99_ms": ms(ttfts, 99),
            "health_probes": len(health), "health_p50_ms": ms(health, 50), "health_p99_ms": ms(health, 99),
            "ready": dict(ready), "hostile": statuses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of each phase")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    admin = "sg-bench-" + os.urandom(16).hex()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    checkout = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="servegate-hostile-") as home:
        root = Path(home) / "tenants"
        env = {"SERVEGATE_DATABASE_URL": f"sqlite:///{home}/servegate.db", "SERVEGATE_SPOOL_DIR": f"{home}/spool",
               "SERVEGATE_ADMIN_KEY": admin, "SERVEGATE_TENANT_ADAPTER_DIR": str(root),
               "SERVEGATE_ADAPTER_STORE_DIR": f"{home}/store", "PYTHONPATH": str(checkout)}
        command = ["taskset", "-c", "0", sys.executable, "-m", "gateway", "serve", "--port", str(port),
                   "--log-level", "warning", "--enable-lora"]
        os.sched_setaffinity(0, {1})  # the clients on the other core
        with supervised(command, url, "/ready", env, 600, cwd=checkout):
            keys = {}
            for name in ("victim", "hostile"):
                made = httpx.post(f"{url}/admin/tenants", headers=_bearer(admin), json={"name": name})
                assert made.status_code == 201, made.text
                keys[name] = httpx.post(f"{url}/admin/keys", headers=_bearer(admin), json={
                    "tenant": name, "scopes": ["inference", "admin"]}).json()["key"]
            misfit = write_adapter(root / "hostile" / "misfit", 1)  # the tiny test model's shapes
            assert httpx.post(f"{url}/admin/adapters", headers=_bearer(keys["hostile"]), json={
                "name": "misfit", "base": MODEL, "path": str(misfit)}).status_code == 201
            phase(url, keys["victim"], None, root, 3)  # warm-up
            unloaded = phase(url, keys["victim"], None, root, args.duration)
            loaded = phase(url, keys["victim"], keys["hostile"], root, args.duration)
    result = {"duration_s": args.duration, "unloaded": unloaded, "hostile": loaded,
              "ratio": {k: round(loaded[k] / unloaded[k], 2) for k in ("ttft_p50_ms", "ttft_p99_ms", "health_p50_ms",
                                                                    "health_p99_ms")}}
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
