"""`/v1/files` kept a chunk at a time, in the database or in a directory: uploads and downloads
that never hold a file whole, each tenant's storage quota, `expires_after` and the purge of expired
files; and the per-tenant rules of `/v1/batches` (its limit under concurrent creation, its list's
cursor, the cap on a line's body)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import io
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import psutil
import pytest
import sqlalchemy as sa
from sqlalchemy import func, text, update
from sqlmodel import Session, select
from sqlmodel.sql.sqltypes import UTCDateTime

from gateway.api.batch_runner import BatchRunner, purge_expired
from gateway.db import make_engine, upgrade
from gateway.tables import BatchRecord, FileChunk, StoredFile

from .conftest import ADMIN_KEY, AUTH, POSTGRES_URL, _reachable, free_port, gateway_app, serve_app

MiB = 1024 * 1024
QUOTA = 8 * MiB
MAX_BODY = 256 * 1024


@pytest.fixture(scope="module", autouse=True)
def batches_stay_unfinished():
    """No runner takes a batch up here: the batches these tests create stay unfinished."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(BatchRunner, "_claim", lambda self: [])
        yield


@contextlib.contextmanager
def gateway(home: Path, **settings):
    app = gateway_app({}, home, refresh_s=0.3, file_quota_bytes=QUOTA, max_body_bytes=MAX_BODY, **settings)
    with serve_app(app) as url:
        yield SimpleNamespace(url=url, db=app.state.gateway.db, settings=app.state.gateway.settings)


@pytest.fixture(scope="module", params=["database", "directory"])
def gw(request, tmp_path_factory):
    home = tmp_path_factory.mktemp(f"files-{request.param}")
    store = {"file_store_dir": home / "files"} if request.param == "directory" else {}
    with gateway(home, **store) as served:
        yield served


def sdk(url: str, key: str = ADMIN_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def new_tenant(url: str) -> openai.OpenAI:
    """A fresh tenant's client: its quota and its batch limit are its own."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    assert httpx.post(f"{url}/admin/tenants", headers=AUTH, json={"name": name}).status_code == 201
    return sdk(url, httpx.post(f"{url}/admin/keys", headers=AUTH, json={"tenant": name}).json()["key"])


def request_line(i: int, size: int = 200, url: str = "/v1/chat/completions") -> bytes:
    """A valid batch line of about `size` bytes."""
    line = {"custom_id": f"req-{i}", "method": "POST", "url": url,
            "body": {"model": "m", "messages": [{"role": "user", "content": ""}]}}
    line["body"]["messages"][0]["content"] = "x" * max(0, size - len(json.dumps(line)) - 1)
    return json.dumps(line).encode() + b"\n"


def jsonl(count: int, size: int = 200) -> bytes:
    return b"".join(request_line(i, size) for i in range(count))


def upload(url: str, content: bytes, key: str = ADMIN_KEY, **form) -> httpx.Response:
    return httpx.post(f"{url}/v1/files", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      files={"file": ("in.jsonl", content)}, data={"purpose": "batch", **form})


def chunks_of(db, file_id: str) -> int:
    with Session(db) as session:
        return session.exec(select(func.count()).select_from(FileChunk).where(FileChunk.file_id == file_id)).one()


def test_a_file_streams_in_and_out_byte_exact(gw):
    client = new_tenant(gw.url)
    content = jsonl(1500, size=2500)  # 3.6 MiB: four chunks, lines across their edges
    stored = client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
    assert stored.bytes == len(content) and stored.status == "processed"
    assert client.files.content(stored.id).content == content
    with httpx.stream("GET", f"{gw.url}/v1/files/{stored.id}/content", headers={"Authorization":
                                                                                 f"Bearer {client.api_key}"}) as got:
        assert got.headers["content-length"] == str(len(content))
        pieces = list(got.iter_raw())
    assert b"".join(pieces) == content
    on_disk = gw.settings.file_store_dir and gw.settings.file_store_dir.absolute() / stored.id
    if on_disk:  # the directory holds the file under its id, whole, and the database none of it
        assert on_disk.read_bytes() == content and chunks_of(gw.db, stored.id) == 0
        assert not list(on_disk.parent.glob("*.part"))
    else:
        assert chunks_of(gw.db, stored.id) == 4
    assert client.files.delete(stored.id).deleted
    assert chunks_of(gw.db, stored.id) == 0 and not (on_disk and on_disk.exists())
    with pytest.raises(openai.NotFoundError):
        client.files.content(stored.id)


def test_each_tenant_has_a_storage_quota(gw):
    client = new_tenant(gw.url)
    kept = client.files.create(file=("a.jsonl", io.BytesIO(jsonl(2000, size=2600))), purpose="batch")  # ~5 MiB
    refused = upload(gw.url, jsonl(1500, size=2600), client.api_key)  # ~3.7 MiB more: over 8 MiB
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "file_quota_exceeded" and error["type"] == "invalid_request_error"
    assert f"hold {kept.bytes} bytes of the {QUOTA} allowed" in error["message"]
    other = new_tenant(gw.url)  # another tenant's quota is its own
    assert upload(gw.url, jsonl(1500, size=2600), other.api_key).status_code == 200
    client.files.delete(kept.id)
    assert upload(gw.url, jsonl(1500, size=2600), client.api_key).status_code == 200


def test_concurrent_uploads_never_overshoot_the_quota(gw):
    client = new_tenant(gw.url)
    content = jsonl(800, size=2700)  # 2.16 MB: three fit in 8 MiB, not four
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        statuses = sorted(pool.map(lambda _: upload(gw.url, content, client.api_key).status_code, range(8)))
    assert statuses == [200] * 3 + [400] * 5
    assert sum(f.bytes for f in client.files.list().data) == 3 * len(content) <= QUOTA


def test_expires_after_is_honoured_and_its_bounds_enforced(gw):
    client = new_tenant(gw.url)
    hour = client.files.create(file=("a.jsonl", io.BytesIO(jsonl(1))), purpose="batch",
                               expires_after={"anchor": "created_at", "seconds": 3600})
    assert hour.expires_at - hour.created_at == 3600
    default = client.files.create(file=("a.jsonl", io.BytesIO(jsonl(1))), purpose="batch")
    assert default.expires_at - default.created_at == 30 * 86400  # OpenAI's default for batch inputs
    for form, param in (({"expires_after[anchor]": "created_at", "expires_after[seconds]": "3599"},
                         "expires_after[seconds]"),
                        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "2592001"},
                         "expires_after[seconds]"),
                        ({"expires_after[anchor]": "last_active_at", "expires_after[seconds]": "3600"},
                         "expires_after[anchor]"),
                        ({"expires_after[seconds]": "3600"}, "expires_after")):
        refused = upload(gw.url, jsonl(1), client.api_key, **form)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, (form, refused.text)


def expire(db, file_id: str) -> None:
    with Session(db) as session:
        session.exec(update(StoredFile).where(StoredFile.id == file_id)
                     .values(expires_at=datetime.now(UTC) - timedelta(seconds=1)))
        session.commit()


def test_expired_files_are_purged_with_their_bytes_unless_a_batch_reads_them(gw):
    client = new_tenant(gw.url)
    lone, read = (client.files.create(file=("a.jsonl", io.BytesIO(jsonl(3000, size=400))), purpose="batch")
                  for _ in range(2))
    batch = client.batches.create(input_file_id=read.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert client.files.retrieve(read.id).expires_at >= batch.expires_at  # kept while the batch may run
    for file in (lone, read):
        expire(gw.db, file.id)
        with pytest.raises(openai.NotFoundError):  # gone for its tenant at once
            client.files.retrieve(file.id)
    purge_expired(gw.db)
    with Session(gw.db) as session:
        assert session.get(StoredFile, lone.id) is None and session.get(StoredFile, read.id) is not None
    assert chunks_of(gw.db, lone.id) == 0
    if gw.settings.file_store_dir:
        assert not (gw.settings.file_store_dir / lone.id).exists() and (gw.settings.file_store_dir / read.id).exists()
    with Session(gw.db) as session:  # the batch ends: its input goes at the next purge
        session.exec(update(BatchRecord).where(BatchRecord.id == batch.id).values(status="completed"))
        session.commit()
    purge_expired(gw.db)
    with Session(gw.db) as session:
        assert session.get(StoredFile, read.id) is None
    assert chunks_of(gw.db, read.id) == 0


def test_a_batchs_end_reads_its_input_and_writes_its_files_through_the_store(gw):
    client = new_tenant(gw.url)
    source = client.files.create(file=("a.jsonl", io.BytesIO(jsonl(8000, size=150))), purpose="batch")
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
    BatchRunner(SimpleNamespace(db=gw.db, settings=gw.settings))._finish(batch.id, "cancelled")  # before any line ran
    done = client.batches.retrieve(batch.id)
    assert done.status == "cancelled" and done.output_file_id is None and done.request_counts.failed == 8000
    errors = client.files.retrieve(done.error_file_id)
    assert errors.bytes > MiB  # two chunks
    lines = [json.loads(line) for line in client.files.content(errors.id).content.splitlines()]
    assert [line["custom_id"] for line in lines] == [f"req-{i}" for i in range(8000)]
    assert {line["error"]["code"] for line in lines} == {"batch_cancelled"}


def test_a_tenant_never_reaches_another_tenants_files(gw):
    owner, other = new_tenant(gw.url), new_tenant(gw.url)
    stored = owner.files.create(file=("a.jsonl", io.BytesIO(jsonl(2))), purpose="batch")
    for attempt in (lambda: other.files.retrieve(stored.id), lambda: other.files.content(stored.id),
                    lambda: other.files.delete(stored.id)):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert other.files.list().data == [] and [f.id for f in owner.files.list().data] == [stored.id]
    assert owner.files.content(stored.id).content == jsonl(2)


def test_another_tenants_batch_is_no_cursor(gw):
    mine, theirs = new_tenant(gw.url), new_tenant(gw.url)

    def create(client: openai.OpenAI) -> str:
        source = client.files.create(file=("a.jsonl", io.BytesIO(jsonl(1))), purpose="batch")
        return client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                     completion_window="24h").id

    older = create(mine)
    time.sleep(0.01)
    probe = create(theirs)  # between my two batches: as a cursor it would hide my newer one
    time.sleep(0.01)
    newer = create(mine)
    unknown = [b.id for b in mine.batches.list(after="batch_nonesuch").data]
    assert unknown == [newer, older] == [b.id for b in mine.batches.list().data]
    assert [b.id for b in mine.batches.list(after=probe).data] == unknown
    assert [b.id for b in mine.batches.list(after=newer).data] == [older]  # my own batch is a cursor


@pytest.mark.parametrize("database", ["sqlite", pytest.param("postgresql", marks=pytest.mark.skipif(
    not _reachable(POSTGRES_URL), reason=f"no PostgreSQL at {POSTGRES_URL}"))])
def test_concurrent_batch_creation_never_exceeds_the_limit(database, tmp_path):
    with contextlib.ExitStack() as stack:
        db_url = stack.enter_context(postgres_schema()) if database == "postgresql" else None
        served = stack.enter_context(gateway(tmp_path, db_url=db_url, batch_active_per_tenant=3))
        client = new_tenant(served.url)
        source = client.files.create(file=("a.jsonl", io.BytesIO(jsonl(1))), purpose="batch")

        def create(_) -> int:
            return httpx.post(f"{served.url}/v1/batches", headers={"Authorization": f"Bearer {client.api_key}"},
                              json={"input_file_id": source.id, "endpoint": "/v1/chat/completions",
                                    "completion_window": "24h"}, timeout=60).status_code

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            statuses = sorted(pool.map(create, range(12)))
        assert statuses == [200] * 3 + [429] * 9
        assert len(client.batches.list().data) == 3


@contextlib.contextmanager
def postgres_schema():
    """A fresh schema of the test database, dropped afterwards."""
    schema = f"sg_{uuid.uuid4().hex[:12]}"
    admin = make_engine(POSTGRES_URL)
    with admin.begin() as connection:
        connection.execute(text(f"CREATE SCHEMA {schema}"))
    try:
        yield f"{POSTGRES_URL}?options=-csearch_path%3D{schema}"
    finally:
        with admin.begin() as connection:
            connection.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()


def test_a_line_whose_body_is_over_the_cap_is_refused_by_number(gw):
    client = new_tenant(gw.url)
    fits = request_line(1, MAX_BODY - 200)
    over = request_line(2, MAX_BODY + 2000)  # its body a little over the cap, the line within its envelope
    far_over = request_line(3, 3 * MAX_BODY)  # never read whole
    refused = upload(gw.url, fits + over + far_over + request_line(4), client.api_key)
    assert refused.status_code == 400
    message = refused.json()["error"]["message"]
    assert f"line 2: its body is larger than the {MAX_BODY} bytes a request body may hold" in message
    assert "line 3: the line is longer than" in message and "line 1:" not in message and "line 4:" not in message
    assert upload(gw.url, fits, client.api_key).status_code == 200


def test_files_kept_whole_by_an_earlier_version_are_moved_into_chunks(tmp_path):
    content = jsonl(1200, size=2000)  # 2.3 MiB: three chunks
    db = make_engine(f"sqlite:///{tmp_path}/servegate.db")
    upgrade(db, "0006")
    old_file = sa.table("file", *(sa.column(name) for name in ("id", "tenant", "purpose", "filename", "size", "lines",
                                                               "content")), sa.column("created_at", UTCDateTime()))
    with db.begin() as connection:
        connection.execute(old_file.insert().values(id="file-old", tenant="default", purpose="batch", size=len(content),
                                                    filename="old.jsonl", lines=1200, content=content,
                                                    created_at=datetime.now(UTC)))
    with gateway(tmp_path) as served:  # migrated to the head as it starts
        assert chunks_of(served.db, "file-old") == 3
        assert sdk(served.url).files.content("file-old").content == content


# -- memory under load -------------------------------------------------------------------------
LINES = 50_000  # a batch's most
LINE_BYTES = 4000  # 50,000 of them: 200 MB


class GeneratedFile(io.RawIOBase):
    """A 200 MB batch input made as it is read, never held whole."""

    def __init__(self, seed: int) -> None:
        self.seed, self.next_line, self.block, self.offset = seed, 0, b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self.offset == len(self.block):  # the next 64 lines
            stop = min(self.next_line + 64, LINES)
            self.block = b"".join(request_line(self.seed * LINES + i, LINE_BYTES) for i in range(self.next_line, stop))
            self.next_line, self.offset = stop, 0
        size = min(len(buffer), len(self.block) - self.offset)
        buffer[:size] = self.block[self.offset:self.offset + size]
        self.offset += size
        return size


def digest(stream) -> str:
    hashed = hashlib.sha256()
    for piece in stream:
        hashed.update(piece)
    return hashed.hexdigest()


@pytest.mark.slow
def test_the_gateways_memory_stays_bounded_under_concurrent_uploads_and_downloads(tmp_path):
    """Four 200 MB uploads and four downloads of a 200 MB file at once: the gateway's resident
    memory stays under 400 MiB and `/health` answers within 100 ms (p99) all along."""
    (tmp_path / "servegate.yaml").write_text("backends: []\n")
    port = free_port()
    env = {**os.environ, "SERVEGATE_DATABASE_URL": f"sqlite:///{tmp_path}/servegate.db",
           "SERVEGATE_ADMIN_KEY": ADMIN_KEY, "SERVEGATE_SPOOL_DIR": str(tmp_path / "spool"), "TMPDIR": str(tmp_path)}
    server = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(tmp_path / "servegate.yaml"),
                               "--port", str(port), "--log-level", "warning"], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            assert server.poll() is None and time.monotonic() < deadline, "the gateway did not start"
            time.sleep(0.1)
        client = httpx.Client(base_url=url, headers=AUTH, timeout=600)
        process = psutil.Process(server.pid)
        baseline, started = process.memory_info().rss, time.monotonic()

        def send(seed: int) -> str:
            response = client.post("/v1/files", files={"file": ("big.jsonl", GeneratedFile(seed))},
                                   data={"purpose": "batch"})
            assert response.status_code == 200, response.text
            assert response.json()["bytes"] == LINES * LINE_BYTES
            return response.json()["id"]

        first = send(0)
        setup_s = time.monotonic() - started
        reader = GeneratedFile(0)
        expected = digest(iter(lambda: reader.read(MiB), b""))

        def fetch(_) -> str:
            with client.stream("GET", f"/v1/files/{first}/content") as response:
                return digest(response.iter_raw())

        rss, health, done = [], [], threading.Event()

        def watch() -> None:
            probe = httpx.Client(base_url=url, timeout=10)  # one connection: the gateway's time, not a client's set-up
            while not done.is_set():
                rss.append(process.memory_info().rss)
                began = time.monotonic()
                healthy = probe.get("/health").status_code == 200
                health.append(time.monotonic() - began if healthy else float("inf"))
                time.sleep(0.05)

        watcher = threading.Thread(target=watch)
        watcher.start()
        began = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            uploads = [pool.submit(send, seed) for seed in (1, 2, 3, 4)]
            downloads = [pool.submit(fetch, n) for n in range(4)]
            uploaded = [u.result() for u in uploads]
            fetched = [d.result() for d in downloads]
        done.set()
        watcher.join()
        load_s = time.monotonic() - began
        assert len(set(uploaded)) == 4 and fetched == [expected] * 4
        health.sort()
        p99 = health[int(len(health) * 0.99)]
        print(f"\nfirst upload {setup_s:.1f} s; 4 uploads + 4 downloads {load_s:.1f} s; gateway RSS max "
              f"{max(rss) / MiB:.0f} MiB (at rest {baseline / MiB:.0f}); /health p99 {p99 * 1000:.0f} ms, "
              f"max {health[-1] * 1000:.0f} ms over {len(health)} probes")
        assert max(rss) < 400 * MiB
        assert p99 < 0.1
    finally:
        server.terminate()
        server.wait(timeout=30)
