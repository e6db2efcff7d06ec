"""Shared fixtures: the default model loaded once, engines on it, a block-leak check, and
gateway apps on a fresh database."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from backends.builtin.config import EngineConfig
from backends.builtin.core.engine import LLMEngine
from backends.builtin.worker.loader import default_model_path, gguf_to_hf_dir, load_model
from backends.launch import free_port  # noqa: F401  (the tests import it from here)

_engines: list[LLMEngine] = []


@pytest.fixture(scope="module", autouse=True)
def _memory_returned_after_each_module():
    """Each module's engines and gateways, once torn down, are collected and their heap handed back
    to the system: one process runs the whole suite beside vLLM's servers on a 24 GiB machine."""
    yield
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@pytest.fixture(scope="session")
def default_model():
    return load_model()


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default GGUF converted to a Hugging Face directory (the engine's own cache)."""
    return gguf_to_hf_dir(default_model_path())


def provisioned_or_skip(provisioned) -> Path:
    """A peer runtime's path (`provisioned()`, from backends.peers); skips, saying why, where it
    is not provisioned."""
    from backends.peers import PeerMissing

    try:
        return provisioned()
    except PeerMissing as missing:
        pytest.skip(str(missing))


@pytest.fixture(scope="session")
def vllm_url(default_model_dir):
    """vLLM's CPU build serving the default model as `smollm2`, in float32, started once for the
    run (its start takes minutes): the conformance target and the greedy-parity reference. Skips,
    saying why, where its environment is not provisioned (`python -m backends.peers vllm`)."""
    from backends import peers
    from backends.launch import supervised

    provisioned_or_skip(peers.vllm_python)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = peers.vllm_command(default_model_dir, port, "smollm2", max_model_len=2048, dtype="float32")
    with supervised(command, url, "/health", peers.vllm_env(), 900):
        yield url


@pytest.fixture(scope="session")
def vllm_embed_url(default_model_dir):
    """vLLM's CPU build serving the default model as an embedding model, `smollm2-embed`, in float32
    (`--runner pooling --convert embed`: its default pooling for a decoder, the last token's final
    hidden state, normalized), started once for the run. Skips, saying why, as `vllm_url` does."""
    from backends import peers
    from backends.launch import supervised

    provisioned_or_skip(peers.vllm_python)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = peers.vllm_command(default_model_dir, port, "smollm2-embed", max_model_len=2048, dtype="float32",
                                 extra=["--runner", "pooling", "--convert", "embed"])
    with supervised(command, url, "/health", peers.vllm_env(), 900):
        yield url


@pytest.fixture
def make_engine(default_model):
    """Engines on the default model (weights shared); every test's engines must end leak-free."""

    def make(loaded=None, **overrides) -> LLMEngine:
        overrides.setdefault("dtype", "float32")  # exact against the fp32 references, on every CPU
        engine = LLMEngine(EngineConfig(**overrides), loaded or default_model)
        _engines.append(engine)
        return engine

    yield make
    while _engines:
        assert_no_leaks(_engines.pop())


def assert_no_leaks(engine: LLMEngine) -> None:
    kv = engine.kv
    assert not engine.has_work, "requests left in the engine"
    assert kv.num_free == kv.num_blocks, f"{kv.num_used} KV blocks leaked"
    assert all(b.ref_count == 0 for b in kv.blocks)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir):
    """A 2-layer random Llama in float64 with the default model's tokenizer: fast, and with
    float64 numerics equal runs give equal tokens, which property tests rely on."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        rope_theta=10000.0, tie_word_embeddings=True, initializer_range=0.5, eos_token_id=2,
    )
    model = LlamaForCausalLM(config).to(torch.float64)
    directory = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(default_model_dir).save_pretrained(directory)
    assert json.loads((directory / "config.json").read_text())["model_type"] == "llama"
    return directory


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    return load_model(tiny_model_dir)


@pytest.fixture(scope="session")
def hf_model():
    """The correctness baseline: transformers on the same GGUF file, fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


REDIS_URL = os.environ.get("SERVEGATE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
POSTGRES_URL = os.environ.get("SERVEGATE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def _reachable(url: str) -> bool:
    """Whether a TCP server answers at the URL's host and port."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    try:
        socket.create_connection((parsed.host, parsed.port), timeout=1).close()
        return True
    except OSError:
        return False


needs_redis = pytest.mark.skipif(not _reachable(REDIS_URL), reason=f"no Redis server at {REDIS_URL} (CI starts one)")
needs_postgres = pytest.mark.skipif(not _reachable(POSTGRES_URL),
                                    reason=f"no PostgreSQL server at {POSTGRES_URL} (CI starts one)")

ADMIN_KEY = "sg-test-admin-key"  # the bootstrap operator key of every test gateway
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def usage_records(url: str, tenant: str, count: int = 1, timeout: float = 10) -> list[dict]:
    """The tenant's usage records, newest first, once the ledger writer has moved `count` of them in."""
    deadline = time.monotonic() + timeout
    while True:
        records = httpx.get(f"{url}/admin/usage", params={"tenant": tenant}, headers=AUTH, timeout=30).json()
        if len(records["records"]) >= count:
            return records["records"]
        assert time.monotonic() < deadline, f"only {len(records['records'])} of {count} usage records arrived"
        time.sleep(0.05)


def gateway_app(backends: dict, home: Path, db_url: str | None = None, tracer_provider=None, **settings):
    """A gateway app on a migrated database (SQLite under `home` unless `db_url`), whose
    `default` tenant holds the admin key ADMIN_KEY; traced into `tracer_provider` if given."""
    from sqlmodel import Session

    from gateway.app import create_app
    from gateway.db import make_engine, upgrade
    from gateway.settings import Settings
    from gateway.tenancy.tenants import bootstrap

    config = Settings(database_url=db_url or f"sqlite:///{home}/servegate.db", spool_dir=home / "spool",
                      **{"adapter_store_dir": home / "adapter-store"} | settings)
    db = make_engine(config.database_url)
    upgrade(db)
    with Session(db) as session:
        bootstrap(session, ADMIN_KEY)
    return create_app(backends, config, db, tracer_provider)


async def generated(backend, **fields):
    """One request through a backend, greedy unless told: (choice 0's text, the Finish event)."""
    from backends.base import Delta, GenerateRequest

    fields.setdefault("temperature", 0.0)
    request = GenerateRequest(request_id=f"t-{time.monotonic_ns()}", model="m", **fields)
    texts, finish = [], None
    async for event in backend.generate(request):
        if isinstance(event, Delta):
            texts.append(event.text)
        else:
            finish = event
    return "".join(texts), finish


@contextlib.contextmanager
def serve_app(app):
    """Run an ASGI app with uvicorn on a real loopback socket, in a background thread."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def away_from_minute_edge(margin: float = 10) -> None:
    """Quotas count in fixed one-minute windows: a burst that should meet one limit starts at
    least `margin` seconds before the next window does."""
    if time.time() % 60 > 60 - margin:
        time.sleep(61 - time.time() % 60)


def wait_ready(base_url: str, timeout: float = 120, path: str = "/ready", process=None) -> None:
    """Until `base_url + path` answers 200 (a server still starting may refuse connections);
    fails if it takes longer than `timeout` or if `process` (a Popen) exits meanwhile. The
    timeout starts once the native kernels are built: a server starting on a checkout without
    them builds them first (minutes on 2 cores), and this build waits on that one's lock."""
    from backends.builtin.worker import kernels

    kernels.load()
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{base_url}{path}").status_code == 200:
                return
        assert process is None or process.poll() is None, f"the server exited with code {process.returncode}"
        assert time.monotonic() < deadline, f"{base_url}{path} never answered 200"
        time.sleep(0.1)


def openai_upstream(pieces_for, status: int = 200):
    """An OpenAI-compatible upstream answering GETs as the bench stub does, and each POST with
    `status` (an error body unless 200) and the SSE pieces `pieces_for(path)` gives, a list or an
    async iterator."""
    from advisor.measure import stub

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["method"] == "GET":  # the stub reads the (empty) body itself
            await stub.app(scope, receive, send)
            return
        await stub.read_body(receive)
        if status != 200:
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": b'{"error": {"message": "engine down"}}'})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        pieces = pieces_for(scope["path"])
        if not hasattr(pieces, "__aiter__"):
            pieces = _aiter(pieces)
        async for piece in pieces:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    return app


async def _aiter(items):
    for item in items:
        yield item


# -- the conformance report: each target's results, at the end of the run (CI's output) -------
CONFORMANCE: dict[str, dict[str, int]] = {}


def pytest_runtest_logreport(report):
    if "test_conformance.py::" not in report.nodeid or "[" not in report.nodeid:
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        target = report.nodeid.rsplit("[", 1)[1].rstrip("]")
        counts = CONFORMANCE.setdefault(target, {"passed": 0, "failed": 0, "skipped": 0})
        counts[report.outcome] += 1


REPORTS: dict[str, list[str]] = {}  # a test's findings worth reading in CI's output, by title


def pytest_terminal_summary(terminalreporter):
    for title, lines in REPORTS.items():
        terminalreporter.section(title)
        for line in lines:
            terminalreporter.write_line(line)
    if CONFORMANCE:
        terminalreporter.section("conformance: results per target")
        for target, counts in CONFORMANCE.items():
            terminalreporter.write_line(f"{target:18} {counts['passed']} passed, {counts['failed']} failed, "
                                        f"{counts['skipped']} skipped")


@contextlib.asynccontextmanager
async def running(backends: dict, tmp_path, **settings):
    """A gateway over `backends`, started, and a client of it."""
    app = gateway_app(backends, tmp_path, **settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=30) as client:
            client.gateway = app.state.gateway
            yield client


async def tenant(client: httpx.AsyncClient, name: str, scopes: tuple[str, ...] = ("inference",)) -> dict[str, str]:
    """A new tenant's key, as request headers."""
    assert (await client.post("/admin/tenants", json={"name": name}, headers=AUTH)).status_code == 201
    made = await client.post("/admin/keys", json={"tenant": name, "scopes": list(scopes)}, headers=AUTH)
    assert made.status_code == 201, made.text
    return bearer(made.json()["key"])
