"""Embeddings: the engine's pooling path (prefill-only sequences in the generation's step budget,
pooled into one unit vector), its backend's checks and cancellation, the OpenAI-compatible adapters'
`/v1/embeddings` against a fake upstream that lies, and, slow, against the real runtimes: the engine
agrees with vLLM's CPU build serving the same model as an embedding model."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math

import httpx
import pytest
import torch

from backends.base import (
    ContextTooLong,
    Delta,
    EmbedRequest,
    GenerateRequest,
    InvalidRequest,
    Overloaded,
    UpstreamError,
)
from backends.builtin import BuiltinBackend, EngineConfig
from backends.builtin.protocol import SamplingParams
from backends.openai_compat import OpenAICompatBackend, OpenAICompatConfig
from backends.tgi import TGIBackend
from backends.vllm import VLLMBackend

from . import conftest
from .conftest import assert_no_leaks, provisioned_or_skip, serve_app

TOL = 1e-5  # float32: the same sums in another order (other batch shapes, chunk splits)


def ids(n: int, seed: int = 1) -> list[int]:
    return [(seed * 7919 + 31 * i) % 40000 + 100 for i in range(n)]


def close(a: list[float], b: list[float], tol: float = TOL) -> bool:
    return torch.allclose(torch.tensor(a), torch.tensor(b), atol=tol, rtol=0)


def cosine(a: list[float], b: list[float]) -> float:
    return torch.nn.functional.cosine_similarity(torch.tensor(a, dtype=torch.float64),
                                                 torch.tensor(b, dtype=torch.float64), dim=0).item()


# -- the engine ---------------------------------------------------------------------------
def test_vectors_are_unit_length_deterministic_and_the_same_alone_or_batched(make_engine):
    engine = make_engine()
    prompts = [ids(5), ids(40, 2), ids(300, 3), ids(17, 4)]
    batched = engine.embed(prompts)
    assert all(len(v) == 576 and abs(math.fsum(x * x for x in v) - 1) < 1e-5 for v in batched)
    assert make_engine().embed(prompts) == batched  # the same batch on a fresh engine: bit for bit
    alone = [engine.embed([p])[0] for p in prompts]  # each alone, on its cached prefix (last-token pooling)
    assert all(close(a, b) for a, b in zip(alone, batched))
    assert len({tuple(v) for v in batched}) == 4
    stats = engine.stats()
    assert stats["running"] == stats["waiting"] == 0 and stats["admitted_requests_total"] == 8


def test_last_and_mean_pooling_differ(make_engine):
    prompt = ids(60)
    last, mean = make_engine().embed([prompt])[0], make_engine(pooling_type="mean").embed([prompt])[0]
    assert abs(math.fsum(x * x for x in mean) - 1) < 1e-5
    assert cosine(last, mean) < 0.99


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_a_long_input_chunked_across_steps_gives_the_unchunked_vector(make_engine, pooling):
    prompt = ids(700)
    whole = make_engine(pooling_type=pooling)
    chunked = make_engine(pooling_type=pooling, max_num_batched_tokens=96)
    assert close(chunked.embed([prompt])[0], whole.embed([prompt])[0])
    assert chunked.steps == 8 and whole.steps == 1  # 700 tokens in chunks of 96


def test_mean_pooling_reads_no_cached_prefix_and_last_pooling_does_within_its_salt(make_engine):
    """A cached prefix would skip the hidden states the mean needs: a mean-pooled prompt computes every
    token (its blocks still serve others); a last-pooled one reuses a prefix of its own salt only."""
    prefix, suffix = ids(200), ids(9, 5)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for pooling in ("mean", "last"):
        reference = make_engine(pooling_type=pooling, enable_prefix_caching=False).embed([prefix + suffix])[0]
        engine = make_engine(pooling_type=pooling)
        engine.add_request("warm", prefix + ids(3, 6), params, cache_salt="tenant-a")
        while engine.has_work:
            engine.step()
        computed, hits = engine.computed_prompt_tokens, engine.kv.hit_tokens
        assert close(engine.embed([prefix + suffix], cache_salt="tenant-b")[0], reference)
        assert engine.kv.hit_tokens == hits  # another tenant's prefix is never read
        assert close(engine.embed([prefix + suffix], cache_salt="tenant-a")[0], reference)
        read = engine.kv.hit_tokens - hits
        assert read == (192 if pooling == "last" else 0)  # 12 full blocks of the 200 shared tokens
        assert engine.computed_prompt_tokens - computed == 2 * len(prefix + suffix) - read


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_a_preempted_embedding_is_recomputed_to_the_same_vector(make_engine, tiny_model, pooling):
    """A generation growing beside it takes the last free block of a 640-token cache: the embedding,
    the newest, is preempted partway through its prompt, and computed again once room is back (from
    its start, where mean pooling reads no cached prefix)."""
    prompt = ids(420)
    reference = make_engine(tiny_model, dtype="float64", pooling_type=pooling).embed([prompt])[0]
    tight = make_engine(tiny_model, dtype="float64", pooling_type=pooling, num_kv_blocks=40, max_num_batched_tokens=16)
    tight.add_request("grows", ids(200, 9), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    assert close(tight.embed([prompt])[0], reference)
    assert tight.scheduler.num_preemptions > 0


# -- the engine's backend -----------------------------------------------------------------
@contextlib.asynccontextmanager
async def started(tiny_model_dir):
    """The engine on a thread (its state readable here) on the tiny model, with small steps so that
    a burst of long inputs takes many; leak-free at the end."""
    backend = BuiltinBackend(EngineConfig(model=str(tiny_model_dir), dtype="float64", engine_process=False,
                                          max_num_batched_tokens=128, max_model_len=1024))
    await backend.start()
    try:
        yield backend
    finally:
        await backend.close()
    assert_no_leaks(backend.engine)


async def idle(backend) -> None:
    """Until the engine has nothing left: aborts take effect at its next step boundary."""
    for _ in range(200):
        if not backend.engine.has_work:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the engine still has work")


async def test_the_backend_embeds_each_input_in_order_and_counts_their_tokens(tiny_model_dir):
    async with started(tiny_model_dir) as backend:
        texts = ("A short one.", "Something longer about the sea, the sky and the ships between them.")
        caps = await backend.capabilities()
        assert caps.embeddings
        got = await backend.embed(EmbedRequest("e1", texts))
        counts = [len(backend.tokenizer.encode(t)) for t in texts]
        assert got.prompt_tokens == sum(counts) and len(got.vectors) == 2
        alone = [(await backend.embed(EmbedRequest(f"e2-{i}", (t,)))).vectors[0] for i, t in enumerate(texts)]
        assert all(close(a, b) for a, b in zip(alone, got.vectors))
        as_ids = await backend.embed(EmbedRequest("e3", tuple(tuple(backend.tokenizer.encode(t)) for t in texts)))
        assert all(close(a, b) for a, b in zip(as_ids.vectors, got.vectors))


async def test_bad_inputs_are_refused_by_name(tiny_model_dir):
    async with started(tiny_model_dir) as backend:
        with pytest.raises(InvalidRequest, match="input 1 is empty") as empty:
            await backend.embed(EmbedRequest("bad-1", ("fine", "")))
        assert empty.value.param == "input"
        with pytest.raises(ContextTooLong, match="maximum context length is 1024") as long:
            await backend.embed(EmbedRequest("bad-2", (tuple(ids(1025)),)))
        assert long.value.param == "input"
        await backend.embed(EmbedRequest("ok", (tuple(ids(1024)),)))  # the whole context: a prompt for no output
        with pytest.raises(InvalidRequest, match="does not support Matryoshka") as dimensions:
            await backend.embed(EmbedRequest("bad-3", ("fine",), dimensions=32))
        assert dimensions.value.param == "dimensions"
        with pytest.raises(InvalidRequest, match="outside the vocabulary") as vocabulary:
            await backend.embed(EmbedRequest("bad-4", ((5, 10**6),)))
        assert vocabulary.value.param == "input"
        with pytest.raises(InvalidRequest, match="must not be empty"):
            EmbedRequest("bad-5", ())


async def test_an_embedding_burst_neither_stalls_nor_changes_a_streaming_generation(tiny_model_dir):
    """The burst's prompts share each step's budget with the generation's decode, which goes first:
    every step the burst runs in carries a token of the generation too, the burst fills the rest of
    the budget, and the generation answers as it does alone."""
    async with started(tiny_model_dir) as backend:
        request = dict(prompt="Count with me:", max_tokens=120, temperature=0.0, ignore_eos=True)
        alone = [e.token_ids async for e in backend.generate(GenerateRequest("alone", **request))
                 if isinstance(e, Delta)]
        burst = EmbedRequest("burst", tuple(tuple(ids(400, seed)) for seed in range(12)), cache_salt="burst")
        reference = [(await backend.embed(EmbedRequest(f"ref-{i}", (prompt,)))).vectors[0]
                     for i, prompt in enumerate(burst.inputs)]  # unsalted: the burst reads none of their blocks
        steps: list[dict[str, int]] = []  # each step's tokens by request id
        run = backend.engine.runner.run

        def recording(batch):
            steps.append({seq.request_id: n for seq, n in zip(batch.seqs, batch.num_new_tokens)})
            return run(batch)

        backend.engine.runner.run = recording
        tokens, embedding = [], None
        async for event in backend.generate(GenerateRequest("streaming", **request)):
            if isinstance(event, Delta):
                tokens.append(event.token_ids)
                embedding = embedding or asyncio.ensure_future(backend.embed(burst))
        vectors = (await embedding).vectors
    assert tokens == alone
    with_burst = [step for step in steps if any(rid.startswith("burst-") for rid in step)]
    assert len(with_burst) == 38  # 4,800 prompt tokens, 127 a step beside the decode
    assert all(step["streaming"] == 1 and sum(step.values()) <= 128 for step in with_burst)
    assert all(sum(step.values()) == 128 for step in with_burst[:-1])
    assert all(close(a, b) for a, b in zip(vectors, reference))


async def test_a_cancelled_embedding_aborts_its_requests(tiny_model_dir):
    async with started(tiny_model_dir) as backend:
        inputs = tuple(tuple(ids(1000, seed)) for seed in range(16))
        task = asyncio.ensure_future(backend.embed(EmbedRequest("gone", inputs)))
        while not backend.engine.computed_prompt_tokens:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await idle(backend)
        assert backend.engine.computed_prompt_tokens < 16 * 1000


# -- the OpenAI-compatible adapters against a fake upstream --------------------------------
def upstream(answers: dict[str, tuple[int, bytes]], seen: list[dict]):
    """Answers `/v1/embeddings` by the first input's text: (status, body)."""

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["method"] == "GET":  # /version, /v1/models: none here
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(body) if body else {}
        seen.append(request)
        status, answer = answers[request["input"][0] if isinstance(request["input"][0], str) else "ids"]
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": answer})

    return app


def vectors_answer(vectors, usage=7, indexes=None) -> tuple[int, bytes]:
    data = [{"object": "embedding", "index": i if indexes is None else indexes[i], "embedding": v}
            for i, v in enumerate(vectors)]
    return 200, json.dumps({"object": "list", "data": data, "usage": {"prompt_tokens": usage}}).encode()


ANSWERS = {
    "good": vectors_answer([[0.6, 0.8], [1.0, 0.0]], indexes=[1, 0]),
    "ids": vectors_answer([[0.0, 1.0]], usage=3),
    "short": vectors_answer([[0.6, 0.8]]),
    "nan": vectors_answer([[float("nan"), 1.0], [1.0, 0.0]]),  # json.dumps writes NaN, which is no JSON
    "ragged": vectors_answer([[0.6, 0.8], [1.0, 0.0, 0.0]]),
    "strings": (200, b'{"data": [{"embedding": "AAAA", "index": 0}, {"embedding": "AAAA", "index": 1}]}'),
    "twice": vectors_answer([[0.6, 0.8], [1.0, 0.0]], indexes=[0, 0]),
    "lying usage": vectors_answer([[0.6, 0.8], [1.0, 0.0]], usage=-5),
    "halved": vectors_answer([[0.6, 0.8], [1.0, 0.0]]),
    "html": (200, b"<html>busy</html>"),
    "too long": (400, b'{"error": {"message": "This model\'s maximum context length is 2048 tokens.", "code": 400}}'),
    "down": (503, b'{"error": {"message": "engine down"}}'),
}


async def test_an_upstreams_embeddings_are_checked_and_its_errors_typed():
    seen: list[dict] = []
    with serve_app(upstream(ANSWERS, seen)) as url:
        config = OpenAICompatConfig(base_url=url, model="served", max_context=4096, embeddings=True)
        vllm = VLLMBackend(config)
        await vllm.start()
        try:
            assert (await vllm.capabilities()).embeddings
            got = await vllm.embed(EmbedRequest("r", ("good", "x"), cache_salt="salt", dimensions=2))
            assert got.vectors == [[1.0, 0.0], [0.6, 0.8]] and got.prompt_tokens == 7  # in `index` order
            assert seen[-1] == {"model": "served", "encoding_format": "float", "input": ["good", "x"], "dimensions": 2,
                                "cache_salt": "salt"}
            assert (await vllm.embed(EmbedRequest("r", ((1, 2, 3),)))).prompt_tokens == 3
            assert seen[-1]["input"] == [[1, 2, 3]] and "dimensions" not in seen[-1]
            assert (await vllm.embed(EmbedRequest("r", ("lying usage", "x")))).prompt_tokens == 0
            for lie, why in (("short", "1 vectors for 2 inputs"), ("nan", "malformed"), ("ragged", "not all 2"),
                             ("strings", "malformed"), ("twice", "indexes"), ("html", "malformed")):
                with pytest.raises(UpstreamError, match=why):
                    await vllm.embed(EmbedRequest("r", (lie, "x")))
            with pytest.raises(UpstreamError, match="not all 3"):  # it ignored `dimensions`
                await vllm.embed(EmbedRequest("r", ("halved", "x"), dimensions=3))
            with pytest.raises(ContextTooLong):
                await vllm.embed(EmbedRequest("r", ("too long",)))
            with pytest.raises(Overloaded):  # 503: another target may serve it
                await vllm.embed(EmbedRequest("r", ("down",)))
            with pytest.raises(InvalidRequest, match="mixes"):
                await vllm.embed(EmbedRequest("r", ("good", (1, 2))))
        finally:
            await vllm.close()
        plain = OpenAICompatBackend(OpenAICompatConfig(base_url=url, model="served", max_context=4096))
        await plain.start()
        try:
            assert not (await plain.capabilities()).embeddings
            with pytest.raises(InvalidRequest, match="does not serve embeddings"):
                await plain.embed(EmbedRequest("r", ("good",)))
        finally:
            await plain.close()
    with pytest.raises(ValueError, match="Text Embeddings Inference"):
        TGIBackend(OpenAICompatConfig(base_url=url, model="served", embeddings=True))


# -- against the real runtimes (slow) -----------------------------------------------------
SUBJECTS = ["the sea", "gravity", "a city at night", "prime numbers", "bread", "volcanoes", "jazz", "chess",
            "photosynthesis", "the Roman roads"]


def varied_texts() -> list[str]:
    """Fifty texts: words, sentences, questions, code, numbers, other languages and scripts, lists,
    repeated and long passages (up to about 1,500 tokens)."""
    texts = [subject for subject in SUBJECTS[:5]]
    texts += [f"A short note about {s}: it matters more than most people think." for s in SUBJECTS]
    texts += [f"What is the most surprising fact about {s}?" for s in SUBJECTS[:5]]
    texts += ["def add(a, b):\n    return a + b\n", "SELECT name, count(*) FROM users GROUP BY name;",
              "for (int i = 0; i < n; ++i) { sum += v[i]; }", '{"id": 42, "tags": ["a", "b"], "ok": true}',
              "3.14159 2.71828 1.41421 1.61803", "2024-06-01T12:30:00Z", "Le chat dort sur le canapé.",
              "Der schnelle braune Fuchs springt über den faulen Hund.", "El tren sale a las nueve.",
              "東京は日本の首都です。", "Москва — столица России.", "🙂🚀✨ emoji and text", "- eggs\n- milk\n- flour",
              "yes", "No.", "   spaced   out   text   ", "UPPER CASE SHOUTING", "a" * 300]
    texts += [(f"{s.capitalize()} is a subject with a long history. " * (8 * (i + 1))).strip()
              for i, s in enumerate(SUBJECTS)]
    texts += ["The history of the printing press begins with movable type in East Asia. " * 80,
              "\n".join(f"Line {i}: {SUBJECTS[i % 10]}" for i in range(120))]
    assert len(texts) == 50
    return texts


@pytest.mark.slow
def test_the_engines_embeddings_agree_with_vllms_cpu_build(vllm_embed_url, default_model_dir):
    """vLLM's CPU build as an embedding model (`--runner pooling --convert embed`, whose default pooling
    for a decoder is the last token's normalized hidden state) and the engine's default, both in
    float32: each of fifty varied texts' vectors point the same way, and both count the same tokens."""
    texts = varied_texts()

    async def both():
        backend = BuiltinBackend(EngineConfig(model=str(default_model_dir), dtype="float32", max_model_len=2048))
        await backend.start()
        try:
            ours = await backend.embed(EmbedRequest("parity", tuple(texts)))
            counts = [len(backend.tokenizer.encode(t)) for t in texts]
        finally:
            await backend.close()
        async with httpx.AsyncClient(base_url=vllm_embed_url, timeout=600) as client:
            reply = await client.post("/v1/embeddings", json={"model": "smollm2-embed", "input": texts})
        reply.raise_for_status()
        return ours, counts, reply.json()

    ours, counts, theirs = asyncio.run(both())
    assert max(counts) > 1000 and min(counts) < 5
    cosines = [cosine(a, item["embedding"]) for a, item in zip(ours.vectors, theirs["data"], strict=True)]
    worst = min(range(50), key=cosines.__getitem__)
    conftest.REPORTS["embeddings: the engine against vLLM's CPU build (float32, last-token pooling)"] = [
        f"50 texts of {min(counts)} to {max(counts)} tokens: minimum cosine {cosines[worst]:.9f} "
        f"(1 - cosine = {1 - cosines[worst]:.1e}; text {worst}, {counts[worst]} tokens)"]
    assert min(cosines) >= 0.999, [(i, cosines[i]) for i in range(50) if cosines[i] < 0.999]
    assert ours.prompt_tokens == theirs["usage"]["prompt_tokens"] == sum(counts)


@pytest.mark.slow
def test_the_vllm_adapter_embeds_through_a_pooling_server(vllm_embed_url):
    async def scenario():
        backend = VLLMBackend(OpenAICompatConfig(base_url=vllm_embed_url, model="smollm2-embed", embeddings=True))
        await backend.start()
        try:
            got = await backend.embed(EmbedRequest("v1", ("The sea is calm.", "Prime numbers never end."),
                                                   cache_salt="tenant-a"))
            by_ids = await backend.embed(EmbedRequest("v2", ((504, 3143, 314, 7380, 30),)))
            with pytest.raises(InvalidRequest, match="Matryoshka"):
                await backend.embed(EmbedRequest("v3", ("The sea is calm.",), dimensions=64))
            with pytest.raises(ContextTooLong):
                await backend.embed(EmbedRequest("v4", (tuple(ids(3000)),)))
            return got, by_ids, await backend.capabilities()
        finally:
            await backend.close()

    got, by_ids, caps = asyncio.run(scenario())
    assert caps.embeddings and caps.max_context == 2048
    assert len(got.vectors) == 2 and all(len(v) == 576 for v in got.vectors)
    assert all(abs(math.fsum(x * x for x in v) - 1) < 1e-4 for v in got.vectors + by_ids.vectors)
    assert got.prompt_tokens > 6 and by_ids.prompt_tokens == 5


@pytest.mark.slow
def test_llama_server_started_with_embeddings_serves_them_through_its_adapter(make_engine):
    """llama-server with `--embeddings --pooling last` on the default GGUF (its Q4_1 weights, where the
    engine dequantizes them): vectors of unit length, pointing nearly as the engine's; `dimensions`
    refused, as llama-server reads none."""
    from backends import peers
    from backends.default_model import default_model_path
    from backends.launch import free_port, supervised
    from backends.llamacpp import LlamaCppServerBackend, llama_server_config

    provisioned_or_skip(peers.llama_server)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = peers.llama_server_command(default_model_path(), port, "smollm2") + ["--embeddings", "--pooling", "last"]
    texts = ("The sea is calm tonight.", "Prime numbers never end.", "def add(a, b): return a + b")

    async def scenario():
        backend = LlamaCppServerBackend(llama_server_config(url, "smollm2", embeddings=True))
        await backend.start()
        try:
            with pytest.raises(InvalidRequest, match="dimensions"):
                await backend.embed(EmbedRequest("l0", texts, dimensions=64))
            return await backend.embed(EmbedRequest("l1", texts)), await backend.capabilities()
        finally:
            await backend.close()

    with supervised(command, url, "/health", timeout_s=300):
        got, caps = asyncio.run(scenario())
    engine = make_engine()
    ours = engine.embed([engine.tokenizer.encode(t) for t in texts])
    assert caps.embeddings and got.prompt_tokens == sum(len(engine.tokenizer.encode(t)) for t in texts)
    assert all(abs(math.fsum(x * x for x in v) - 1) < 1e-4 for v in got.vectors)
    cosines = [cosine(a, b) for a, b in zip(ours, got.vectors, strict=True)]
    assert min(cosines) > 0.99, cosines  # 0.998 at worst over 40 of the texts above, where measured


@pytest.mark.slow
def test_a_litellm_provider_embeds_and_its_answer_is_checked():
    from backends.providers import ProviderBackend, ProviderConfig

    seen: list[dict] = []
    routes = {"good": vectors_answer([[0.6, 0.8], [1.0, 0.0]]), "ragged": ANSWERS["ragged"],
              "too long": ANSWERS["too long"]}

    async def scenario(url: str):
        provider = ProviderBackend(ProviderConfig(model="openai/some-embedder", api_base=f"{url}/v1",
                                                  api_key="sk-local", embeddings=True))
        await provider.start()
        assert (await provider.capabilities()).embeddings
        got = await provider.embed(EmbedRequest("p", ("good", "x")))
        with pytest.raises(UpstreamError, match="not all 2"):
            await provider.embed(EmbedRequest("p", ("ragged", "x")))
        with pytest.raises(ContextTooLong):
            await provider.embed(EmbedRequest("p", ("too long",)))
        return got

    with serve_app(upstream(routes, seen)) as url:
        got = asyncio.run(scenario(url))
    assert got.vectors == [[0.6, 0.8], [1.0, 0.0]] and got.prompt_tokens == 7
    assert seen[0]["input"] == ["good", "x"] and seen[0]["model"] == "some-embedder"
