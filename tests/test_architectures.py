"""Each family against transformers at fp32, greedy, token for token: single requests, one batch
of all with chunked prefill, and prompts that share a prefix (the cache's blocks reused), on the
native kernels where they serve and on the PyTorch path."""

from __future__ import annotations

import random

import pytest
import torch

from backends.builtin.core.sequence import SamplingParams
from backends.builtin.worker.loader import load_model
from tests.families import build, family_configs

NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def hf_greedy(model, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(NEW_TOKENS):  # no KV cache: the plain full-sequence forward is the reference
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(100, 40000) for _ in range(36)]
    return [[rng.randrange(100, 40000) for _ in range(n)] for n in (5, 19, 41)] + [
        shared + [rng.randrange(100, 40000) for _ in range(n)] for n in (3, 11)]


@pytest.fixture(scope="module", params=sorted(family_configs()))
def family(request, tmp_path_factory, default_model_dir):
    directory = tmp_path_factory.mktemp(request.param)
    model = build(request.param, directory, default_model_dir)
    return request.param, load_model(directory), [hf_greedy(model, p) for p in prompts()]


@pytest.mark.parametrize("attention", ["auto", "torch"])
def test_greedy_tokens_equal_transformers(family, attention, make_engine):
    model_type, loaded, expected = family
    assert loaded.config.architecture == model_type
    # Phi's longrope takes its long factors where the context outruns the original one (as llama.cpp
    # decides, by context; transformers by each sequence's length): a context within it here
    context = {"max_model_len": 64} if model_type == "phi3" else {}
    engine = make_engine(loaded, attention=attention, **context)
    singles = [engine.generate([p], GREEDY)[0][0] for p in prompts()]
    assert singles == expected
    assert engine.kv.hit_tokens >= 32  # the last prompt's shared prefix came from the cache
    chunked = make_engine(loaded, attention=attention, max_num_batched_tokens=16, block_size=8, **context)
    assert [out[0] for out in chunked.generate(prompts(), GREEDY)] == expected
