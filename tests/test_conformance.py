"""One conformance suite for every backend, against real servers:

- `builtin`: the built-in engine on the default model, in process;
- `llama-cpp`: llama.cpp in process (llama-cpp-python, a pool of two slots) on the default GGUF;
- `llama-cpp-server`: llama-cpp-python's server on the default GGUF, a subprocess, through the
  generic OpenAI adapter (its llama.cpp profile);
- `llama-server`: llama.cpp's C++ server, built from the llama.cpp that llama-cpp-python vendors
  (`python -m backends.peers llama-server`), two slots with continuous batching;
- `vllm`: vLLM's CPU build (`python -m backends.peers vllm`) on the default model, in float32: the
  run's one vLLM server (conftest's `vllm_url`), shared with test_vllm_parity.py;
- `tgi-protocol`: the TGI adapter against a server speaking TGI's native protocol: servegate's own
  TGI-compatible API (itself checked against TGI's official clients in test_tgi_api.py), here in
  front of the built-in engine, so cancellation can be seen in the engine's KV blocks;
- `sglang-fixture`, `tgi-fixture`: runtimes that cannot run here, replayed from tests/fixtures,
  each built from the source file and release it names, error paths included.

A peer that is not provisioned skips with the reason; `.ci/run` provisions them. The report at
the end of the run counts each target's results.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from advisor.measure.baselines import free_port, server_process
from backends.base import (
    Backend,
    ContextTooLong,
    Delta,
    GenerateRequest,
    Health,
    InvalidRequest,
    Load,
)
from backends.builtin import BuiltinBackend, EngineConfig
from backends.default_model import default_model_path
from backends.llamacpp import LlamaCppBackend, LlamaCppConfig, LlamaCppServerBackend, llama_server_config
from backends.openai_compat import OpenAICompatConfig
from backends.peers import llama_server, llama_server_command
from backends.sglang import SGLangBackend
from backends.tgi import TGIBackend
from backends.vllm import VLLMBackend

from .conftest import ADMIN_KEY, gateway_app, generated, provisioned_or_skip, serve_app, wait_ready
from .replay import replay

pytestmark = pytest.mark.slow

PROMPT = "The three primary colors are"


@dataclass
class Target:
    backend: Backend
    engine: object | None = None  # the built-in engine behind it, where we can see its KV blocks
    reports_prompt_tokens: bool = True
    reports_cached_tokens: bool = False  # prefix-cache hits in its usage (what the ledger bills at the cached price)
    isolates_prefixes: bool = False  # a request's cache salt keeps its prefixes from other salts'
    counts_prompts: tuple[bool, bool] = (False, False)  # `exact_prompt_tokens` answers for (text, chat)
    tokenized: str = PROMPT  # a replayed runtime tokenizes only the text it recorded
    replayed: bool = False  # a fixture: it answers what it recorded, whatever the prompt


@contextlib.contextmanager
def target_of(kind: str, request):
    if kind == "builtin":
        backend = BuiltinBackend(EngineConfig(engine_process=False))  # its engine is checked for leaks
        asyncio.run(backend.start())
        yield Target(backend, backend.engine, reports_cached_tokens=True, isolates_prefixes=True)
        asyncio.run(backend.close())
    elif kind == "llama-cpp":
        yield Target(LlamaCppBackend(LlamaCppConfig(slots=2, n_ctx=2048)))
    elif kind == "llama-cpp-server":
        port = free_port()
        command = [sys.executable, "-m", "llama_cpp.server", "--model", str(default_model_path()), "--port",
                   str(port), "--n_ctx", "2048", "--model_alias", "smollm2", "--interrupt_requests", "False"]
        url = f"http://127.0.0.1:{port}"
        with server_process(command, url, "/v1/models"):
            config = llama_server_config(url, "smollm2", python_server=True, max_context=2048)
            yield Target(LlamaCppServerBackend(config, name="llama-cpp"), reports_prompt_tokens=False,
                         counts_prompts=(True, False))
    elif kind == "llama-server":
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        provisioned_or_skip(llama_server)
        with server_process(llama_server_command(default_model_path(), port, "smollm2"), url, "/health"):
            yield Target(LlamaCppServerBackend(llama_server_config(url, "smollm2"), name="llama-server"),
                         reports_cached_tokens=True, counts_prompts=(True, True))
    elif kind == "vllm":
        url = request.getfixturevalue("vllm_url")  # the run's one vLLM server, in float32
        yield Target(VLLMBackend(OpenAICompatConfig(base_url=url, model="smollm2")), reports_cached_tokens=True,
                     isolates_prefixes=True, counts_prompts=(True, True))
    elif kind in ("sglang-fixture", "tgi-fixture"):
        runtime = kind.removesuffix("-fixture")
        fixture = json.loads(next((Path(__file__).parent / "fixtures").glob(f"{runtime}-*.json")).read_text())
        with serve_app(replay(fixture)) as url:
            adapter = SGLangBackend if runtime == "sglang" else TGIBackend
            recorded = fixture["routes"].get("POST /tokenize", {}).get("text", PROMPT)
            yield Target(adapter(OpenAICompatConfig(base_url=url, model=fixture["model"])), tokenized=recorded,
                         replayed=True)
    else:  # tgi-protocol
        engine_backend = BuiltinBackend(EngineConfig(engine_process=False))
        app = gateway_app({engine_backend.model_id: engine_backend},
                          request.getfixturevalue("tmp_path_factory").mktemp("tgi-target"))
        with serve_app(app) as url:
            wait_ready(url)
            yield Target(TGIBackend(OpenAICompatConfig(base_url=url, model=engine_backend.model_id,
                                                       api_key=ADMIN_KEY)), engine_backend.engine)


TARGETS = ["builtin", "llama-cpp", "llama-cpp-server", "llama-server", "vllm", "tgi-protocol", "sglang-fixture",
           "tgi-fixture"]


@pytest.fixture(scope="module", params=TARGETS)
def target(request):
    with target_of(request.param, request) as made:
        if request.param != "builtin":
            asyncio.run(made.backend.start())
        yield made
        if request.param != "builtin":
            asyncio.run(made.backend.close())


def run(target: Target, coroutine):
    """Run against the target on a fresh loop, starting remote clients inside it."""

    async def main():
        if not isinstance(target.backend, BuiltinBackend):
            await target.backend.close()
            await target.backend.start()  # sessions belong to the loop that made them
        return await coroutine

    return asyncio.run(main())


def test_text_and_chat_with_max_tokens_and_usage(target):
    async def scenario():
        text, finish = await generated(target.backend, prompt=PROMPT, max_tokens=8)
        chat, chat_finish = await generated(target.backend, messages=[{"role": "user", "content": "Say hi"}],
                                           max_tokens=6)
        return text, finish, chat, chat_finish

    text, finish, chat, chat_finish = run(target, scenario())
    assert text and chat
    assert 1 <= finish.usage.completion_tokens <= 8 and 1 <= chat_finish.usage.completion_tokens <= 6
    assert finish.finish_reasons[0] in ("length", "stop")
    if finish.usage.completion_tokens == 8:
        assert finish.finish_reasons == ("length",)
    if target.reports_prompt_tokens:
        assert finish.usage.prompt_tokens >= 5 and chat_finish.usage.prompt_tokens >= 5


def test_greedy_is_repeatable_and_stop_strings_end_the_text(target):
    async def scenario():
        first, _ = await generated(target.backend, prompt=PROMPT, max_tokens=24)
        again, _ = await generated(target.backend, prompt=PROMPT, max_tokens=24)
        words = first.split()
        stop = words[len(words) // 2]
        stopped, finish = await generated(target.backend, prompt=PROMPT, max_tokens=24, stop=(stop,))
        return first, again, stop, stopped, finish

    first, again, stop, stopped, finish = run(target, scenario())
    assert first == again
    assert first.startswith(stopped) and len(stopped) < len(first)  # cut at the stop string (kept or not)
    assert stop not in stopped[: len(stopped) - len(stop)] and finish.finish_reasons == ("stop",)


def test_a_repeated_prompt_reports_the_tokens_its_cache_served(target):
    """Where a runtime says in its usage how much of a prompt its prefix cache served (the engine,
    llama-server, vLLM started with `--enable-prompt-tokens-details`), a repeated 400-token prompt
    reports most of it; where it does not, 0; never more than the prompt. Where it keeps cache
    salts apart (the engine, vLLM's `cache_salt`), the same prompt under another salt hits nothing."""
    prompt = "Notes on the tides. " + " ".join(f"Line {i}: the moon pulls the sea." for i in range(40))

    async def scenario():
        await generated(target.backend, prompt=prompt, max_tokens=2, cache_salt="tenant-a")
        again = await generated(target.backend, prompt=prompt, max_tokens=2, cache_salt="tenant-a")
        elsewhere = await generated(target.backend, prompt=prompt, max_tokens=2, cache_salt="tenant-b")
        return again[1].usage, elsewhere[1].usage

    usage, elsewhere = run(target, scenario())
    assert 0 <= usage.cached_tokens <= usage.prompt_tokens
    if target.reports_cached_tokens:
        assert usage.prompt_tokens >= 400 and usage.cached_tokens >= usage.prompt_tokens // 2
    elif not target.replayed:
        assert usage.cached_tokens == 0
    if target.isolates_prefixes:
        assert elsewhere.cached_tokens == 0


def test_a_prompt_is_counted_as_the_runtime_bills_it(target):
    """What the gateway asks a runtime for a request that ended without its usage (client gone,
    runtime died: `exact_prompt_tokens`) is the prompt count that runtime's own usage gives a
    finished answer: a text prompt, and a chat through its template. vLLM and llama-server count
    both; llama-cpp-python's server text only (it has no template route); others keep the
    reservation's count (the built-in engine's is exact already)."""
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three rivers."}]

    async def scenario():
        counted, billed = [], []
        for prompt in ({"prompt": PROMPT}, {"messages": chat}):
            counted.append(await target.backend.exact_prompt_tokens(
                GenerateRequest(request_id="count-me", model="m", max_tokens=2, **prompt)))
            billed.append((await generated(target.backend, max_tokens=2, **prompt))[1].usage.prompt_tokens)
        return counted, billed

    counted, billed = run(target, scenario())
    assert tuple(count is not None for count in counted) == target.counts_prompts
    if target.reports_prompt_tokens and not target.replayed:
        assert all(count == bill for count, bill in zip(counted, billed) if count is not None), (counted, billed)


def test_llama_cpp_in_process_counts_prompts_as_llama_cpp_python_does():
    """llama-cpp-python streams no usage, so llama.cpp in process counts each prompt itself: the
    same count llama-cpp-python's own answer gives without streaming, a text and chats through
    the GGUF's template (a system turn, several turns, text beyond ASCII)."""
    chats = [[{"role": "user", "content": "hello there"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three rivers."}],
             [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"},
              {"role": "user", "content": "¿Qué tal? 日本語 😀"}]]
    backend = LlamaCppBackend(LlamaCppConfig(slots=1, n_ctx=2048))

    async def scenario():
        await backend.start()
        try:
            llama = backend._slots[0].llama
            ours = [(await generated(backend, prompt=PROMPT, max_tokens=1))[1].usage.prompt_tokens]
            theirs = [llama.create_completion(PROMPT, max_tokens=1, temperature=0)["usage"]["prompt_tokens"]]
            for chat in chats:
                ours.append((await generated(backend, messages=chat, max_tokens=1))[1].usage.prompt_tokens)
                theirs.append(llama.create_chat_completion(chat, max_tokens=1, temperature=0)["usage"]["prompt_tokens"])
            return ours, theirs
        finally:
            await backend.close()

    ours, theirs = asyncio.run(scenario())
    assert ours == theirs and min(ours) >= 5


def test_errors_map_to_the_taxonomy(target):
    async def scenario():
        caps = await target.backend.capabilities()
        with pytest.raises(ContextTooLong):
            await generated(target.backend, prompt="hello " * (caps.max_context + 50), max_tokens=4)
        with pytest.raises(InvalidRequest):
            await generated(target.backend, prompt=PROMPT, max_tokens=4, temperature=1.0, top_p=1.5)
        if not target.replayed:  # a vocabulary's log-probabilities with every token, a penalty beyond OpenAI's range
            for extra in ({"logprobs": True, "top_logprobs": 100_000}, {"presence_penalty": 100}):
                with pytest.raises(InvalidRequest):
                    await generated(target.backend, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                    extra=extra)
        return caps

    caps = run(target, scenario())
    assert caps.max_context >= 2048


def test_content_parts_are_read_and_what_a_model_cannot_read_is_the_clients_error(target):
    """OpenAI content parts: text parts are read as text on every runtime, joined by a newline as
    vLLM and llama-server join them (llama-cpp-python's templates concatenate strings only: they
    get them joined so). An image part sent to the text-only default model, or an earlier turn's
    malformed tool calls, are the client's mistake (`InvalidRequest`, a 400) or ignored, never
    reported as the runtime's own failure, which would count against its circuit breaker and
    turn every tenant's traffic away (llama-server answers both with a 500; llama-cpp-python
    failed in its template)."""
    if target.replayed:
        pytest.skip("a replayed runtime answers what it recorded, whatever the request")
    brief = {"type": "text", "text": "Answer in one word."}
    question = {"type": "text", "text": "What is the capital of France?"}
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    parts, parts_finish = run(target, generated(target.backend, max_tokens=8,
                                                messages=[{"role": "user", "content": [brief, question]}]))
    plain, plain_finish = run(target, generated(target.backend, max_tokens=8, messages=[
        {"role": "user", "content": f"{brief['text']}\n{question['text']}"}]))
    assert parts == plain  # parts joined by a newline, as vLLM and llama-server join them
    if target.reports_prompt_tokens:
        assert parts_finish.usage.prompt_tokens == plain_finish.usage.prompt_tokens
    with pytest.raises(InvalidRequest):
        run(target, generated(target.backend, messages=[{"role": "user", "content": [image, question]}],
                              max_tokens=4))
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": "bad"},
             {"role": "user", "content": "and?"}]
    with contextlib.suppress(InvalidRequest):  # a template that reads no tool calls answers
        run(target, generated(target.backend, messages=turns, max_tokens=2))


def test_a_forced_tool_call_is_a_tool_call_or_refused(target):
    """`tool_choice` "required" obliges a tool call (OpenAI's contract): a runtime answers with
    one, or the request is refused as the client's; never plain text (llama-server drops the
    tools of a template without them and answered with text)."""
    if target.replayed:
        pytest.skip("a replayed runtime answers what it recorded, whatever the request")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

    async def scenario():
        request = GenerateRequest(request_id=f"tools-{time.monotonic_ns()}", model="m", max_tokens=40,
                                  temperature=0.0, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                  extra={"tools": tools, "tool_choice": "required", "parallel_tool_calls": False})
        return [event async for event in target.backend.generate(request) if isinstance(event, Delta)]

    try:
        deltas = run(target, scenario())
    except InvalidRequest as refused:  # llama.cpp in process takes no tools; vLLM wants a tool parser
        assert "tool" in str(refused)
        return
    calls = [call for d in deltas for call in ((d.extra or {}).get("delta") or {}).get("tool_calls") or []]
    assert calls and not "".join(d.text for d in deltas).strip()


def test_closing_the_stream_cancels_the_request(target):
    async def scenario():
        request = GenerateRequest(request_id="cancel-me", model="m", prompt="Write a very long story about a cat.",
                                  max_tokens=1500, temperature=0.7, seed=3)
        events = target.backend.generate(request)
        got = 0
        async for event in events:
            got += isinstance(event, Delta) and bool(event.text)
            if got == 3:
                break
        started = time.monotonic()
        await events.aclose()
        closed_in = time.monotonic() - started
        after, _ = await generated(target.backend, prompt=PROMPT, max_tokens=4)  # the backend still serves
        return closed_in, after

    closed_in, after = run(target, scenario())
    assert closed_in < 2.0 and after
    if target.engine is not None:  # the engine behind it freed the request's blocks
        deadline = time.monotonic() + 10
        while target.engine.kv.num_used or target.engine.scheduler.running:
            assert time.monotonic() < deadline, "the cancelled request still holds KV blocks"
            time.sleep(0.01)


def test_health_and_load(target):
    async def scenario():
        return await target.backend.health(), await target.backend.load()

    health, load = run(target, scenario())
    assert health == Health.READY and isinstance(load, Load)


def test_tokenize_where_the_backend_offers_it(target):
    async def scenario():
        caps = await target.backend.capabilities()
        if not caps.tokenize:  # says so, clearly, when asked anyway
            with pytest.raises(InvalidRequest, match="does not offer tokenization"):
                await target.backend.tokenize(text)
        return caps.tokenize, (await target.backend.tokenize(text)) if caps.tokenize else []

    text = target.tokenized
    offered, spans = run(target, scenario())
    if target.engine is not None or isinstance(target.backend, LlamaCppBackend):
        assert offered  # the built-in engine, llama.cpp in process and TGI all tokenize
    if offered:
        assert len(spans) >= 2 and "".join(s.text for s in spans).strip() == text
        assert all(text[s.start:s.stop] == s.text for s in spans)
    if target.engine is not None:
        ids = target.engine.tokenizer.encode(PROMPT)
        assert [s.id for s in spans] == ids
