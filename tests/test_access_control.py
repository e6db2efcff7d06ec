"""Who reaches what through a live gateway, as an operator would try it: a tenant administrator
reaches only its own tenant, a key made with the CLI works at its first request (garbage keys cost
one lookup per refresh interval), and metrics are open to loopback only unless a scrape token is set."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from typer.testing import CliRunner

from gateway.tenancy import auth

from .conftest import bearer, gateway_app, openai_upstream, serve_app
from .upstreams import admin, answer, gateway_over, tenant_with_key


@pytest.mark.slow
def test_a_tenant_administrator_reaches_only_its_own_tenant(tmp_path):
    with gateway_over({"remote": openai_upstream(lambda path: answer(count=2))}, tmp_path) as gw:
        mine, own_admin = tenant_with_key(gw, scopes=("admin",), tpm=1000)
        other, other_key = tenant_with_key(gw)
        other_prefix = other_key.split("_")[1]

        def as_tenant_admin(method: str, path: str, **kwargs) -> httpx.Response:
            return admin(gw, method, path, key=own_admin, **kwargs)

        refused = {
            "rotate another tenant's key": as_tenant_admin("POST", f"/admin/keys/{other_prefix}/rotate"),
            "revoke another tenant's key": as_tenant_admin("POST", f"/admin/keys/{other_prefix}/revoke"),
            "mint a key for another tenant": as_tenant_admin("POST", "/admin/keys", json={"tenant": other}),
            "list another tenant's keys": as_tenant_admin("GET", "/admin/keys", params={"tenant": other}),
            "read another tenant's usage": as_tenant_admin("GET", "/admin/usage", params={"tenant": other}),
            "read another tenant": as_tenant_admin("GET", f"/admin/tenants/{other}"),
        }
        assert {why: r.status_code for why, r in refused.items()} == {why: 404 for why in refused}
        forbidden = {
            "mint an operator key": as_tenant_admin("POST", "/admin/keys",
                                                    json={"tenant": mine, "scopes": ["operator"]}),
            "raise its own limits": as_tenant_admin("PATCH", f"/admin/tenants/{mine}", json={"tpm": 10**6}),
            "create a tenant": as_tenant_admin("POST", "/admin/tenants", json={"name": "x" + mine}),
            "read the audit log": as_tenant_admin("GET", "/admin/audit"),
            "deploy a route": as_tenant_admin("POST", "/admin/routes/x/deploy",
                                              json={"spec": {"targets": [{"backend": "remote"}]}}),
        }
        assert {why: r.status_code for why, r in forbidden.items()} == {why: 403 for why in forbidden}
        over_cap = as_tenant_admin("POST", "/admin/keys", json={"tenant": mine, "tpm": 5000})
        assert over_cap.status_code == 400 and over_cap.json()["error"]["param"] == "tpm"

        # Its own tenant: keys, usage.
        assert [t["name"] for t in as_tenant_admin("GET", "/admin/tenants").json()] == [mine]
        made = as_tenant_admin("POST", "/admin/keys", json={"tenant": mine, "tpm": 500})
        assert made.status_code == 201
        assert {k["tenant"] for k in as_tenant_admin("GET", "/admin/keys").json()} == {mine}
        assert as_tenant_admin("POST", f"/admin/keys/{made.json()['prefix']}/rotate").status_code == 200
        assert as_tenant_admin("GET", "/admin/usage").status_code == 200
        # Untouched: the other tenant's key still works.
        assert httpx.get(gw.url + "/v1/models", headers=bearer(other_key)).status_code == 200


@pytest.mark.slow
def test_a_key_made_with_the_cli_works_at_its_first_request(tmp_path, monkeypatch):
    from gateway.cli import app

    with gateway_over({"remote": openai_upstream(lambda path: answer(count=2))}, tmp_path, refresh_s=3600) as gw:
        monkeypatch.setenv("SERVEGATE_DATABASE_URL", str(gw.gateway.db.url))
        made = CliRunner().invoke(app, ["tenants", "create", "cli-made"])
        assert made.exit_code == 0, made.output
        created = CliRunner().invoke(app, ["keys", "create", "--tenant", "cli-made", "--json"])
        assert created.exit_code == 0, created.output
        key = json.loads(created.output)["key"]
        first = httpx.post(gw.url + "/v1/completions", headers=bearer(key),
                           json={"model": "remote", "prompt": "hi", "max_tokens": 5})
        assert first.status_code == 200, first.text

        # Garbage keys cost the database one lookup per refresh interval, not one per request.
        lookups = []
        read = auth._read_key
        monkeypatch.setattr(auth, "_read_key", lambda engine, prefix: lookups.append(prefix) or read(engine, prefix))
        garbage = key[:-4] + "xxxx"
        fake = "sg_0badf00d_" + "x" * 43
        answers = [httpx.get(gw.url + "/v1/models", headers=bearer(k)).status_code for k in [garbage, fake] * 5]
        assert answers == [401] * 10 and lookups == ["0badf00d"]


@pytest.mark.slow
def test_metrics_are_open_to_loopback_only_unless_a_scrape_token_is_set(tmp_path):
    with gateway_over({"remote": openai_upstream(lambda path: answer(count=2))}, tmp_path) as gw:
        assert httpx.get(gw.url + "/metrics").status_code == 200

        async def from_afar(app) -> int:
            transport = httpx.ASGITransport(app, client=("203.0.113.7", 40000))
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as far:
                return (await far.get("/metrics")).status_code

    app = gateway_app({}, tmp_path / "far")
    assert asyncio.run(from_afar(app)) == 401
    tokened = gateway_app({}, tmp_path / "tokened", metrics_token="scrape-me")
    with serve_app(tokened) as url:
        assert httpx.get(url + "/metrics").status_code == 401  # a token, once set, is asked of everyone
        assert httpx.get(url + "/metrics", headers=bearer("scrape-me")).status_code == 200
        assert httpx.get(url + "/metrics", headers=bearer("scrape-me-not")).status_code == 401
