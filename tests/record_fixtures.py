"""Re-record the fixtures of the runtimes that run here from their live servers, so a fixture
cannot drift from the real thing:

    python -m tests.record_fixtures [vllm] [llama-server]

Each runtime is provisioned (`backends/peers.py`), started as the conformance suite starts it on
the default model, asked the exchanges the replayed tests ask (tests/replay.py answers them back),
and its answers are written to tests/fixtures/<runtime>-<version>.json with where they came from.
"""

from __future__ import annotations

import datetime
import json
import platform
import sys
from pathlib import Path

import httpx

from advisor.measure.baselines import free_port
from backends import peers
from backends.builtin.worker.loader import default_model_path, gguf_to_hf_dir
from backends.launch import supervised

FIXTURES = Path(__file__).parent / "fixtures"
MODEL = "smollm2"
GREEDY = {"model": MODEL, "max_tokens": 6, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
COMPLETION = GREEDY | {"prompt": "The primary colors are"}
EXCHANGES = [  # (key in the fixture, method, path, body)
    ("GET /health", "GET", "/health", None),
    ("GET /v1/models", "GET", "/v1/models", None),
    ("GET /metrics", "GET", "/metrics", None),
    ("POST /v1/completions", "POST", "/v1/completions", COMPLETION),
    ("POST /v1/chat/completions", "POST", "/v1/chat/completions",
     GREEDY | {"messages": [{"role": "user", "content": "Colors?"}]}),
    ("POST /v1/completions context_too_long", "POST", "/v1/completions", COMPLETION | {"prompt": "hello " * 5000}),
    ("POST /v1/completions invalid_parameter", "POST", "/v1/completions",
     COMPLETION | {"prompt": "hi", "top_p": 1.5, "temperature": 1.0}),
]
TOKENIZED = "Hello world"
RUNTIMES = {
    "vllm": [("GET /version", "GET", "/version", None),
             ("POST /tokenize", "POST", "/tokenize", {"model": MODEL, "prompt": TOKENIZED, "add_special_tokens": False,
                                                       "return_token_strs": True})],
    "llama-server": [("GET /props", "GET", "/props", None), ("GET /slots", "GET", "/slots", None),
                     ("POST /tokenize", "POST", "/tokenize", {"content": TOKENIZED, "with_pieces": True})],
}


def answer_of(client: httpx.Client, method: str, path: str, body: dict | None) -> dict:
    with client.stream(method, path, json=body) as response:
        raw = response.read()
        kind = response.headers.get("content-type", "")
    if "text/event-stream" in kind:
        events = [line[5:].strip() for line in raw.decode().splitlines() if line.startswith("data:")]
        return {"status": response.status_code, "sse": [json.loads(e) for e in events if e != "[DONE]"]}
    try:
        return {"status": response.status_code, "json": json.loads(raw)}
    except ValueError:
        return {"status": response.status_code, "text": raw.decode()}


def cpu_model() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    return next((line.partition(":")[2].strip() for line in lines if line.startswith("model name")), platform.machine())


def record(runtime: str) -> Path:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    model = gguf_to_hf_dir(default_model_path()) if runtime == "vllm" else default_model_path()
    if runtime == "vllm":
        peers.provision_vllm()
        argv, env = peers.vllm_command(model, port, MODEL), peers.vllm_env()
    else:
        peers.provision_llama_server()
        argv, env = peers.llama_server_command(model, port, MODEL), {}
    with supervised(argv, url, "/health", env, timeout_s=900), httpx.Client(base_url=url, timeout=300) as client:
        routes = {key: answer_of(client, method, path, body)
                  for key, method, path, body in [*EXCHANGES, *RUNTIMES[runtime]]}
    routes["POST /tokenize"]["text"] = TOKENIZED  # what the recorded tokens spell
    if runtime == "vllm":
        version = routes["GET /version"]["json"]["version"]
    else:
        version = routes["GET /props"]["json"]["build_info"]
    fixture = {
        "runtime": runtime, "version": version, "model": MODEL,
        "provenance": (f"Recorded from a live {runtime} {version} by tests/record_fixtures.py on "
                       f"{datetime.date.today()}, serving the default model (SmolLM2-135M-Instruct), on "
                       f"{cpu_model()}: `{' '.join(argv)}`."),
        "routes": routes,
    }
    for old in FIXTURES.glob(f"{runtime}-*.json"):
        old.unlink()
    path = FIXTURES / f"{runtime}-{version}.json"
    # this machine's paths stay out: the model and the program by their names
    text = json.dumps(fixture, indent=1).replace(str(model), model.name).replace(argv[0], Path(argv[0]).name)
    path.write_text(text + "\n")
    return path


if __name__ == "__main__":
    for name in sys.argv[1:] or RUNTIMES:
        print(record(name))
