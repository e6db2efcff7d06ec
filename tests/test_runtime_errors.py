"""The runtimes' own error paths, as their source says they behave (each fixture names the file
and release it follows): errors sent as events on a 200 stream, TGI's validation, llama-server's
error type and loading state, gauges labelled per engine, llama-cpp-python's server counting."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

import pytest

from advisor.measure.baselines import free_port, llama_cpp_command, server_process
from backends.base import ContextTooLong, GenerateRequest, Health, InvalidRequest, Usage
from backends.default_model import default_model_path
from backends.llamacpp import LlamaCppServerBackend, llama_server_config
from backends.openai_compat import OpenAICompatConfig
from backends.sglang import SGLangBackend
from backends.tgi import TGIBackend
from backends.vllm import VLLMBackend

from .conftest import generated, serve_app
from .replay import replay

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).parent / "fixtures"


def fixture(runtime: str) -> dict:
    (path,) = FIXTURES.glob(f"{runtime}-*.json")
    return json.loads(path.read_text())


def against(app, make, scenario):
    """`scenario(backend)` with the backend `make(url)` builds for `app` served locally."""
    with serve_app(app) as url:
        return asyncio.run(against_url(make(url), scenario))


def test_tgi_chat_and_generate_stream_with_tgis_validation():
    tgi, seen = fixture("tgi"), []

    async def scenario(backend):
        chat, chat_finish = await generated(backend, messages=[{"role": "user", "content": "Colors?"}],
                                            max_tokens=6, temperature=0.7)  # top_p stays at its default, 1.0
        text, finish = await generated(backend, prompt="The primary colors are", max_tokens=6)
        errors = []
        for fields in ({"prompt": "hello " * 5000}, {"messages": [{"role": "user", "content": "hello " * 5000}]},
                       {"prompt": "hi", "top_p": 1.5, "temperature": 1.0},
                       {"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5, "temperature": 1.0}):
            with pytest.raises((ContextTooLong, InvalidRequest)) as caught:
                await generated(backend, max_tokens=6, **fields)
            errors.append(type(caught.value))
        return chat, chat_finish, text, finish, errors, await backend.load(), await backend.capabilities()

    chat, chat_finish, text, finish, errors, load, caps = against(
        replay(tgi, seen), lambda url: TGIBackend(OpenAICompatConfig(base_url=url, model=tgi["model"])), scenario)
    chat_body = next(body for body in seen if "messages" in body)
    assert "top_p" not in chat_body  # TGI refuses top_p = 1.0 ("must be > 0.0 and < 1.0")
    assert chat == text == " red, yellow and blue."
    assert chat_finish.finish_reasons == ("stop",)  # TGI's `eos_token`, in OpenAI's words
    assert finish.finish_reasons == ("length",) and finish.usage == Usage(7, 6)
    # a prompt that does not fit is that, by either of TGI's messages; a bad top_p is invalid
    assert errors == [ContextTooLong, ContextTooLong, InvalidRequest, InvalidRequest]
    assert (load.running, load.waiting) == (3, 1) and (caps.version, caps.max_context) == ("3.3.7", 2048)


def test_sglang_native_stream_errors_without_a_code_are_typed():
    sglang = fixture("sglang")

    async def scenario(backend):
        with pytest.raises(ContextTooLong, match="longer than the model's context length"):
            await generated(backend, prompt="hello " * 5000, max_tokens=6)
        return await backend.capabilities()

    caps = against(replay(sglang), lambda url: SGLangBackend(
        OpenAICompatConfig(base_url=url, model=sglang["model"]), native=True), scenario)
    assert caps.max_context == 32768  # from /v1/models' max_model_len; /server_info's context_length is null
    assert SGLangBackend.HEALTH_TIMEOUT_S > 20  # its /health waits up to 20 s for a one-token generation


def test_llama_server_context_error_type_and_loading_health():
    server = copy.deepcopy(fixture("llama-server"))  # recorded: a too-long prompt is exceed_context_size_error
    assert server["routes"]["POST /v1/completions context_too_long"]["json"]["error"]["type"] == \
        "exceed_context_size_error"

    async def scenario(backend):
        with pytest.raises(ContextTooLong):
            await generated(backend, prompt="hello " * 5000, max_tokens=6)
        server["routes"]["GET /health"] = {"status": 503, "json": {
            "error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}}
        return await backend.health()

    health = against(replay(server), lambda url: LlamaCppServerBackend(llama_server_config(url, server["model"])),
                     scenario)
    assert health == Health.LOADING


def test_gauges_of_several_engines_average_and_counts_add_up():
    vllm = copy.deepcopy(fixture("vllm"))
    vllm["routes"]["GET /metrics"] = {"status": 200, "text": "".join(
        f'vllm:num_requests_running{{engine="{e}",model_name="m"}} {r}\n'
        f'vllm:kv_cache_usage_perc{{engine="{e}",model_name="m"}} {kv}\n'
        f'vllm:prefix_cache_queries_total{{engine="{e}",model_name="m"}} 100\n'
        f'vllm:prefix_cache_hits_total{{engine="{e}",model_name="m"}} {hits}\n'
        for e, r, kv, hits in ((0, 3, 0.75, 50), (1, 2, 0.5, 30)))}

    async def scenario(backend):
        return await backend.load()

    load = against(replay(vllm), lambda url: VLLMBackend(OpenAICompatConfig(base_url=url, model=vllm["model"])),
                   scenario)
    assert (load.running, load.kv_usage, load.prefix_hit_rate) == (5, 0.625, 0.4)


def test_llama_cpp_python_server_counts_prompts_and_says_too_long_without_max_context():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [*llama_cpp_command(default_model_path(), port, n_ctx=512), "--model_alias", "smollm2"]

    async def scenario(backend):
        request = GenerateRequest(request_id="c", model="m", prompt="The three primary colors are")
        counted = await backend.count_prompt_tokens(request)
        with pytest.raises(ContextTooLong):
            await generated(backend, prompt="hello " * 600, max_tokens=4)
        text, _ = await generated(backend, prompt="The three primary colors are", max_tokens=4)
        return counted, (await backend.capabilities()).max_context, text

    with server_process(command, url, "/v1/models"):
        backend = LlamaCppServerBackend(llama_server_config(url, "smollm2", python_server=True))
        counted, context, text = asyncio.run(against_url(backend, scenario))
    assert context == 0 and text  # it says its context nowhere; the error still comes typed
    from llama_cpp import Llama

    vocabulary = Llama(str(default_model_path()), vocab_only=True, verbose=False)
    exact = len(vocabulary.tokenize(b"The three primary colors are", add_bos=True, special=True))
    assert counted == exact < len(b"The three primary colors are")  # not the byte-count bound


async def against_url(backend, scenario):
    await backend.start()
    try:
        return await scenario(backend)
    finally:
        await backend.close()
