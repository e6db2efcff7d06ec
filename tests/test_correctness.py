"""The engine against the baseline: Hugging Face transformers on the same GGUF, fp32, greedy."""

from __future__ import annotations

import pytest
import torch

from backends.builtin.core.sequence import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
             "Explain gravity to a child in one paragraph."]
LOGIT_TOLERANCE = 2e-3  # max |engine - transformers| over the vocabulary, fp32 (measured ~1e-4)


@pytest.fixture(scope="module")
def prompts(default_model):
    tok = default_model.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               tokenize=False), add_special_tokens=False) for q in QUESTIONS]


def hf_greedy(hf_model, prompt: list[int], max_new: int = 24) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def expected(hf_model, prompts):
    return [hf_greedy(hf_model, p) for p in prompts]


def test_single_requests_match(make_engine, prompts, expected):
    engine = make_engine()
    for prompt, want in zip(prompts, expected):
        assert engine.generate([prompt], GREEDY)[0][0] == want


def test_batched_requests_match(make_engine, prompts, expected):
    engine = make_engine()
    outputs = engine.generate(prompts, GREEDY)
    assert [o[0] for o in outputs] == expected


def test_chunked_prefill_matches(make_engine, prompts, expected):
    engine = make_engine(max_num_batched_tokens=16)  # every prompt (~40 tokens) is split in chunks
    outputs = engine.generate(prompts, GREEDY)
    assert [o[0] for o in outputs] == expected
    assert engine.steps > 24 + max(len(p) for p in prompts) // 16


def test_prefix_cache_hits_match(make_engine, default_model, hf_model):
    tok = default_model.tokenizer
    system = "You are a careful assistant. " * 12
    prompts = [tok.encode(tok.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": q}],
        add_generation_prompt=True, tokenize=False), add_special_tokens=False) for q in QUESTIONS[:2]]
    engine = make_engine()
    first = engine.generate([prompts[0]], GREEDY)[0][0]
    computed_before = engine.computed_prompt_tokens
    second = engine.generate([prompts[1]], GREEDY)[0][0]
    assert engine.kv.hit_tokens >= 16 * 4  # the shared system prompt came from the cache
    assert engine.computed_prompt_tokens - computed_before == len(prompts[1]) - engine.kv.hit_tokens
    assert [first, second] == [hf_greedy(hf_model, p) for p in prompts]


def test_teacher_forced_logits_match(make_engine, prompts, expected, hf_model):
    engine = make_engine()
    seen: list[torch.Tensor] = []
    run = engine.runner.run

    def recording_run(batch):
        done, logits, pooled = run(batch)
        seen.append(logits[0])
        return done, logits, pooled

    engine.runner.run = recording_run
    prompt = prompts[3]
    out = engine.generate([prompt], GREEDY)[0][0]
    assert out == expected[3]
    full = torch.tensor([prompt + out[:-1]])
    with torch.inference_mode():
        reference = hf_model(full).logits[0, len(prompt) - 1 :]
    ours = torch.stack(seen)
    assert ours.shape == reference.shape
    assert (ours - reference).abs().max().item() < LOGIT_TOLERANCE
