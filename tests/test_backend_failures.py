"""A backend process killed mid-stream: the client gets a typed error event, never a clean end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import httpx
import pytest

from advisor.measure.baselines import free_port, llama_cpp_command
from backends.cpu import for_this_cpu
from backends.default_model import default_model_path
from backends.llamacpp import LlamaCppServerBackend, llama_server_config

from .conftest import AUTH, gateway_app, serve_app, wait_ready

pytestmark = pytest.mark.slow


def test_killing_the_backend_mid_stream_ends_the_stream_with_an_error_event(tmp_path):
    port = free_port()
    upstream = f"http://127.0.0.1:{port}"
    command = [*llama_cpp_command(default_model_path(), port, n_ctx=2048), "--model_alias", "smollm2"]
    server = subprocess.Popen(for_this_cpu(command), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        backend = LlamaCppServerBackend(llama_server_config(upstream, "smollm2", python_server=True, max_context=2048))
        with serve_app(gateway_app({"smollm2": backend}, tmp_path)) as url:
            wait_ready(url, timeout=120)
            with httpx.stream("POST", f"{url}/v1/completions", headers=AUTH, timeout=60, json={
                "model": "smollm2", "prompt": "Write a long story about the sea.", "max_tokens": 1500,
                "stream": True, "temperature": 0.8, "seed": 1,
            }) as response:
                events = []
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 3:
                            os.kill(server.pid, signal.SIGKILL)
            assert response.status_code == 200
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert error["code"] in ("upstream_error", "unavailable")
            finished = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-2] if "choices" in e]
            assert not any(finished)  # nothing pretended the text was complete
            deadline = time.monotonic() + 10
            while not (records := httpx.get(f"{url}/admin/usage", headers=AUTH).json()["records"]):
                assert time.monotonic() < deadline, "the failed request was not recorded"
                time.sleep(0.1)
            assert records[0]["status"] == "error" and records[0]["error_type"] == error["code"]
    finally:
        server.kill()
        server.wait()


def test_ready_while_one_backend_serves_and_not_when_none_does(tmp_path):
    """Readiness takes a gateway out of its load balancer: one backend down among several must not
    (the router skips it), every backend down must."""
    from backends.openai_compat import OpenAICompatBackend, OpenAICompatConfig

    from .conftest import openai_upstream

    closed = f"http://127.0.0.1:{free_port()}"
    with serve_app(openai_upstream(lambda path: [])) as live:
        up = OpenAICompatBackend(OpenAICompatConfig(base_url=live, model="stub"), name="up")
        down = OpenAICompatBackend(OpenAICompatConfig(base_url=closed, model="stub"), name="down")
        with serve_app(gateway_app({"a": up, "b": down}, tmp_path / "one")) as url:
            response = _ready_once_started(url)
            assert response.status_code == 200
            assert response.json() == {"status": "ready", "models": {"a": "ready", "b": "down"}}
        gone = OpenAICompatBackend(OpenAICompatConfig(base_url=closed, model="stub"), name="gone")
        with serve_app(gateway_app({"b": gone}, tmp_path / "none")) as url:
            response = _ready_once_started(url)
            assert response.status_code == 503 and response.json() == {"status": "not ready", "models": {"b": "down"}}


def _ready_once_started(url: str) -> httpx.Response:
    """/ready once no backend is still starting."""
    deadline = time.monotonic() + 30
    while "loading" in (response := httpx.get(f"{url}/ready")).json()["models"].values():
        assert time.monotonic() < deadline, response.text
        time.sleep(0.1)
    return response
