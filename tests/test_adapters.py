"""LoRA adapters as tenants' resources: who may call one (and who finds it missing), where it is
routed and loaded, what it is billed and limited as, and how TGI's clients and deployments name
adapters. Gateways run in process over fake backends that serve (or refuse) adapters."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import httpx
import pytest
from typer.testing import CliRunner

from backends.base import Adapter, Backend, Capabilities, Delta, Finish, Health, Load, Usage
from gateway.inference.fleet import Fleet
from gateway.inference.routing import PrefixIndex, RequestFacts, Router
from gateway.rollout.route_versions import PrefixAware, RouteOut, RouteSpec, RouteState, Target
from gateway.rollout.tgi_migration import MigrationError, TGIDeployment, lora_adapters, plan

from .conftest import AUTH, away_from_minute_edge, gateway_app, running, tenant
from .lora_adapters import write_adapter

PATH = "/adapters/support-v2"


class LoraBackend(Backend):
    """Answers every request with two tokens, remembering what it was asked; serves LoRA adapters
    unless `lora` is off (then the interface's default refusal stands)."""

    def __init__(self, name: str, lora: bool = True) -> None:
        self.name, self.lora = name, lora
        self.loaded: set[str] = set()
        self.loads: list[Adapter] = []
        self.unloads: list[str] = []
        self.requests = []

    async def generate(self, request):
        self.requests.append(request)
        yield Delta(0, "hi ", token_ids=(1,))
        yield Delta(0, "there", token_ids=(2,), finish_reason="stop")
        yield Finish(("stop",), Usage(3, 2))

    async def capabilities(self) -> Capabilities:
        return Capabilities(runtime="fake", version="1", model="base", max_context=4096, prefix_caching=True,
                            max_loras=4 if self.lora else 0, adapters=frozenset(self.loaded))

    async def health(self) -> Health:
        return Health.READY

    async def load(self) -> Load:
        return Load()

    async def load_adapter(self, adapter: Adapter) -> None:
        if not self.lora:
            return await super().load_adapter(adapter)
        self.loads.append(adapter)
        await asyncio.sleep(0.05)  # reading weights takes a while
        self.loaded.add(adapter.name)

    async def unload_adapter(self, name: str) -> None:
        self.unloads.append(name)
        self.loaded.discard(name)


async def register(client: httpx.AsyncClient, headers=AUTH, **fields) -> httpx.Response:
    return await client.post("/admin/adapters", json={"name": "support", "base": "base", "path": PATH} | fields,
                             headers=headers)


async def complete(client: httpx.AsyncClient, headers: dict, model: str) -> httpx.Response:
    return await client.post("/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 4},
                             headers=headers)


async def test_an_adapter_serves_its_owner_and_is_missing_for_another_tenant_exactly_as_an_unknown_model(tmp_path):
    backend = LoraBackend("one")
    async with running({"base": backend}, tmp_path) as client:
        owner, other = await tenant(client, "acme"), await tenant(client, "globex")
        assert (await register(client, owner="acme")).status_code == 201

        answered = await complete(client, owner, "support")
        assert answered.status_code == 200, answered.text
        assert answered.json()["model"] == "support"  # as the client named it
        assert "adapter=support" in answered.headers["x-servegate-route"]
        sent = backend.requests[-1]
        assert (sent.model, sent.adapter) == ("base", "support")
        assert (await complete(client, owner, "base")).status_code == 200
        assert backend.requests[-1].adapter is None

        hidden, unknown = await complete(client, other, "support"), await complete(client, other, "nonesuch")
        assert hidden.status_code == unknown.status_code == 404
        assert hidden.json()["error"]["code"] == "model_not_found"
        assert hidden.json() == json.loads(unknown.text.replace("nonesuch", "support"))
        assert len(backend.requests) == 2  # nothing reached the backend for the other tenant

        listed = {m["id"]: m for m in (await client.get("/v1/models", headers=owner)).json()["data"]}
        assert listed["support"]["parent"] == listed["support"]["root"] == "base"
        assert "parent" not in listed["base"]
        assert [m["id"] for m in (await client.get("/v1/models", headers=other)).json()["data"]] == ["base"]


async def test_an_adapter_shared_with_a_tenant_serves_it_and_a_tenant_administrator_registers_only_its_own(tmp_path):
    root = tmp_path / "tenant-adapters"
    async with running({"base": LoraBackend("one")}, tmp_path, tenant_adapter_dir=root) as client:
        admin = await tenant(client, "acme", scopes=("admin", "inference"))
        partner, outsider = await tenant(client, "initech"), await tenant(client, "globex")
        own = str(write_adapter(root / "acme" / "support", 1))
        made = await register(client, admin, owner="globex", tenants=["initech"], path=own)
        assert made.status_code == 404  # another tenant's name, to a tenant administrator
        for elsewhere in (PATH, str(root / "globex" / "theirs"), str(root / "acme" / ".." / "globex" / "theirs"),
                          "acme/support"):  # runtimes read what they are given: only the tenant's own directory
            refused = await register(client, admin, path=elsewhere)
            assert refused.status_code == 403 and refused.json()["error"]["code"] == "adapter_path_forbidden"
        made = await register(client, admin, tenants=["initech"], path=own)
        assert made.status_code == 201 and made.json()["owner"] == "acme"
        moved = await client.patch("/admin/adapters/support", json={"path": PATH}, headers=admin)
        assert moved.status_code == 403
        assert (await complete(client, partner, "support")).status_code == 200
        assert (await complete(client, outsider, "support")).status_code == 404

        # An operator's adapter: the tenant administrator neither lists nor removes it.
        assert (await register(client, name="house", tenants=["globex"])).status_code == 201
        assert [a["name"] for a in (await client.get("/admin/adapters", headers=admin)).json()] == ["support"]
        assert (await client.delete("/admin/adapters/house", headers=admin)).status_code == 404
        assert (await register(client, name="base")).status_code == 409  # a served model's name is taken
        assert (await client.patch("/admin/adapters/support", json={"tenants": []}, headers=admin)).status_code == 200
        assert (await complete(client, partner, "support")).status_code == 404
        assert (await client.delete("/admin/adapters/support", headers=admin)).status_code == 200
        assert (await complete(client, await tenant(client, "acme-2"), "support")).status_code == 404

        actions = [(e["action"], e["target"]) for e in (await client.get("/admin/audit", headers=AUTH)).json()]
        assert {("adapter.create", "support"), ("adapter.update", "support"), ("adapter.delete", "support"),
                ("adapter.create", "house")} <= set(actions)


async def test_without_a_tenant_adapter_directory_only_operators_register_adapters(tmp_path):
    async with running({"base": LoraBackend("one")}, tmp_path) as client:
        admin = await tenant(client, "acme", scopes=("admin", "inference"))
        refused = await register(client, admin, path=str(tmp_path / "acme" / "support"))
        assert refused.status_code == 403 and "Only an operator" in refused.json()["error"]["message"]
        assert (await register(client, owner="acme", path=PATH)).status_code == 201


async def test_a_tenant_administrator_learns_nothing_of_other_tenants_names(tmp_path):
    """A taken name answers as a served model's does, and sharing with a tenant that does not exist
    answers as sharing with one that does: neither says whose, or whether, a name is."""
    root = tmp_path / "tenant-adapters"
    async with running({"base": LoraBackend("one")}, tmp_path, tenant_adapter_dir=root) as client:
        prober = await tenant(client, "prober", scopes=("admin", "inference"))
        other = await tenant(client, "other", scopes=("admin", "inference"))
        assert (await register(client, other, name="secret-name", path=str(write_adapter(root / "other" / "a", 1)))
                ).status_code == 201
        mine = str(write_adapter(root / "prober" / "a", 1))
        taken = [await register(client, prober, name=name, path=mine) for name in ("secret-name", "base")]
        assert [answer.status_code for answer in taken] == [409, 409]
        messages = [answer.json()["error"]["message"].replace(name, "NAME")
                    for answer, name in zip(taken, ("secret-name", "base"))]
        assert messages[0] == messages[1] and "'other'" not in messages[0]
        shared = [await register(client, prober, name=f"mine-{n}", path=mine, tenants=[t])
                  for n, t in enumerate(("other", "no-such-tenant"))]
        assert [answer.status_code for answer in shared] == [201, 201]


async def test_each_backend_loads_an_adapter_once_and_its_requests_are_billed_per_adapter(tmp_path):
    backend = LoraBackend("one")
    async with running({"base": backend}, tmp_path) as client:
        owner = await tenant(client, "acme")
        await register(client, owner="acme")
        first = await asyncio.gather(*(complete(client, owner, "support") for _ in range(3)))  # all finding it cold
        assert [r.status_code for r in first] == [200] * 3
        assert (await complete(client, owner, "base")).status_code == 200
        assert backend.loads == [Adapter("support", PATH)]  # once, then listed by the backend's capabilities
        assert (await complete(client, owner, "support")).status_code == 200
        assert len(backend.loads) == 1

        client.gateway.ledger.flush()
        records = (await client.get("/admin/usage", params={"tenant": "acme"}, headers=AUTH)).json()["records"]
        assert Counter(r["adapter"] for r in records) == {"support": 4, None: 1}
        assert {r["model"] for r in records} == {"base"}
        series = (await client.get("/admin/usage/series", params={"tenant": "acme", "by": "adapter"},
                                   headers=AUTH)).json()["series"]
        assert {s["group"]: sum(p["requests"] for p in s["points"]) for s in series} == {"support": 4, "": 1}
        metrics = (await client.get("/metrics")).text
        assert 'servegate_requests_total{adapter="support",backend="one",model="base",status="ok",' \
               'tenant="acme"} 4.0' in metrics
        assert 'servegate_adapter_load_seconds_count{backend="one"} 1.0' in metrics


async def test_an_adapter_moved_or_unregistered_is_unloaded_from_the_backends_that_loaded_it(tmp_path):
    backend = LoraBackend("one")
    async with running({"base": backend}, tmp_path, refresh_s=0.05) as client:
        await register(client, owner="default")
        assert (await complete(client, AUTH, "support")).status_code == 200
        assert (await client.patch("/admin/adapters/support", json={"path": f"{PATH}-v2"},
                                   headers=AUTH)).status_code == 200
        for _ in range(100):
            if backend.unloads:
                break
            await asyncio.sleep(0.02)
        assert backend.unloads == ["support"]  # the old weights are not served under the name any more
        assert (await complete(client, AUTH, "support")).status_code == 200
        assert backend.loads == [Adapter("support", PATH), Adapter("support", f"{PATH}-v2")]
        assert (await client.delete("/admin/adapters/support", headers=AUTH)).status_code == 200
        for _ in range(100):
            if len(backend.unloads) == 2:
                break
            await asyncio.sleep(0.02)
        assert backend.unloads == ["support", "support"] and not backend.loaded


async def test_a_backend_that_cannot_serve_adapters_is_passed_over_and_named_when_none_is_left(tmp_path):
    plain, lora = LoraBackend("plain", lora=False), LoraBackend("lora")
    async with running({"plain": plain, "lora": lora}, tmp_path) as client:
        owner = await tenant(client, "acme")
        for alias, spec in (("base", {"targets": [{"backend": "plain"}], "fallbacks": ["lora"]}),
                            ("plain-only", {"targets": [{"backend": "plain"}]})):
            deployed = await client.post(f"/admin/routes/{alias}/deploy", json={"spec": spec}, headers=AUTH)
            assert deployed.status_code == 201, deployed.text
        await register(client, owner="acme")
        await register(client, name="stuck", base="plain-only", owner="acme")

        served = await complete(client, owner, "support")
        assert served.status_code == 200, served.text
        assert "backend=lora" in served.headers["x-servegate-route"]
        assert [r.adapter for r in lora.requests] == ["support"] and plain.requests == []

        refused = await complete(client, owner, "stuck")
        assert refused.status_code == 400
        assert "plain" in refused.json()["error"]["message"]
        assert "does not serve LoRA adapters" in refused.json()["error"]["message"]


async def test_an_adapters_own_rpm_limit_answers_429_for_every_tenant_using_it(tmp_path):
    async with running({"base": LoraBackend("one")}, tmp_path) as client:
        owner, partner = await tenant(client, "acme"), await tenant(client, "initech")
        await register(client, owner="acme", tenants=["initech"], rpm=2)
        away_from_minute_edge()
        assert (await complete(client, owner, "support")).status_code == 200
        assert (await complete(client, partner, "support")).status_code == 200
        limited = await complete(client, owner, "support")
        assert limited.status_code == 429, limited.text
        assert limited.json()["error"]["code"] == "rate_limit_exceeded"
        assert "adapter:support" in limited.json()["error"]["message"]
        assert int(limited.headers["Retry-After"]) >= 1
        assert (await complete(client, owner, "base")).status_code == 200  # the base model is not limited


async def test_an_adapters_new_version_is_canaried_and_rolled_back_as_a_route_version(tmp_path):
    """Route `support` applies adapter support-v1; a canary version applies support-v2 to half the
    requests; a rollback sends them all to v1 again. Usage is counted per adapter version."""
    backend = LoraBackend("one")
    async with running({"base": backend}, tmp_path, route_seed=7, usage_flush_s=0.1) as client:
        for version in ("v1", "v2"):
            await register(client, name=f"support-{version}", path=f"{PATH}-{version}")
        for version, share in (("v1", None), ("v2", 0.5)):
            deployed = await client.post("/admin/routes/support/deploy", headers=AUTH, json={
                "spec": {"targets": [{"backend": "one"}], "adapter": f"support-{version}"}} |
                ({"canary_share": share} if share else {}))
            assert deployed.status_code == 201, deployed.text
        unknown = await client.post("/admin/routes/support/deploy", headers=AUTH, json={
            "spec": {"targets": [{"backend": "one"}], "adapter": "support-v3"}, "canary_share": 0.5})
        assert unknown.status_code == 404 and "support-v3" in unknown.text
        client.gateway.load_routes()
        for _ in range(20):
            assert (await complete(client, AUTH, "support")).status_code == 200
        assert {r.adapter for r in backend.requests} == {"support-v1", "support-v2"}
        assert (await client.post("/admin/routes/support/rollback", headers=AUTH,
                                  json={"reason": "v2 answers worse"})).status_code == 200
        client.gateway.load_routes()
        backend.requests.clear()
        for _ in range(10):
            assert (await complete(client, AUTH, "support")).status_code == 200
        assert {r.adapter for r in backend.requests} == {"support-v1"}
        client.gateway.ledger.flush()
        records = (await client.get("/admin/usage", params={"tenant": "default"}, headers=AUTH)).json()["records"]
        assert {r["adapter"] for r in records} == {"support-v1", "support-v2"}
        assert {r["route"] for r in records} == {"support@1", "support@2"}


async def test_tgi_adapter_id_selects_the_adapter(tmp_path):
    backend = LoraBackend("one")
    async with running({"base": backend}, tmp_path) as client:
        owner = await tenant(client, "acme")
        await register(client, owner="acme")
        body = {"inputs": "hello", "parameters": {"max_new_tokens": 4, "adapter_id": "support"}}
        answered = await client.post("/generate", json=body, headers=owner)
        assert answered.status_code == 200, answered.text
        assert backend.requests[-1].adapter == "support"
        on_model = await client.post("/generate", params={"model": "base"}, json=body, headers=owner)
        assert on_model.status_code == 200 and backend.requests[-1].adapter == "support"
        for missing in ("nonesuch", "base"):  # unknown, and a model rather than an adapter: TGI's 422
            body["parameters"]["adapter_id"] = missing
            refused = await client.post("/generate", json=body, headers=owner)
            assert refused.status_code == 422 and f"`{missing}` does not exist" in refused.json()["error"]
        assert len(backend.requests) == 2


# -- routing --------------------------------------------------------------------------------------
def router_over(*names: str, **spec) -> Router:
    router = Router(Fleet({n: LoraBackend(n) for n in names}), seed=3)
    version = RouteOut(alias="base", version=1, status="active", share=None, spec=RouteSpec(
        targets=[Target(backend=n) for n in names], **spec), created_at="2026-01-01T00:00:00Z")
    router.set_routes({"base": RouteState(alias="base", active=version, canary=None)})
    return router


def test_the_router_prefers_the_replica_with_the_adapter_resident_then_loaded():
    router = router_over("a", "b", "c")
    fleet = router.fleet
    fleet["b"].capabilities = Capabilities(runtime="fake", version="1", model="base", max_context=4096,
                                           prefix_caching=True, adapters=frozenset({"support"}))
    fleet["c"].load = Load(waiting=3, resident_adapters=frozenset({"support"}))
    orders = {tuple(b.name for b in router.resolve("base", ["base"], RequestFacts(adapter="support")).candidates)
              for _ in range(50)}
    assert orders == {("c", "b", "a")}  # resident, loaded, neither: even with a queue on the resident one
    decision = router.resolve("base", ["base"], RequestFacts(adapter="support"))
    assert decision.reason.startswith("adapter resident")
    plain = Counter(router.resolve("base", ["base"]).candidates[0].name for _ in range(300))
    assert set(plain) == {"a", "b", "c"}  # without an adapter the weights alone decide


def test_round_robin_without_adapter_affinity_takes_the_targets_in_turn_whatever_they_hold():
    router = router_over("a", "b", "c", balance="round-robin", adapter_affinity=False)
    router.fleet["c"].load = Load(resident_adapters=frozenset({"support"}))
    firsts = [router.resolve("base", ["base"], RequestFacts(adapter="support")).candidates[0].name for _ in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]


def test_the_prefix_index_keeps_adapters_and_cache_salts_apart():
    spec = PrefixAware(block_chars=16, blocks=4)
    prompt = "You are a helpful assistant. " * 4
    base = PrefixIndex.chain(prompt, spec, cache_salt="salt-a")
    assert base == PrefixIndex.chain(prompt, spec, cache_salt="salt-a")
    assert not set(base) & set(PrefixIndex.chain(prompt, spec, "support", "salt-a"))
    assert not set(base) & set(PrefixIndex.chain(prompt, spec, cache_salt="salt-b"))

    router = router_over("a", "b", prefix_aware=spec)
    facts = RequestFacts(prompt=prompt, adapter="support", cache_salt="salt-a")
    assert router.resolve("base", ["base"], facts).reason.endswith("new prefix; weighted")
    assert router.resolve("base", ["base"], facts).reason.endswith("blocks cached)")
    other = RequestFacts(prompt=prompt, cache_salt="salt-a")  # the same text on the base model
    assert router.resolve("base", ["base"], other).reason.endswith("new prefix; weighted")


# -- TGI deployments and the CLI ------------------------------------------------------------------
def test_tgi_lora_adapters_become_adapter_registrations():
    assert lora_adapters("support, org/legal-v1=/data/legal") == {"support": "support", "org/legal-v1": "/data/legal"}
    with pytest.raises(MigrationError, match="revision"):
        lora_adapters("support@v2")
    with pytest.raises(MigrationError, match="id=path"):
        lora_adapters("a=b=c")
    deployment = TGIDeployment.parse(["--model-id", "meta-llama/Llama-3.1-8B-Instruct",
                                      "LORA_ADAPTERS=support,legal=/data/legal"])
    p = plan(deployment, "llama", "http://tgi:3000", "http://vllm:8001")
    assert p["adapters"] == [{"name": "support", "base": "llama", "path": "support"},
                             {"name": "legal", "base": "llama", "path": "/data/legal"}]
    assert "servegate adapters add legal --base llama --path /data/legal" in [s["command"] for s in p["steps"]]
    assert "--lora-modules support=support legal=/data/legal" in p["commands"]["vllm"]
    assert not [u for u in p["unmapped"] if u["flag"] == "--lora-adapters"]


def test_the_cli_adds_lists_and_removes_adapters(tmp_path, monkeypatch):
    from gateway.cli import app

    gateway_app({}, tmp_path)  # a migrated database
    monkeypatch.setenv("SERVEGATE_DATABASE_URL", f"sqlite:///{tmp_path}/servegate.db")
    runner = CliRunner()
    assert runner.invoke(app, ["tenants", "create", "acme"]).exit_code == 0
    added = runner.invoke(app, ["adapters", "add", "support", "--base", "base", "--path", PATH, "--owner", "acme",
                                "--rpm", "5"])
    assert added.exit_code == 0, added.output
    listed = json.loads(runner.invoke(app, ["adapters", "list", "--json"]).output)
    assert [(a["name"], a["owner"], a["rpm"]) for a in listed] == [("support", "acme", 5)]
    assert runner.invoke(app, ["adapters", "add", "support", "--base", "b", "--path", "p"]).exit_code != 0
    assert runner.invoke(app, ["adapters", "remove", "support"]).exit_code == 0
    assert json.loads(runner.invoke(app, ["adapters", "list", "--json"]).output) == []
