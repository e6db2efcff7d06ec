"""The operator's CLI, straight against the database: db, tenants, keys, usage."""

from __future__ import annotations

import json

from sqlmodel import Session, select
from typer.testing import CliRunner

from gateway.cli import app
from gateway.db import make_engine
from gateway.tables import ApiKey, AuditLog
from gateway.tenancy.keys import hash_key


def test_cli_contract(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path}/servegate.db"
    monkeypatch.setenv("SERVEGATE_DATABASE_URL", url)
    run = CliRunner().invoke

    unmigrated = run(app, ["tenants", "list"])
    assert unmigrated.exit_code == 2 and "servegate db upgrade" in unmigrated.output
    refused = run(app, ["serve"])  # an existing database without the schema: serve refuses, loads nothing
    assert refused.exit_code == 2 and "has no servegate schema" in refused.output

    assert "database at revision 0008" in run(app, ["db", "upgrade"]).output
    created = run(app, ["tenants", "create", "acme", "--rpm", "5", "--tpm", "1000", "--tokens-per-day", "9000",
                        "--max-concurrency", "2", "--models", "a,b"])
    assert created.exit_code == 0, created.output
    assert run(app, ["tenants", "create", "acme"]).exit_code == 2  # exists
    (acme,) = json.loads(run(app, ["tenants", "list", "--json"]).output)
    assert (acme["rpm"], acme["tpm"], acme["tokens_per_day"], acme["max_concurrency"], acme["models"]) == \
        (5, 1000, 9000, 2, ["a", "b"])

    made = run(app, ["keys", "create", "--tenant", "acme"])
    key = made.output.strip().splitlines()[-1]  # the key alone on the last line
    assert made.exit_code == 0 and key.startswith("sg_")
    as_json = json.loads(run(app, ["keys", "create", "--tenant", "acme", "--scope", "admin", "--scope", "inference",
                                   "--json"]).output)
    assert as_json["scopes"] == ["admin", "inference"] and as_json["key"].startswith(f"sg_{as_json['prefix']}_")
    assert run(app, ["keys", "create", "--tenant", "nobody"]).exit_code == 2
    assert run(app, ["keys", "create", "--tenant", "acme", "--scope", "root"]).exit_code == 2

    prefix = key.split("_")[1]
    listed = json.loads(run(app, ["keys", "list", "--tenant", "acme", "--json"]).output)
    assert len(listed) == 2 and all("key" not in k for k in listed)
    assert run(app, ["keys", "revoke", prefix]).exit_code == 0
    again = run(app, ["keys", "revoke", prefix])
    assert again.exit_code == 2 and "already revoked" in again.output
    rotated = run(app, ["keys", "rotate", as_json["prefix"]]).output.strip().splitlines()[-1]
    assert rotated.startswith("sg_") and rotated != as_json["key"]

    assert run(app, ["tenants", "update", "acme", "--rpm", "0", "--disable"]).exit_code == 0
    (acme,) = json.loads(run(app, ["tenants", "list", "--json"]).output)
    assert acme["rpm"] is None and acme["disabled"] and acme["tpm"] == 1000
    assert "0 requests" in run(app, ["usage", "--tenant", "acme"]).output

    with Session(make_engine(url)) as session:
        stored = session.exec(select(ApiKey)).all()
        actions = [a.action for a in session.exec(select(AuditLog).order_by(AuditLog.id))]
        actors = {a.actor for a in session.exec(select(AuditLog))}
    assert {k.key_hash for k in stored} >= {hash_key(key), hash_key(rotated)}
    assert actions == ["tenant.create", "key.create", "key.create", "key.revoke", "key.rotate", "tenant.update"]
    assert all(actor.startswith("cli:") for actor in actors)


def test_serve_refuses_a_bad_engine_option_before_loading_anything(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVEGATE_DATABASE_URL", f"sqlite:///{tmp_path}/never.db")
    runner = CliRunner()
    for args, says in [(["--block-size", "0"], "block_size must be a positive integer"),
                       (["--device", "gpu"], "device 'gpu' is not auto, cpu, cuda or cuda:N"),
                       (["--dtype", "fp99"], "'fp99' is not one of")]:
        result = runner.invoke(app, ["serve", *args])
        assert result.exit_code != 0 and says in " ".join(result.output.split()), result.output
    assert not (tmp_path / "never.db").exists()  # it stopped before touching the database


def test_engine_config_is_checked_when_made():
    import pytest

    from backends.builtin.config import EngineConfig

    for bad in ({"weight_quant": "int4"}, {"kv_cache_dtype": "fp8"}, {"attention": "flash"},
                {"max_model_len": -1}, {"kv_cache_tokens": 1.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineConfig(**bad)
    assert EngineConfig(device="cuda:1", max_model_len=512).blocks() == 1024


def test_the_operator_migration_keeps_only_the_default_tenants_admins_global(tmp_path):
    from sqlalchemy import text

    from gateway.db import upgrade

    engine = make_engine(f"sqlite:///{tmp_path}/old.db")
    upgrade(engine, "0002")  # before the operator scope: `admin` administered everything
    with engine.begin() as connection:  # rows as that schema held them (the models have moved on)
        for tenant_id, name in [(1, "default"), (2, "acme")]:
            connection.execute(text("INSERT INTO tenant (id, name, tier, models, disabled, created_at) "
                                    "VALUES (:id, :name, 'standard', '[]', 0, '2026-01-01')"),
                               {"id": tenant_id, "name": name})
        for prefix, tenant_id, scopes in [("aaaaaaaa", 1, "admin,inference"), ("bbbbbbbb", 2, "admin"),
                                          ("cccccccc", 2, "inference")]:
            connection.execute(text("INSERT INTO api_key (prefix, key_hash, tenant_id, name, scopes, created_at) "
                                    "VALUES (:prefix, :hash, :tenant, '', :scopes, '2026-01-01')"),
                               {"prefix": prefix, "hash": hash_key(prefix), "tenant": tenant_id, "scopes": scopes})
    upgrade(engine)
    with Session(engine) as session:
        scopes = {k.prefix: k.scopes for k in session.exec(select(ApiKey))}
    assert scopes == {"aaaaaaaa": "inference,operator", "bbbbbbbb": "admin", "cccccccc": "inference"}
