"""LoRA adapters on vLLM's CPU build through the vLLM backend: the three PEFT adapters of different ranks and
targets, made here, loaded at run time by `load_adapter`, each request's greedy tokens equal to
transformers + PEFT's at float32 (and the base's to transformers'); unloaded, an adapter is not
found; a path without an adapter, or a rank above the server's, is the request's error. Skips,
saying why, where vLLM's environment is not provisioned (`python -m backends.peers vllm`)."""

from __future__ import annotations

import asyncio

import pytest

from backends import peers
from backends.base import Adapter, Delta, GenerateRequest, InvalidRequest, ModelNotFound
from backends.launch import VLLM_RUNTIME_LORA_ENV, free_port, supervised
from backends.openai_compat import OpenAICompatConfig
from backends.vllm import VLLMBackend
from tests.lora_adapters import ADAPTERS, make_adapter, peft_greedy

from .conftest import provisioned_or_skip

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
PROMPTS = [[1, 504, 3158, 8201, 314, 260, 1690, 30], [1, 11, 2887, 1177, 8645, 28, 436, 42, 17, 99, 1000, 5]]
SERVED = tuple(ADAPTERS)  # ranks 8, 16 and 4: attention's q and v, its four projections, the MLP's three
MAX_RANK = 16
# Every adapter and the base in one batch. With three adapters loaded, vLLM 0.32.0's CPU build
# answered the base request in that batch with other tokens than alone (seen here at float32, also
# without the MLP adapter in the batch; with two loaded it did not; the cause is not traced): the
# adapters' requests are checked there, the base's alone.
MIXED = (None, *SERVED)


async def greedy(backend: VLLMBackend, prompt: list[int], adapter: str | None) -> list[int]:
    """The tokens vLLM sampled, read from its log-probabilities as token ids; EOS kept out of them, as
    the reference's `min_new_tokens` keeps it (vLLM's `min_tokens` masks it likewise)."""
    request = GenerateRequest(request_id="lora", prompt_token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                              ignore_eos=True, adapter=adapter,
                              extra={"logprobs": 0, "return_tokens_as_token_ids": True, "min_tokens": MAX_TOKENS})
    tokens = []
    async for event in backend.generate(request):
        if isinstance(event, Delta) and event.extra:
            tokens += [int(t.removeprefix("token_id:")) for t in event.extra["logprobs"]["tokens"]]
    return tokens


def test_adapters_loaded_at_run_time_answer_as_peft_does(default_model_dir, tmp_path):
    provisioned_or_skip(peers.vllm_python)
    dirs = {name: str(make_adapter(default_model_dir, tmp_path / name, *ADAPTERS[name])) for name in SERVED}
    wide = str(make_adapter(default_model_dir, tmp_path / "wide", 2 * MAX_RANK, ["q_proj"], 4))
    expected = {name: [peft_greedy(default_model_dir, dirs.get(name), p, MAX_TOKENS) for p in PROMPTS]
                for name in (None, *SERVED)}
    assert all(expected[name] != expected[None] for name in SERVED)  # the check can fail

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    flags = ["--enable-lora", "--max-loras", str(len(SERVED)), "--max-lora-rank", str(MAX_RANK)]
    command = peers.vllm_command(default_model_dir, port, "smollm2", dtype="float32", extra=flags)

    async def scenario():
        backend = VLLMBackend(OpenAICompatConfig(base_url=url, model="smollm2", max_loras=len(SERVED),
                                                 max_lora_rank=MAX_RANK))
        await backend.start()
        try:
            for name in SERVED:
                await backend.load_adapter(Adapter(name, dirs[name]))
            await backend.load_adapter(Adapter("sql", dirs["sql"]))  # loaded already: nothing happens
            caps = await backend.capabilities()
            answers = {name: list(await asyncio.gather(*(greedy(backend, p, name) for p in PROMPTS)))
                       for name in (None, *SERVED)}
            mixed = await asyncio.gather(*(greedy(backend, PROMPTS[0], name) for name in MIXED))
            with pytest.raises(InvalidRequest, match=str(tmp_path / "none")):
                await backend.load_adapter(Adapter("none", str(tmp_path / "none")))
            with pytest.raises(InvalidRequest, match=f"rank {2 * MAX_RANK}"):
                await backend.load_adapter(Adapter("wide", wide))
            await backend.unload_adapter("sql")
            with pytest.raises(ModelNotFound):
                await greedy(backend, PROMPTS[0], "sql")
            with pytest.raises(ModelNotFound):
                await backend.unload_adapter("sql")
            return caps, answers, mixed, await backend.capabilities()
        finally:
            await backend.close()

    with supervised(command, url, "/health", peers.vllm_env() | VLLM_RUNTIME_LORA_ENV, 900):
        caps, answers, mixed, after = asyncio.run(scenario())
    assert caps.adapters == set(SERVED) and (caps.max_loras, caps.max_lora_rank) == (len(SERVED), MAX_RANK)
    assert answers == expected
    assert mixed[1:] == [expected[name][0] for name in MIXED[1:]]  # each adapter beside the base and the others
    assert after.adapters == set(SERVED) - {"sql"}
