"""LoRA adapters through the remote runtimes' adapters: how each runtime is launched for them, how a
request names one, how one is loaded and unloaded, and each runtime's refusals, against SGLang's and
TGI's routes replayed as their source says they behave (tests/fixtures, the `lora` sections) and
llama-server's recorded one beside its `/lora-adapters` (`tools/server/server-task.cpp`)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from backends.base import Adapter, GenerateRequest, InvalidRequest, ModelNotFound, UpstreamError
from backends.launch import VLLM_RUNTIME_LORA_ENV, LaunchError, LaunchSpec, command
from backends.llamacpp import LlamaCppBackend, LlamaCppServerBackend, llama_server_config
from backends.openai_compat import OpenAICompatBackend, OpenAICompatConfig, Samples
from backends.sglang import SGLangBackend
from backends.tgi import TGIBackend
from backends.vllm import VLLMBackend

from .conftest import generated, serve_app
from .replay import replay

FIXTURES = Path(__file__).parent / "fixtures"


def fixture(runtime: str) -> dict:
    (path,) = FIXTURES.glob(f"{runtime}-*.json")
    return json.loads(path.read_text())


def adapter_dir(root: Path, name: str, rank: int) -> str:
    """A PEFT directory as far as a runtime reads it before the weights: its adapter_config.json."""
    directory = root / name
    directory.mkdir()
    (directory / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 2 * rank,
                                                               "target_modules": ["q_proj", "v_proj"]}))
    return str(directory)


# -- launch lines (fast) --------------------------------------------------------------------------------
def test_lora_asked_for_without_adapters_enables_run_time_loading_where_the_runtime_has_it():
    vllm, env = command(LaunchSpec(runtime="vllm", model="m", port=9000, max_loras=2, max_lora_rank=12))
    assert " ".join(vllm).endswith("--enable-lora --max-loras 2 --max-lora-rank 16")  # vLLM's next rank
    assert "--lora-modules" not in vllm and env == VLLM_RUNTIME_LORA_ENV
    named, env = command(LaunchSpec(runtime="vllm", model="m", port=9000, lora_modules={"a": "/l/a"}))
    assert named[-5:] == ["--enable-lora", "--max-loras", "1", "--lora-modules", "a=/l/a"] and env
    assert command(LaunchSpec(runtime="vllm", model="m", port=9000))[1] == {}

    sglang, _ = command(LaunchSpec(runtime="sglang", model="m", port=9000, max_loras=4, max_lora_rank=16))
    assert sglang[-7:] == ["--enable-lora", "--max-loras-per-batch", "4", "--max-lora-rank", "16",
                           "--lora-target-modules", "all"]
    with pytest.raises(LaunchError, match="largest rank"):  # SGLang sizes its pool from them
        command(LaunchSpec(runtime="sglang", model="m", port=9000, max_loras=4))
    for runtime in ("tgi", "llama-server", "llama-cpp-python"):
        with pytest.raises(LaunchError, match="at launch only"):
            command(LaunchSpec(runtime=runtime, model="m", port=9000, max_loras=2))


# -- refusals that need no server (fast) ----------------------------------------------------------------
def test_a_backend_without_lora_refuses_a_request_for_an_adapter_rather_than_serve_the_base():
    backend = OpenAICompatBackend(OpenAICompatConfig(base_url="http://127.0.0.1:9", model="m"))
    with pytest.raises(InvalidRequest, match="does not serve LoRA adapters"):
        backend._body(GenerateRequest(request_id="r", prompt="hi", adapter="sql"))
    in_process = LlamaCppBackend()
    with pytest.raises(InvalidRequest, match="whole model when it loads it"):
        asyncio.run(in_process.load_adapter(Adapter("sql", "/l/sql.gguf")))
    with pytest.raises(ModelNotFound):
        in_process._check(GenerateRequest(request_id="r", prompt="hi", adapter="sql"))


def test_vllms_load_failures_in_the_taxonomy():
    """vLLM 0.32's answers (`entrypoints/openai/models/serving.py`, `lora/peft_helper.py`)."""
    vllm = VLLMBackend(OpenAICompatConfig(base_url="http://127.0.0.1:9", model="m"))
    adapter = Adapter("sql", "/l/sql")

    def error(status: int, message: str, kind: str = "BadRequestError"):
        body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()
        return vllm._load_error(status, body, adapter)

    missing = error(404, "Loading lora sql failed: No adapter found for /l/sql", "NotFoundError")
    assert isinstance(missing, InvalidRequest) and "/l/sql" in missing.message
    no_route = vllm._load_error(404, b'{"detail":"Not Found"}', adapter)
    assert isinstance(no_route, InvalidRequest) and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in no_route.message
    rank = error(500, "LoRA rank 32 is greater than max_lora_rank 16.", "InternalServerError")
    assert isinstance(rank, InvalidRequest) and "rank 32" in rank.message
    assert isinstance(error(400, "The lora adapter 'sql' conflicts with a served base model."), InvalidRequest)
    assert isinstance(error(500, "EngineCore died", "InternalServerError"), UpstreamError)  # the server's fault


def test_the_current_label_set_of_an_info_gauge_is_its_latest():
    """vLLM sets each label set of `vllm:lora_requests_info` to the time it saw it (`v1/metrics/loggers.py`)."""
    scraped = Samples.parse(
        "# TYPE vllm:lora_requests_info gauge\n"
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql,chat",waiting_lora_adapters=""} 1.8e9\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7e9\n')
    assert scraped.latest_labels("vllm:lora_requests_info")["running_lora_adapters"] == "sql,chat"
    assert scraped.latest_labels("vllm:num_requests_running") == {}


# -- SGLang, replayed ---------------------------------------------------------------------------------
def sglang_lora(fixture: dict, seen: list):
    """SGLang serving LoRA (the fixture's `lora` section on its recorded routes): adapters loaded and
    unloaded at run time, listed in `/v1/models`, requested as `model` "BASE:ADAPTER"."""
    lora, base = fixture["lora"], fixture["model"]
    words = lora["messages"]
    loaded: dict[str, str] = {}
    ever: set[str] = set()  # its tokenizer manager's cache: an unloaded adapter is loaded again on request
    inner = replay(fixture, seen)

    async def answer(send, status: int, body: dict) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})

    def update(error: str | None) -> tuple[int, dict]:
        return (400 if error else 200), {"success": not error, "error_message": error or "",
                                         "loaded_adapters": dict(loaded)}

    def load(name: str, path: str) -> str | None:
        if not os.path.isdir(path):
            return words["missing_path"].format(path=path)
        if name in loaded:
            return words["already_loaded"].format(name=name)
        rank = json.loads((Path(path) / "adapter_config.json").read_text())["r"]
        if rank > lora["server_info"]["max_lora_rank"]:
            return words["rank_too_large"].format(name=name, rank=rank)
        loaded[name] = path
        ever.add(name)
        return None

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return await inner(scope, receive, send)
        message = await receive()
        body = message.get("body", b"")
        route = f"{scope['method']} {scope['path']}"
        request = json.loads(body or b"{}") if scope["method"] == "POST" else {}
        if route == "GET /server_info":
            return await answer(send, 200, fixture["routes"][route]["json"] | lora["server_info"])
        if route == "GET /v1/models":
            cards = [{"id": name, "root": path, "parent": base} | lora["model_card"] for name, path in loaded.items()]
            listing = fixture["routes"][route]["json"]
            return await answer(send, 200, listing | {"data": listing["data"] + cards})
        if route == "POST /load_lora_adapter":
            seen.append(request)
            return await answer(send, *update(load(request["lora_name"], request["lora_path"])))
        if route == "POST /unload_lora_adapter":
            seen.append(request)
            name = request["lora_name"]
            if name not in loaded:
                error = words["unknown_unload"].format(name=name, names=list(loaded))
                return await answer(send, 400, {"success": False, "error_message": error, "loaded_adapters": None})
            del loaded[name]
            return await answer(send, *update(None))
        named = request.get("model", "").removeprefix(f"{base}:") if ":" in request.get("model", "") \
            else request.get("lora_path")
        if named and named not in loaded and named not in ever:
            seen.append(request)
            error = words["never_loaded"].format(name=named, names=list(ever))
            return await answer(send, 400, lora["error"] | {"message": error})

        async def again():
            return {"type": "http.request", "body": body, "more_body": False}

        return await inner(scope, again, send)

    return app


@pytest.mark.slow
def test_sglang_loads_serves_and_unloads_adapters_as_it_answers(tmp_path):
    sglang, seen = fixture("sglang"), []
    sql, wide = adapter_dir(tmp_path, "sql", 8), adapter_dir(tmp_path, "wide", 32)

    async def scenario(url):
        backend = SGLangBackend(OpenAICompatConfig(base_url=url, model=sglang["model"]))
        native = SGLangBackend(OpenAICompatConfig(base_url=url, model=sglang["model"]), native=True)
        await backend.start()
        await native.start()
        try:
            before = await backend.capabilities()
            await backend.load_adapter(Adapter("sql", sql))
            loads = len(seen)
            await backend.load_adapter(Adapter("sql", sql))  # loaded already: nothing is asked
            assert len(seen) == loads
            text, _ = await generated(backend, prompt="The primary colors are", max_tokens=6, adapter="sql")
            asked = seen[-1]
            await generated(native, prompt="The primary colors are", max_tokens=6, adapter="sql")
            asked_native = seen[-1]
            with pytest.raises(InvalidRequest, match=str(tmp_path / "gone")):
                await backend.load_adapter(Adapter("gone", str(tmp_path / "gone")))
            with pytest.raises(InvalidRequest, match="with rank 32 is incompatible"):
                await backend.load_adapter(Adapter("wide", wide))
            with pytest.raises(InvalidRequest, match="never been loaded"):
                await generated(backend, prompt="hi", max_tokens=6, adapter="legal")
            after_load = await backend.capabilities()
            await backend.unload_adapter("sql")
            with pytest.raises(ModelNotFound, match="does not exist"):
                await backend.unload_adapter("sql")
            return before, after_load, await backend.capabilities(), text, asked, asked_native
        finally:
            await backend.close()
            await native.close()

    with serve_app(sglang_lora(sglang, seen)) as url:
        before, loaded, unloaded, text, asked, asked_native = asyncio.run(scenario(url))
    assert (before.max_loras, before.max_lora_rank, before.adapters) == (4, 16, frozenset())
    assert loaded.adapters == {"sql"} and unloaded.adapters == frozenset() and text
    assert asked["model"] == f"{sglang['model']}:sql"  # serving_base.py `_parse_model_parameter`
    assert asked_native["lora_path"] == "sql" and "model" not in asked_native  # GenerateReqInput


# -- TGI, replayed ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_tgi_serves_the_adapters_of_its_launch_and_refuses_others_it_would_answer_with_the_base():
    tgi, seen = fixture("tgi"), []
    config = OpenAICompatConfig(base_url="", model=tgi["model"], adapters=tgi["lora"]["adapters"])

    async def scenario(url):
        config.base_url = url
        backend = TGIBackend(config)
        await backend.start()
        try:
            caps = await backend.capabilities()
            await backend.load_adapter(Adapter("support", "support"))
            await generated(backend, prompt="The primary colors are", max_tokens=6, adapter="support")
            await generated(backend, messages=[{"role": "user", "content": "Colors?"}], max_tokens=6,
                            adapter="support")
            sent = len(seen)
            with pytest.raises(ModelNotFound):  # TGI would run it as the base model
                await generated(backend, prompt="hi", max_tokens=6, adapter="legal")
            assert len(seen) == sent
            with pytest.raises(InvalidRequest, match="at launch only"):
                await backend.load_adapter(Adapter("legal", "/l/legal"))
            await backend.unload_adapter("support")  # forgotten here, loaded there: it can come back
            forgotten = (await backend.capabilities()).adapters
            await backend.load_adapter(Adapter("support", "support"))
            return caps, forgotten, await backend.load()
        finally:
            await backend.close()

    with serve_app(replay(tgi, seen)) as url:
        caps, forgotten, load = asyncio.run(scenario(url))
    assert caps.adapters == {"support"} and caps.max_loras == 1 and not caps.prefix_caching
    assert forgotten == frozenset() and load.resident_adapters == {"support"}
    generate, chat = seen
    assert generate["parameters"]["adapter_id"] == "support" and chat["model"] == "support"


# -- llama-server, its recorded routes and /lora-adapters ---------------------------------------------------
@pytest.mark.slow
def test_llama_server_serves_by_name_the_gguf_adapters_of_its_launch():
    server, seen = fixture("llama-server"), []
    # `GET /lora-adapters` of `--lora /l/sql.gguf --lora-init-without-apply` as the peers' build answers it
    # (server-task.cpp `server_task_result_get_lora::to_json`): its scale stays 1.0
    launched = [{"id": 0, "path": "/l/sql.gguf", "scale": 1.0, "task_name": "", "prompt_prefix": ""}]
    inner = replay(server, seen)

    async def app(scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/lora-adapters":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            return await send({"type": "http.response.body", "body": json.dumps(launched).encode()})
        return await inner(scope, receive, send)

    async def scenario(url):
        backend = LlamaCppServerBackend(llama_server_config(url, server["model"]))
        await backend.start()
        try:
            await backend.load_adapter(Adapter("sql", "/l/./sql.gguf"))
            with pytest.raises(InvalidRequest, match="convert_lora_to_gguf"):
                await backend.load_adapter(Adapter("legal", "/l/legal"))
            await generated(backend, prompt="The primary colors are", max_tokens=6, adapter="sql")
            await generated(backend, prompt="The primary colors are", max_tokens=6)
            with pytest.raises(ModelNotFound):
                await generated(backend, prompt="hi", max_tokens=6, adapter="legal")
            return await backend.capabilities(), await backend.load()
        finally:
            await backend.close()

    with serve_app(app) as url:
        caps, load = asyncio.run(scenario(url))
    assert caps.adapters == {"sql"} and caps.max_loras == 1 and load.resident_adapters == {"sql"}
    with_adapter, base = seen[-2:]
    assert with_adapter["model"] == base["model"] == server["model"]
    assert with_adapter["lora"] == [{"id": 0, "scale": 1.0}]
    assert base["lora"] == [{"id": 0, "scale": 0.0}]  # not the launch's scales
