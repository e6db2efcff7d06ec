"""Each family against transformers at fp32, greedy, token for token: single requests, one batch
of all with chunked prefill, and prompts that share a prefix (the cache's blocks reused), on the
native kernels where they serve and on the PyTorch path; from the Hugging Face checkpoint and from
the GGUF file llama.cpp's converter would write of it."""

from __future__ import annotations

import random

import pytest
import torch

from backends.builtin.core.sequence import SamplingParams
from backends.builtin.worker.loader import load_model
from tests.families import build, family_configs
from tests.gguf_writer import write_gguf

pytestmark = pytest.mark.slow

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


# llama.cpp's converter writes Mistral as a Llama, without its sliding window: its GGUF is not the
# same model (the Llama case covers that architecture's file). A GGUF holds the checkpoint's weights,
# whose PyTorch path is checked already: it runs on the native kernels only.
CASES = [(family, source, attention) for family in sorted(family_configs()) for source, attention in (
    ("safetensors", "auto"), ("safetensors", "torch"), ("gguf", "auto")) if (family, source) != ("mistral", "gguf")]


@pytest.fixture(scope="module")
def models(tmp_path_factory, default_model_dir):
    """(family, source) -> the loaded model and transformers' greedy tokens, each made once."""
    made, references = {}, {}

    def model(model_type: str, source: str):
        if model_type not in references:
            directory = tmp_path_factory.mktemp(model_type)
            reference = build(model_type, directory, default_model_dir)
            references[model_type] = directory, [hf_greedy(reference, p) for p in prompts()]
        directory, expected = references[model_type]
        if (model_type, source) not in made:
            if source == "gguf":
                directory = write_gguf(directory, tmp_path_factory.mktemp("gguf") / f"{model_type}.gguf")
            made[model_type, source] = load_model(directory)
        return made[model_type, source], expected

    return model


@pytest.mark.parametrize(("model_type", "source", "attention"), CASES)
def test_greedy_tokens_equal_transformers(model_type, source, attention, models, make_engine):
    loaded, expected = models(model_type, source)
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
