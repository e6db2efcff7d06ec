"""The gateway on PostgreSQL, as several replicas run it: migrations, auth, usage, admin."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import httpx
import pytest
from sqlalchemy import text
from sqlmodel import Session, select

from backends.builtin import BuiltinBackend, EngineConfig
from gateway.db import check_migrated, make_engine
from gateway.tables import UsageRecord

from .conftest import AUTH, POSTGRES_URL, gateway_app, needs_postgres, serve_app, wait_ready

pytestmark = [needs_postgres, pytest.mark.slow]


@pytest.fixture
def postgres_url():
    """A fresh schema of the test database, dropped afterwards."""
    schema = f"sg_{uuid.uuid4().hex[:12]}"
    admin = make_engine(POSTGRES_URL)
    with admin.begin() as connection:
        connection.execute(text(f"CREATE SCHEMA {schema}"))
    yield f"{POSTGRES_URL}?options=-csearch_path%3D{schema}"
    with admin.begin() as connection:
        connection.execute(text(f"DROP SCHEMA {schema} CASCADE"))
    admin.dispose()


def test_gateway_on_postgresql(postgres_url, tiny_model_dir, tmp_path):
    backend = BuiltinBackend(EngineConfig(model=str(tiny_model_dir), dtype="float64", served_name="tiny",
                                          kv_cache_tokens=2048))
    app = gateway_app({"tiny": backend}, tmp_path, db_url=postgres_url, usage_flush_s=0.2)
    db = app.state.gateway.db
    check_migrated(db)
    with serve_app(app) as url:
        wait_ready(url)
        assert httpx.post(f"{url}/admin/tenants", headers=AUTH, json={"name": "pg", "rpm": 3}).status_code == 201
        key = httpx.post(f"{url}/admin/keys", headers=AUTH, json={"tenant": "pg"}).json()["key"]
        headers = {"Authorization": f"Bearer {key}"}
        if time.time() % 60 > 50:  # rpm counts the UTC minute: keep the four requests inside one
            time.sleep(60.5 - time.time() % 60)
        statuses = [httpx.post(f"{url}/v1/completions", headers=headers,
                               json={"model": "tiny", "prompt": "hi", "max_tokens": 2}).status_code for _ in range(4)]
        assert statuses == [200, 200, 200, 429]
        deadline = time.monotonic() + 10
        while True:
            with Session(db) as session:
                rows = session.exec(select(UsageRecord).where(UsageRecord.tenant == "pg")).all()
            if len(rows) == 3:
                break
            assert time.monotonic() < deadline, "usage did not reach PostgreSQL"
            time.sleep(0.1)
        assert all(r.completion_tokens == 2 and r.status == "ok" for r in rows)
        report = httpx.get(f"{url}/admin/usage", headers=AUTH, params={"tenant": "pg"}).json()
        assert report["totals"]["requests"] == 3 and report["totals"]["completion_tokens"] == 6


def test_replicas_that_start_together_migrate_one_at_a_time(postgres_url):
    """Each gateway pod runs `servegate db upgrade` as it starts (deploy/kubernetes): four at once
    all succeed, and the schema is created once, at its head."""
    env = {**os.environ, "SERVEGATE_DATABASE_URL": postgres_url}
    upgrades = [subprocess.Popen([sys.executable, "-m", "gateway", "db", "upgrade"], env=env, stderr=subprocess.PIPE,
                                 text=True) for _ in range(4)]
    for process in upgrades:
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == 0, stderr
    engine = make_engine(postgres_url)
    check_migrated(engine)
    with engine.connect() as connection:
        assert connection.execute(text("SELECT count(*) FROM alembic_version")).scalar() == 1
    engine.dispose()
