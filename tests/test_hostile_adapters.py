"""LoRA adapters from a hostile tenant: malformed files, patterns that backtrack, links and swaps
into another tenant's files, and an engine core that dies anyway. The tenant that sends them gets
a 4xx naming the problem; no other tenant sees anything, and a dead core comes back with its
adapters."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
import torch

from backends import adapter_files, sandbox
from backends.builtin.backend import BuiltinBackend
from backends.builtin.config import EngineConfig

from .conftest import AUTH, bearer, gateway_app, serve_app, wait_ready
from .lora_adapters import write_adapter


# -- reading untrusted files ----------------------------------------------------------------------
def malformed(kind: str, directory: Path) -> Path:
    good = {"peft_type": "LORA", "r": 4, "lora_alpha": 8}
    if kind == "garbage weights":
        write_adapter(directory, 1)
        (directory / "adapter_model.safetensors").write_bytes(os.urandom(4096))
    elif kind == "config not an object":
        write_adapter(directory, 1, config=[])
    elif kind == "alpha not a number":
        write_adapter(directory, 1, config=good | {"lora_alpha": "x"})
    elif kind == "pattern that does not compile":
        write_adapter(directory, 1, config=good | {"alpha_pattern": {"(": 16}})
    elif kind == "pattern RE2 cannot run":
        write_adapter(directory, 1, config=good | {"alpha_pattern": {r"(q)\1": 16}})
    elif kind == "integer factor":
        write_adapter(directory, 1, tensors={"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
                                             torch.ones(4, 64, dtype=torch.int32)})
    elif kind == "factor without its pair":
        write_adapter(directory, 1, tensors={"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
                                             torch.ones(4, 64)})
    elif kind == "ranks that differ":
        name = "base_model.model.model.layers.0.self_attn.q_proj"
        write_adapter(directory, 1, tensors={f"{name}.lora_A.weight": torch.ones(4, 64),
                                             f"{name}.lora_B.weight": torch.ones(64, 3)})
    elif kind == "not a factor":
        write_adapter(directory, 1, tensors={"model.embed_tokens.weight": torch.ones(4, 64)})
    elif kind == "DoRA":
        write_adapter(directory, 1, config=good | {"use_dora": True})
    return directory


MALFORMED = {
    "garbage weights": "not a valid safetensors file",
    "config not an object": "adapter_config.json: the file: Input should be an object",
    "alpha not a number": "lora_alpha: .*valid number",
    "pattern that does not compile": "alpha_pattern key '\\(' is not a regular expression",
    "pattern RE2 cannot run": "alpha_pattern key .* is not a regular expression this server runs",
    "integer factor": "is I32, not a float type",
    "factor without its pair": "has lora_A but no lora_B",
    "ranks that differ": "lora_A has rank 4, lora_B 3",
    "not a factor": "is not a LoRA factor",
    "DoRA": "use_dora",
}


@pytest.mark.parametrize("kind", MALFORMED)
def test_a_malformed_adapter_is_refused_naming_its_problem(kind, tmp_path):
    with pytest.raises(ValueError, match=MALFORMED[kind]):
        adapter_files.check(malformed(kind, tmp_path / "adapter"))


def test_a_backtracking_pattern_is_matched_in_linear_time(tmp_path):
    """`(a|a)+` backtracks exponentially in Python's `re` over a run of a's (2**40 paths here);
    RE2 matches it at once, and the module keeps the default alpha."""
    module = "a" * 40 + ".q_proj"
    path = write_adapter(tmp_path / "adapter", 1, config={"r": 4, "lora_alpha": 8, "alpha_pattern": {
        r"(a|a)+\.q_projZ": 16, "a+\\.q_proj": 2}}, module=module)
    factors = sandbox.run(adapter_files.read_factors, (path,), what="reading", timeout_s=20,
                          memory_bytes=1 << 30)
    a, b = factors.modules[module]
    plain = adapter_files.read_factors(write_adapter(tmp_path / "plain", 1, module=module)).modules[module][1]
    assert torch.allclose(b, plain * 2 / 8)  # the second key's alpha, over the default's


def crash() -> None:
    os.abort()


def hang() -> None:
    time.sleep(60)


def flood() -> None:
    blocks = []
    while True:
        blocks.append(bytearray(64 << 20))


def test_the_sandbox_turns_a_crash_a_hang_and_a_flood_into_errors():
    with pytest.raises(ValueError, match="reading crashed \\(signal SIGABRT\\)"):
        sandbox.run(crash, (), what="reading", timeout_s=30, memory_bytes=1 << 30)
    started = time.monotonic()
    with pytest.raises(ValueError, match="took longer than 1 s"):
        sandbox.run(hang, (), what="reading", timeout_s=1, memory_bytes=1 << 30)
    assert time.monotonic() - started < 10
    with pytest.raises(ValueError, match="more than the 256 MiB of memory allowed"):
        sandbox.run(flood, (), what="reading", timeout_s=30, memory_bytes=256 << 20)


def test_a_snapshot_follows_no_link_out_of_the_tenants_directory(tmp_path):
    mine, theirs, store = tmp_path / "a", tmp_path / "b", tmp_path / "store"
    secret = write_adapter(theirs / "secret", 2)
    linked = write_adapter(mine / "linked", 1)
    (linked / "adapter_model.safetensors").unlink()
    (linked / "adapter_model.safetensors").symlink_to(secret / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="cannot be read as a regular file"):
        adapter_files.snapshot(linked, store, mine, 1 << 30)
    (mine / "through").symlink_to(secret)  # a linked directory: its files are opened in b/
    with pytest.raises(ValueError, match="lies outside"):
        adapter_files.snapshot(mine / "through", store, mine, 1 << 30)
    with pytest.raises(ValueError, match="exceed the 0 MiB allowed"):
        adapter_files.snapshot(write_adapter(mine / "big", 1), store, mine, 1000)


def test_the_stored_copy_is_what_was_checked_whatever_happens_to_the_source(tmp_path):
    source = write_adapter(tmp_path / "a" / "adapter", 1)
    digest, copy = adapter_files.snapshot(source, tmp_path / "store", tmp_path / "a", 1 << 30)
    before = adapter_files.read_factors(copy).modules
    write_adapter(source, 99)  # the tenant rewrites its files after registering
    assert adapter_files.snapshot(source, tmp_path / "store", tmp_path / "a", 1 << 30)[0] != digest
    adapter_files.verify(copy, digest)
    after = adapter_files.read_factors(copy).modules
    assert all(torch.equal(before[m][1], after[m][1]) for m in before)
    with open(copy / "adapter_model.safetensors", "r+b") as stored:  # the store itself tampered with
        stored.seek(-4, os.SEEK_END)
        stored.write(b"\0\0\0\0")
    with pytest.raises(ValueError, match="changed since they were checked"):
        adapter_files.verify(copy, digest)


# -- through the gateway --------------------------------------------------------------------------
def lora_engine(tiny_model_dir) -> BuiltinBackend:
    return BuiltinBackend(EngineConfig(model=str(tiny_model_dir), dtype="float32", served_name="tiny",
                                       enable_lora=True, max_lora_rank=8), "tiny")


@contextlib.asynccontextmanager
async def serving(backend: BuiltinBackend, home: Path, **settings):
    """A gateway over `backend` on a loopback socket, ready, and a client of it."""
    with serve_app(gateway_app({"tiny": backend}, home, **settings)) as url:
        await asyncio.to_thread(wait_ready, url)
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            yield client


async def admin_of(client: httpx.AsyncClient, name: str) -> dict[str, str]:
    assert (await client.post("/admin/tenants", json={"name": name}, headers=AUTH)).status_code == 201
    made = await client.post("/admin/keys", json={"tenant": name, "scopes": ["inference", "admin"]}, headers=AUTH)
    return bearer(made.json()["key"])


async def register(client: httpx.AsyncClient, headers: dict, name: str, path: Path) -> httpx.Response:
    return await client.post("/admin/adapters", headers=headers, json={"name": name, "base": "tiny",
                                                                       "path": str(path)})


async def greedy(client: httpx.AsyncClient, headers: dict, model: str) -> httpx.Response:
    return await client.post("/v1/completions", headers=headers, json={
        "model": model, "prompt": "The adapter says", "max_tokens": 8, "temperature": 0, "ignore_eos": True})


def text(answer: httpx.Response) -> str:
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["text"]


@pytest.mark.slow
async def test_hostile_adapters_answer_their_owner_4xx_while_another_tenants_stream_runs_on(
        tiny_model_dir, tmp_path):
    root = tmp_path / "tenants"
    async with serving(lora_engine(tiny_model_dir), tmp_path, tenant_adapter_dir=root) as client:
        hostile, victim = await admin_of(client, "hostile"), await admin_of(client, "victim")

        async def victim_stream() -> list[str]:
            async with client.stream("POST", "/v1/completions", headers=victim, json={
                    "model": "tiny", "prompt": "Meanwhile", "max_tokens": 300, "temperature": 0,
                    "ignore_eos": True, "stream": True}) as response:
                assert response.status_code == 200
                return [line async for line in response.aiter_lines() if line]

        streaming = asyncio.create_task(victim_stream())
        for number, (kind, problem) in enumerate(MALFORMED.items()):
            answer = await register(client, hostile, f"bad-{number}", malformed(kind, root / "hostile" / str(number)))
            assert answer.status_code == 400, (kind, answer.text)
            error = answer.json()["error"]
            assert error["param"] == "path" and re.search(problem, error["message"]), (kind, error)
            assert (await client.get("/ready")).status_code == 200
        # Well formed, but not this model's shape: refused when first loaded, to whoever calls it.
        wrong = write_adapter(root / "hostile" / "wrong", 3, module="model.layers.{i}.mlp.{p}")
        assert (await register(client, hostile, "wrong", wrong)).status_code == 201
        refused = await greedy(client, hostile, "wrong")
        assert refused.status_code == 400 and "gate_proj" not in refused.text, refused.text
        assert re.search("cannot be served: target model.layers.0.mlp.[qkvo]_proj is not a layer of this model",
                         refused.json()["error"]["message"]), refused.text
        again = await greedy(client, hostile, "wrong")  # answered from the first refusal, not read again
        assert again.status_code == 400 and again.json()["error"]["message"] == refused.json()["error"]["message"]
        lines = await streaming
        assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2], lines[-2:]
        assert text(await greedy(client, victim, "tiny"))
        assert (await client.get("/ready")).status_code == 200


@pytest.mark.slow
async def test_a_linked_or_swapped_adapter_never_serves_another_tenants_weights(tiny_model_dir, tmp_path):
    root = tmp_path / "tenants"
    async with serving(lora_engine(tiny_model_dir), tmp_path, tenant_adapter_dir=root) as client:
        mine, theirs = await admin_of(client, "mine"), await admin_of(client, "theirs")
        secret = write_adapter(root / "theirs" / "secret", 2)
        assert (await register(client, theirs, "secret", secret)).status_code == 201
        own = write_adapter(root / "mine" / "own", 1)
        assert (await register(client, mine, "own", own)).status_code == 201
        assert (await register(client, mine, "own-copy", write_adapter(root / "mine" / "copy", 1))).status_code == 201

        linked = write_adapter(root / "mine" / "linked", 1)
        (linked / "adapter_model.safetensors").unlink()
        (linked / "adapter_model.safetensors").symlink_to(secret / "adapter_model.safetensors")
        answer = await register(client, mine, "linked", linked)
        assert answer.status_code == 400 and "regular file" in answer.json()["error"]["message"]

        # The registered directory swapped for a link to the other tenant's before its first use:
        # the engine reads the copy checked at registration.
        os.rename(own, root / "mine" / "own-old")
        own.symlink_to(secret, target_is_directory=True)
        served = text(await greedy(client, mine, "own"))
        assert served == text(await greedy(client, mine, "own-copy"))
        assert served != text(await greedy(client, theirs, "secret"))


@pytest.mark.slow
async def test_a_killed_engine_core_is_restarted_with_its_adapters(tiny_model_dir, tmp_path):
    backend = lora_engine(tiny_model_dir)
    root = tmp_path / "tenants"
    async with serving(backend, tmp_path, tenant_adapter_dir=root) as client:
        owner = await admin_of(client, "owner")
        assert (await register(client, owner, "a", write_adapter(root / "owner" / "a", 1))).status_code == 201
        before = text(await greedy(client, owner, "a"))

        lines = []
        async with client.stream("POST", "/v1/completions", headers=owner, json={
                "model": "a", "prompt": "On and on", "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
                "stream": True}) as response:
            async for line in response.aiter_lines():
                lines.append(line)
                if len(lines) == 10:
                    os.kill(backend._front._process.pid, signal.SIGKILL)
                    killed = time.monotonic()
        ended = [line for line in lines if line][-2:]
        assert "engine process exited (killed by signal SIGKILL)" in ended[0] and ended[1] == "data: [DONE]", ended
        assert (await client.get("/ready")).status_code == 503
        while (await client.get("/ready")).status_code != 200:
            assert time.monotonic() - killed < 10, "/ready did not come back within 10 s"
            await asyncio.sleep(0.1)
        while (answer := await greedy(client, owner, "a")).status_code != 200:  # the router sees it at its next poll
            assert answer.status_code == 503 and time.monotonic() - killed < 10, answer.text
            await asyncio.sleep(0.1)
        assert text(answer) == before
