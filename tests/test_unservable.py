"""A model the engine cannot serve ends `servegate serve` in one line, and a backend that fails to
start among others is named in /ready's body."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from backends.base import Backend, Capabilities, Health, Load

from .conftest import gateway_app, serve_app


def serve(model, tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "SERVEGATE_DATABASE_URL": f"sqlite:///{tmp_path}/db.sqlite",
           "SERVEGATE_SPOOL_DIR": str(tmp_path / "spool"), "SERVEGATE_ADMIN_KEY": "sg-test-unservable"}
    return subprocess.run([sys.executable, "-m", "gateway", "serve", "--model", str(model), "--port", "0"],
                          env=env, capture_output=True, text=True, timeout=300)


def test_an_architecture_the_engine_lacks_ends_the_start_in_one_line(tmp_path):
    from gguf import GGUFWriter

    directory = tmp_path / "mamba"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "mamba", "architectures": ["MambaForCausalLM"]}))
    gguf = tmp_path / "rwkv6.gguf"
    writer = GGUFWriter(gguf, "rwkv6")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    for model, architecture, served in ((directory, "mamba", "qwen3_moe"), (gguf, "rwkv6", "qwen3moe")):
        ended = serve(model, tmp_path)
        assert ended.returncode == 2 and "Traceback" not in ended.stderr
        line = next(x for x in ended.stderr.splitlines() if x.startswith("error:"))
        assert str(model) in line and f"architecture {architecture!r} is not supported" in line
        assert "(supported: " in line and served in line and "llama" in line  # each file kind's own names
    weightless = tmp_path / "qwen3"
    weightless.mkdir()
    (weightless / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    ended = serve(weightless, tmp_path)
    assert ended.returncode == 2 and "no *.safetensors weights" in ended.stderr and "Traceback" not in ended.stderr
    missing = serve(tmp_path / "nowhere.gguf", tmp_path)
    assert missing.returncode == 2 and "model not found" in missing.stderr and "Traceback" not in missing.stderr


@pytest.mark.slow
def test_a_model_that_fails_to_load_stops_the_server_it_was_the_only_backend_of(tmp_path):
    directory = tmp_path / "weightless"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))  # servable in name, no weights
    ended = serve(directory, tmp_path)
    assert ended.returncode == 2 and "Traceback" not in ended.stderr, ended.stderr[-2000:]
    assert [x for x in ended.stderr.splitlines() if x.startswith("error: ")], ended.stderr[-2000:]


class Broken(Backend):
    name = "broken"

    async def start(self) -> None:
        raise ValueError("weights.gguf: architecture 'qwen3' is not supported by the built-in engine")

    def generate(self, request):
        raise NotImplementedError

    async def capabilities(self) -> Capabilities:
        return Capabilities("fake", "1", "broken", 512, False)

    async def health(self) -> Health:
        return Health.DOWN

    async def load(self) -> Load:
        return Load()


class Fine(Broken):
    name = "fine"

    async def start(self) -> None:
        pass

    async def health(self) -> Health:
        return Health.READY


def test_a_backend_that_failed_to_start_is_named_in_ready(tmp_path):
    with serve_app(gateway_app({"broken": Broken(), "fine": Fine()}, tmp_path)) as url:
        while "failed" not in (body := httpx.get(f"{url}/ready").json()):
            time.sleep(0.05)
    assert body["status"] == "ready" and body["models"] == {"broken": "down", "fine": "ready"}
    assert body["failed"] == {"broken": "broken: weights.gguf: architecture 'qwen3' is not supported by the built-in "
                                        "engine"}
