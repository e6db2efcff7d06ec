"""Scheduling, caching, preemption and sampling behaviour of the engine (tiny float64 model)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.builtin.core.sequence import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def run(engine, prompts, params=GREEDY):
    return [o[0] for o in engine.generate(prompts, params)]


def shared_prefix_prompts(prefix_len: int, suffixes: list[list[int]]) -> list[list[int]]:
    prefix = [(7 * i) % 40000 + 100 for i in range(prefix_len)]
    return [prefix + s for s in suffixes]


def test_shared_1000_token_prefix_computes_only_the_suffix(make_engine, tiny_model):
    engine = make_engine(tiny_model, dtype="float64")
    a, b = shared_prefix_prompts(1000, [[5, 6, 7], [8, 9, 10, 11]])
    run(engine, [a])
    before = engine.computed_prompt_tokens
    run(engine, [b])
    hit = engine.kv.hit_tokens
    assert hit == 992  # 62 full blocks of the shared 1,000 tokens
    assert engine.computed_prompt_tokens - before == len(b) - hit == 12


def test_requests_sharing_a_prefix_in_one_step_compute_it_once(make_engine, tiny_model):
    """Admitted together, the second request hits the blocks the first computes in the same step
    (a layer writes every new token's K/V before its attention reads), as vLLM's scheduler does;
    before, each computed the whole prefix."""
    engine = make_engine(tiny_model, dtype="float64", max_num_batched_tokens=4096)
    a, b = shared_prefix_prompts(1000, [[5, 6, 7], [8, 9, 10, 11]])
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    got = [o[0] for o in engine.generate([a, b], params)]
    assert engine.steps and engine.kv.hit_tokens == 992
    assert engine.computed_prompt_tokens == len(a) + len(b) - 992
    reference = make_engine(tiny_model, dtype="float64", enable_prefix_caching=False)
    assert got == [o[0] for o in reference.generate([a, b], params)]


def test_a_burst_is_admitted_cheapest_first_and_later_arrivals_queue_behind(make_engine, tiny_model):
    """Requests that arrive together join the queue by tokens left to compute after prefix hits;
    the ones on a cached prefix take their first token from a step of their own, the cold prompt
    (longer than long_prefill_tokens) starts in the next; one that arrives later queues behind it,
    however cheap."""
    engine = make_engine(tiny_model, dtype="float64", max_num_batched_tokens=512, long_prefill_tokens=64)
    warm = shared_prefix_prompts(200, [[5], [6], [7], [8]])
    run(engine, warm[:1])
    cold = [(11 * i) % 40000 + 300 for i in range(600)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    outputs: dict[str, list[int]] = {}

    def step():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.token_ids)
        return {s.request_id: s for s in engine.scheduler.running}

    engine.add_request("cold", cold, params)
    engine.add_request("warm0", warm[1], params)
    engine.add_request("warm1", warm[2], params)
    assert "cold" not in step()  # budget was left, but not for a long prompt behind short ones
    assert len(outputs["warm0"]) == len(outputs["warm1"]) == 1
    engine.add_request("late", warm[3], params)
    seqs = step()
    assert 0 < seqs["cold"].num_computed_tokens < len(cold) and "late" not in seqs  # the budget went to cold
    while engine.has_work:
        step()
    reference = make_engine(tiny_model, dtype="float64", enable_prefix_caching=False)
    want = run(reference, [cold, *warm[1:]], params)
    assert [outputs[r] for r in ("cold", "warm0", "warm1", "late")] == want


def test_a_failed_step_forgets_the_prefixes_it_registered(make_engine, tiny_model):
    engine = make_engine(tiny_model, dtype="float64")
    a, = shared_prefix_prompts(100, [[1]])
    engine.add_request("r", a, SamplingParams(max_tokens=2, temperature=0.0))

    def broken(batch):
        raise RuntimeError("boom")

    engine.runner.run = broken
    with pytest.raises(RuntimeError):
        engine.step()
    assert engine.kv.num_cached == 0  # its blocks were never written: nothing may hit them
    engine.abort("r")  # as the engine's front does for the requests of a failed step


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 40), st.integers(1, 10)), min_size=1, max_size=6),
    num_blocks=st.integers(8, 24),
    budget=st.sampled_from([8, 32, 256]),
)
def test_cache_and_eviction_never_change_outputs(make_engine, tiny_model, data, num_blocks, budget):
    """Random mixes of requests sharing prefixes, on a KV cache small enough to evict and preempt:
    outputs equal those of an unconstrained engine without prefix caching."""
    prefixes = [[(31 * g + i) % 49000 + 50 for i in range(16 * (g + 1))] for g in range(4)]
    prompts = [prefixes[g][: 16 * (g + 1)] + [1000 + k for k in range(extra)] for g, extra, _ in data]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, _, m in data]
    reference = make_engine(tiny_model, dtype="float64", enable_prefix_caching=False)
    want = [o[0] for o in reference.generate(prompts, params)]
    # Enough blocks for the longest request alone, not for all at once.
    need = max(-(-(len(p) + m) // 16) for p, (_, _, m) in zip(prompts, data))
    engine = make_engine(tiny_model, dtype="float64", num_kv_blocks=max(num_blocks, need),
                         max_num_batched_tokens=budget)
    for _ in range(2):  # the second round hits what the first cached
        assert [o[0] for o in engine.generate(prompts, params)] == want


@pytest.mark.slow
def test_preemption_keeps_outputs_identical(make_engine, tiny_model):
    prompts = [[100 + 13 * i + j for j in range(40)] for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = run(make_engine(tiny_model, dtype="float64"), prompts, params)
    small = make_engine(tiny_model, dtype="float64", num_kv_blocks=12)  # 6 requests need 30 blocks
    assert run(small, prompts, params) == want
    assert small.scheduler.num_preemptions > 0
    assert all(len(o) == 40 for o in want)


@pytest.mark.slow
def test_native_and_pytorch_attention_give_the_same_tokens(make_engine, default_model):
    tok = default_model.tokenizer
    prompts = [tok.encode(f"Story {i}: once upon a time") for i in range(5)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    native = make_engine(attention="native")
    assert native.runner.use_kernel
    assert run(native, prompts, params) == run(make_engine(attention="torch"), prompts, params)


@pytest.mark.slow
def test_native_layer_ops_give_the_pytorch_paths_next_tokens_in_bf16(make_engine, default_model):
    """The model wired with the fused ops predicts what it predicts without them (the ops differ
    from PyTorch's by at most a bf16 ulp, rarely: later tokens of a near tie may part ways)."""
    tok = default_model.tokenizer
    prompts = [tok.encode(f"Recipe {i}: first, take") for i in range(4)] + [tok.encode("A long one. " * 150)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine = make_engine(dtype="bfloat16", attention="native", enable_prefix_caching=False)
    assert engine.runner.model.ops is not None
    fused = run(engine, prompts, params)
    engine.runner.model.ops = None
    assert run(engine, prompts, params) == fused


@pytest.mark.slow
def test_int8_weights_keep_a_simple_answer(make_engine, default_model):
    tok = default_model.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    quantized = make_engine(weight_quant="int8")
    assert isinstance(quantized.runner.model.lm_head, torch.ao.nn.quantized.dynamic.Linear)
    assert run(quantized, [prompt], params) == run(make_engine(), [prompt], params)


@pytest.mark.slow
def test_preemption_on_real_model_matches(make_engine, default_model):
    tok = default_model.tokenizer
    prompts = [tok.encode(f"Count from {i} to {i + 30}:") for i in range(4)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    want = run(make_engine(), prompts, params)
    small = make_engine(num_kv_blocks=8)
    assert run(small, prompts, params) == want and small.scheduler.num_preemptions > 0


@pytest.mark.slow
def test_seeded_sampling_is_reproducible_whatever_the_batch(make_engine, tiny_model):
    engine = make_engine(tiny_model, dtype="float64")
    prompt = [500 + i for i in range(20)]
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = run(engine, [prompt], seeded)[0]
    others = [[900 + i * 3 for i in range(n)] for n in (5, 33, 12)]
    unseeded = SamplingParams(max_tokens=16, temperature=0.8, ignore_eos=True)
    mixed = engine.generate([*others, prompt], [unseeded] * 3 + [seeded])
    assert mixed[3][0] == alone
    reseeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=99, ignore_eos=True)
    assert run(engine, [prompt], reseeded)[0] != alone


def test_n_choices_fork_and_copy_on_write(make_engine, tiny_model):
    engine = make_engine(tiny_model, dtype="float64")
    prompt = [200 + i for i in range(21)]  # 1 full block + a partial one, shared by the forks
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7, n=3, ignore_eos=True)
    out = engine.generate([prompt], params)[0]
    assert sorted(out) == [0, 1, 2] and all(len(t) == 8 for t in out.values())
    assert len({tuple(t) for t in out.values()}) == 3
    assert engine.computed_prompt_tokens == 21  # the prompt ran once for all three choices
    # Each choice equals what a single seeded request with that choice's seed produces.
    for i, tokens in out.items():
        single = SamplingParams(max_tokens=8, temperature=1.0, seed=7 + i, ignore_eos=True)
        assert run(engine, [prompt], single)[0] == tokens


def test_top_k_one_equals_greedy(make_engine, tiny_model):
    engine = make_engine(tiny_model, dtype="float64")
    prompt = [300 + i for i in range(10)]
    sampled = run(engine, [prompt], SamplingParams(max_tokens=10, temperature=0.7, top_k=1, ignore_eos=True))
    assert sampled == run(engine, [prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))


@pytest.mark.slow
def test_stop_strings_and_stop_tokens(make_engine, default_model):
    engine = make_engine()
    tok = default_model.tokenizer
    prompt = tok.encode("1, 2, 3, 4, 5,")
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    full_ids = run(engine, [prompt], params)[0]
    full = tok.decode(full_ids, skip_special_tokens=True)
    stop = full[4:7]
    engine.add_request("r", prompt, params, stop=[stop])
    texts, reasons = [], []
    while engine.has_work:
        for out in engine.step():
            texts.append(out.text)
            reasons.append(out.finish_reason)
    assert "".join(texts) == full[: full.index(stop)] and reasons[-1] == "stop"
    cut = run(engine, [prompt], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=(full_ids[3],)))[0]
    assert cut == full_ids[: full_ids.index(full_ids[3]) + 1]


def test_stats_count_live_tokens_once_per_block(make_engine, tiny_model):
    engine = make_engine(tiny_model, dtype="float64")
    params = SamplingParams(max_tokens=2, temperature=1.0, seed=1, n=2, ignore_eos=True)
    engine.add_request("r", [400 + i for i in range(20)], params)  # 2 blocks, shared by the forks
    engine.step()
    stats = engine.stats()
    assert stats["running"] == 2 and stats["kv_blocks_used"] == 2
    assert stats["kv_live_token_fraction"] == 20 / 32
    assert stats["admitted_requests_total"] == 1 and 0 < stats["queue_delay_seconds_total"] < 5  # waited a step
    while engine.has_work:
        engine.step()
    assert engine.stats()["kv_blocks_used"] == 0


@pytest.mark.slow
def test_abort_frees_blocks_at_the_next_step(make_engine):
    engine = make_engine()
    engine.add_request("a", list(range(100, 180)), SamplingParams(max_tokens=50, temperature=0.0))
    engine.add_request("b", list(range(200, 240)), SamplingParams(max_tokens=5, temperature=0.0))
    engine.step()
    assert engine.kv.num_used > 0
    engine.abort("a")
    assert all(s.request_id != "a" for s in engine.scheduler.running)
    while engine.has_work:
        engine.step()


async def test_a_burst_arriving_over_a_few_milliseconds_shares_one_first_step(make_engine, tiny_model, monkeypatch):
    """The loop keeps taking arrivals until none has come for ARRIVAL_GAP_S: a request that comes
    within the gap joins the first one's step instead of waiting a whole step behind it; one that
    comes after the gap does not wait for it (the gap widened here so that a loaded machine's
    scheduling cannot decide the test)."""
    import asyncio

    from backends.builtin.core import loop
    from backends.builtin.front import EngineThread

    monkeypatch.setattr(loop, "ARRIVAL_GAP_S", 0.5)
    monkeypatch.setattr(loop, "ARRIVAL_WAIT_S", 2.0)
    engine = make_engine(tiny_model, dtype="float64")
    front = EngineThread(engine)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    async def first_token(request_id: str, delay: float) -> None:
        await asyncio.sleep(delay)
        [out async for out in front.stream(request_id, [300, 301, 302], params)]

    try:
        await asyncio.gather(first_token("a", 0.0), first_token("b", 0.05))
        assert engine.steps == 1  # both prompts in one step, each its one token
        await asyncio.gather(first_token("c", 0.0), first_token("d", 1.5))  # past the gap: a step each
        assert engine.steps == 3
    finally:
        front.shutdown()


async def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(make_engine, tiny_model):
    from backends.base import UpstreamError
    from backends.builtin.front import EngineThread

    engine = make_engine(tiny_model, dtype="float64")
    run = engine.runner.run

    def broken_once(batch):
        engine.runner.run = run
        raise RuntimeError("simulated kernel failure")

    engine.runner.run = broken_once
    front = EngineThread(engine)
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        try:
            [out async for out in front.stream("doomed", [300, 301, 302], params)]
            raise AssertionError("the failed step was not reported")
        except UpstreamError as exc:
            assert "simulated kernel failure" in exc.message
        outputs = [out async for out in front.stream("fine", [300, 301, 302], params)]
        assert len(outputs) == 4 and outputs[-1].finish_reason == "length"
    finally:
        front.shutdown()


@pytest.mark.slow
def test_the_engine_core_in_its_own_process_serves_aborts_and_fails_cleanly(tiny_model_dir):
    """`engine_process` (the default): the same greedy text as the engine on a thread; an abandoned
    stream is aborted in the core; a core that dies fails the open stream and reports DOWN."""
    import asyncio

    from backends.base import Delta, GenerateRequest, Health, UpstreamError
    from backends.builtin import BuiltinBackend, EngineConfig

    def config(process: bool) -> EngineConfig:
        return EngineConfig(model=str(tiny_model_dir), dtype="float64", kv_cache_tokens=2048, engine_process=process)

    async def text(backend, request_id: str, **fields) -> str:
        request = GenerateRequest(request_id=request_id, model="m", prompt="Count with me:", temperature=0.0, **fields)
        return "".join([e.text async for e in backend.generate(request) if isinstance(e, Delta)])

    async def scenario():
        threaded, process = BuiltinBackend(config(False)), BuiltinBackend(config(True))
        await asyncio.gather(threaded.start(), process.start())
        try:
            assert process.engine is None and process.info.vocab_size == threaded.info.vocab_size
            assert await text(process, "a", max_tokens=8) == await text(threaded, "a", max_tokens=8)
            stream = process.generate(GenerateRequest(request_id="b", model="m", prompt="Count with me:",
                                                      max_tokens=200, temperature=0.0, ignore_eos=True))
            await anext(stream)
            await stream.aclose()  # the client left
            for _ in range(100):
                if (await process.load()).running == 0:
                    break
                await asyncio.sleep(0.05)
            assert (await process.load()).running == 0
            stream = process.generate(GenerateRequest(request_id="c", model="m", prompt="Count with me:",
                                                      max_tokens=500, temperature=0.0, ignore_eos=True))
            await anext(stream)
            process._front._process.kill()
            with pytest.raises(UpstreamError, match="engine process exited"):
                async for _ in stream:
                    pass
            assert await process.health() is Health.DOWN
        finally:
            await asyncio.gather(threaded.close(), process.close())

    asyncio.run(scenario())


@pytest.mark.slow
def test_an_engine_process_that_cannot_load_says_why(tmp_path):
    import asyncio

    from backends.builtin import BuiltinBackend, EngineConfig

    missing = tmp_path / "nothing.gguf"
    backend = BuiltinBackend(EngineConfig(model=str(missing), engine_process=True))
    with pytest.raises(FileNotFoundError, match="model not found"):
        asyncio.run(backend.start())
