"""LoRA adapters on the built-in engine: greedy outputs token for token those of transformers + PEFT
at float32, one adapter at a time and mixed in one batch with the base; the prefix cache kept apart
per adapter; slots bounded; adapters loaded and unloaded at run time."""

from __future__ import annotations

import asyncio

import pytest

from backends.base import Adapter, GenerateRequest, InvalidRequest, ModelNotFound
from backends.builtin.backend import BuiltinBackend
from backends.builtin.config import EngineConfig
from backends.builtin.protocol import SamplingParams
from tests.lora_adapters import ADAPTERS, make_adapter, peft_greedy

PROMPTS = [[1, 504, 3158, 8201, 314, 260, 1690, 30], [1, 11, 2887, 1177, 8645, 28, 436, 42, 17, 99, 1000, 5]]
MAX_TOKENS = 12
# EOS masked until the last token, as transformers' `min_new_tokens` masks it in the reference
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, min_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    """Three adapters of different ranks and targets (see ADAPTERS), name -> PEFT directory."""
    root = tmp_path_factory.mktemp("adapters")
    return {name: str(make_adapter(tiny_model_dir, root / name, rank, targets, seed))
            for name, (rank, targets, seed) in ADAPTERS.items()}


@pytest.fixture(scope="module")
def expected(tiny_model_dir, adapters) -> dict[str | None, list[list[int]]]:
    """transformers + PEFT's greedy tokens per adapter (None: the base), per prompt."""
    return {name: [peft_greedy(tiny_model_dir, adapters.get(name), prompt, MAX_TOKENS) for prompt in PROMPTS]
            for name in [None, *adapters]}


def run(engine, requests: list[tuple[str | None, list[int]]]) -> list[list[int]]:
    """Every request added before the first step, so they share batches."""
    for i, (adapter, prompt) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, GREEDY, adapter=adapter)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(requests))}
    while engine.has_work:
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
    return [tokens[f"r{i}"] for i in range(len(requests))]


def test_adapters_change_the_output(expected):
    """The check below can fail: each adapter's greedy output differs from the base's."""
    for name in ADAPTERS:
        assert expected[name] != expected[None], name


@pytest.mark.parametrize("attention", ["auto", "torch"])  # the native gather-matmul, and PyTorch's per adapter
def test_each_adapter_alone_and_all_mixed_with_the_base_match_peft(make_engine, tiny_model, adapters, expected,
                                                                    attention):
    engine = make_engine(tiny_model, dtype="float32", attention=attention, max_lora_rank=16,
                         lora=[f"{name}={path}" for name, path in adapters.items()])
    for name in ADAPTERS:
        assert run(engine, [(name, prompt) for prompt in PROMPTS]) == expected[name], name
    mixed = [(name, prompt) for prompt in PROMPTS for name in [None, *ADAPTERS]]
    assert run(engine, mixed) == [expected[name][PROMPTS.index(prompt)] for name, prompt in mixed]


def test_fewer_slots_than_adapters_serve_every_request_and_count_loads(make_engine, tiny_model, adapters,
                                                                       expected):
    engine = make_engine(tiny_model, dtype="float32", max_loras=2, max_lora_rank=16,
                         lora=[f"{name}={path}" for name, path in adapters.items()])
    seen = []
    original = engine.runner.lora.set_step

    def watched(adapter_ids, *args):
        seen.append(set(adapter_ids) - {0})
        return original(adapter_ids, *args)

    engine.runner.lora.set_step = watched
    mixed = [(name, PROMPTS[0]) for name in ADAPTERS]
    assert run(engine, mixed) == [expected[name][0] for name in ADAPTERS]
    assert max(map(len, seen)) == 2  # never more adapters in a step than slots
    assert engine.stats()["lora_slot_loads_total"] == 3
    assert len(engine.resident_adapters()) == 2


def test_a_gguf_lora_written_by_llama_cpps_converter_serves_as_its_peft_directory(make_engine, tiny_model,
                                                                                  tiny_model_dir, adapters, expected,
                                                                                  tmp_path):
    """llama.cpp's own `convert_lora_to_gguf.py` (Q and K in its interleaved-RoPE row order, alpha in
    the file's metadata) turns the PEFT adapter into a GGUF file; the engine serves it token for token
    as PEFT serves the directory."""
    import subprocess
    import sys

    from backends import peers

    from .conftest import provisioned_or_skip

    converter = provisioned_or_skip(peers.lora_converter)
    gguf = tmp_path / "chat.gguf"
    subprocess.run([sys.executable, str(converter), adapters["chat"], "--base", str(tiny_model_dir), "--outfile",
                    str(gguf), "--outtype", "f32"], check=True, capture_output=True)
    engine = make_engine(tiny_model, dtype="float32", max_lora_rank=16, lora=[f"chat={gguf}"])
    assert run(engine, [("chat", prompt) for prompt in PROMPTS]) == expected["chat"]


def test_the_prefix_cache_is_kept_apart_per_adapter(make_engine, tiny_model, adapters):
    engine = make_engine(tiny_model, dtype="float32", max_lora_rank=16,
                         lora=[f"{name}={path}" for name, path in adapters.items()])
    prompt = list(range(100, 180))  # five full blocks
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def cached(adapter):
        engine.add_request(f"c{len(engine.adapters)}-{adapter}-{engine.steps}", prompt, params, adapter=adapter)
        hits = 0
        while engine.has_work:
            hits = max([hits, *(out.num_cached_tokens for out in engine.step())])
        return hits

    assert cached("sql") == 0
    assert cached("sql") == 64  # the adapter's own prefix
    assert cached("chat") == 0 and cached(None) == 0  # not another adapter's, nor the base's


def test_bad_adapters_are_refused_by_name(make_engine, tiny_model, adapters, tiny_model_dir, tmp_path):
    engine = make_engine(tiny_model, dtype="float32", enable_lora=True, max_lora_rank=8)
    with pytest.raises(ValueError, match="rank 16 .* exceeds max_lora_rank 8"):
        engine.add_adapter("chat", adapters["chat"])
    with pytest.raises(ValueError, match="no adapter_config.json"):
        engine.add_adapter("nothing", str(tmp_path))
    with pytest.raises(ValueError, match="not loaded"):
        engine.add_request("x", PROMPTS[0], GREEDY, adapter="chat")
    plain = make_engine(tiny_model, dtype="float32")
    with pytest.raises(ValueError, match="enable_lora"):
        plain.add_adapter("sql", adapters["sql"])


async def test_adapters_load_and_unload_at_run_time_in_the_engine_process(tiny_model_dir, adapters, expected):
    backend = BuiltinBackend(EngineConfig(model=str(tiny_model_dir), dtype="float32", enable_lora=True,
                                          max_lora_rank=16), name="lora")
    await backend.start()
    try:
        async def greedy(adapter: str | None) -> list[int]:
            request = GenerateRequest(request_id=f"g-{adapter}-{asyncio.get_running_loop().time()}",
                                      prompt_token_ids=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0,
                                      extra={"min_tokens": MAX_TOKENS}, adapter=adapter)
            return [token async for event in backend.generate(request) for token in getattr(event, "token_ids", ())]

        with pytest.raises(ModelNotFound):
            await greedy("sql")
        await backend.load_adapter(Adapter("sql", adapters["sql"]))
        assert (await backend.capabilities()).adapters == {"sql"}
        assert await greedy("sql") == expected["sql"][0]
        assert (await backend.load()).resident_adapters == {"sql"}
        with pytest.raises(InvalidRequest, match="no adapter_config.json"):
            await backend.load_adapter(Adapter("bad", str(tiny_model_dir)))
        await backend.unload_adapter("sql")
        with pytest.raises(ModelNotFound):
            await greedy("sql")
        assert await greedy(None) == expected[None][0]
    finally:
        await backend.close()


async def test_the_gateway_serves_the_engines_adapters_to_the_openai_client_and_bills_them(
        tiny_model_dir, adapters, expected, tmp_path):
    """`servegate serve --lora sql=...`: `/v1/models` lists `sql` under its base for every tenant,
    as vLLM's --lora-modules does; a tenant's own adapter, registered at run time, is loaded onto
    the engine on first use, serves its greedy tokens, is missing for another tenant exactly as an
    unknown model, and its usage is counted per adapter."""
    import openai

    from .conftest import AUTH
    from .test_adapters import running, tenant

    engine = BuiltinBackend(EngineConfig(model=str(tiny_model_dir), dtype="float32", served_name="tiny",
                                         max_lora_rank=16, lora=[f"sql={adapters['sql']}"], engine_process=False),
                            name="engine")
    async with running({"tiny": engine}, tmp_path, usage_flush_s=0.1) as client:
        acme, other = await tenant(client, "acme"), await tenant(client, "other")
        registered = await client.post("/admin/adapters", json={
            "name": "acme-chat", "base": "tiny", "path": adapters["chat"], "owner": "acme"}, headers=AUTH)
        assert registered.status_code == 201, registered.text

        def sdk(headers):
            return openai.AsyncOpenAI(base_url="http://gateway/v1", api_key=headers["Authorization"].split()[1],
                                      http_client=client)

        models = {m.id: m for m in (await sdk(acme).models.list()).data}
        assert models["sql"].parent == "tiny" and models["acme-chat"].parent == "tiny"
        assert "acme-chat" not in {m.id for m in (await sdk(other).models.list()).data}

        async def greedy(headers, model):
            return await sdk(headers).completions.create(model=model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                                         temperature=0, extra_body={"min_tokens": MAX_TOKENS})

        for model, name in (("sql", "sql"), ("acme-chat", "chat"), ("tiny", None)):
            reply = await greedy(acme, model)
            assert reply.model == model
            assert reply.choices[0].text == engine.tokenizer.decode(expected[name][0])
        with pytest.raises(openai.NotFoundError) as missing:
            await greedy(other, "acme-chat")
        with pytest.raises(openai.NotFoundError) as unknown:
            await greedy(other, "no-such-model")
        assert missing.value.body["message"].replace("acme-chat", "X") == \
            unknown.value.body["message"].replace("no-such-model", "X")

        client.gateway.ledger.flush()
        records = (await client.get("/admin/usage", params={"tenant": "acme"}, headers=AUTH)).json()["records"]
        assert sorted(str(r["adapter"]) for r in records) == ["None", "acme-chat", "sql"]
