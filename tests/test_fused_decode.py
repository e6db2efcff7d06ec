"""A decode step's layers in one native call (`models/fused.py`, `csrc/decode_layers.cpp`)
against the layers' own path: two engines on the same weights, one with it and one without, serve
the same requests (prompts of 1 to 3 blocks, one arriving mid-way so that a step mixes a prompt
with decode tokens) and every step's logits must be equal, bit for bit. The call serves Llama-shaped
layers on native projections (GGUF blocks as stored, with biases or without; bf16 pairs); other
models keep the layers' own path."""

from __future__ import annotations

import pytest
import torch

from backends.builtin.core.sequence import SamplingParams
from backends.builtin.worker.loader import load_model
from backends.builtin.worker.model_runner import PairedLinear
from tests.gguf_writer import write_gguf


class Counting:
    """A FusedDecode that counts the steps it computed."""

    def __init__(self, fused) -> None:
        self.fused, self.calls = fused, 0

    def serves(self, meta, kv_caches) -> bool:
        return self.fused.serves(meta, kv_caches)

    def __call__(self, *args):
        self.calls += 1
        return self.fused(*args)


def served_logits(engine) -> list[torch.Tensor]:
    """Every step's logits while the engine serves 3 prompts, then a 4th arriving after 3 steps."""
    seen: list[torch.Tensor] = []
    run = engine.runner.run

    def recording(batch):
        done, logits, pooled = run(batch)
        seen.append(logits.clone())
        return done, logits, pooled

    engine.runner.run = recording
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for i, length in enumerate((5, 40, 130)):
        engine.add_request(f"r{i}", [(i * 31 + j * 7) % 40000 + 100 for j in range(length)], params)
    for _ in range(3):
        engine.step()
    engine.add_request("late", [(j * 13) % 40000 + 100 for j in range(24)], params)
    while engine.has_work:
        engine.step()
    engine.runner.run = run
    return seen


def assert_fused_equals_layers(make_engine, loaded=None, **config):
    """The engine whose decode steps ran in one call (its logits equal to the other's), once checked."""
    fused, layered = make_engine(loaded, **config), make_engine(loaded, **config)
    assert fused.runner.model.fused_decode is not None
    fused.runner.model.fused_decode = counting = Counting(fused.runner.model.fused_decode)
    layered.runner.model.fused_decode = None
    ours, reference = served_logits(fused), served_logits(layered)
    assert len(ours) == len(reference) > 10
    for step, (a, b) in enumerate(zip(ours, reference)):
        assert torch.equal(a, b), f"step {step}: logits differ by up to {(a - b).abs().max().item()}"
    assert counting.calls >= 6  # the steps of decode tokens only
    return fused


@pytest.fixture(scope="module")
def stored_default():
    """The default model with its GGUF blocks as stored (the engine's default)."""
    return load_model(quantized=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_default_models_blocks_decode_in_one_call(make_engine, stored_default, dtype):
    assert_fused_equals_layers(make_engine, stored_default, dtype=dtype)


def test_speculations_rows_decode_in_one_call(make_engine, stored_default):
    fused = assert_fused_equals_layers(make_engine, stored_default, num_speculative_tokens=3)
    assert fused.stats()["spec_decode_draft_tokens_total"] > 0  # rows verifying drafts were among its steps


def test_biased_projections_decode_in_one_call(make_engine, default_model_dir, tmp_path):
    from tests.families import build

    build("qwen2", tmp_path / "hf", default_model_dir)  # q/k/v biases, tied embeddings
    loaded = load_model(write_gguf(tmp_path / "hf", tmp_path / "qwen2-Q8_0.gguf", "Q8_0"), quantized=True)
    assert_fused_equals_layers(make_engine, loaded)


def test_bf16_pairs_decode_in_one_call_where_the_native_bf16_gemm_serves(make_engine):
    engine = make_engine(dtype="bfloat16", gguf_weights="dequantized")
    paired = isinstance(engine.runner.model.lm_head, PairedLinear)  # AVX512-BF16 without AMX
    assert (engine.runner.model.fused_decode is not None) == paired
    if paired:
        assert_fused_equals_layers(make_engine, dtype="bfloat16", gguf_weights="dequantized")


def test_other_layers_keep_their_own_path(make_engine, stored_default, default_model_dir, tmp_path):
    from tests.families import build

    # LoRA wraps the projections it adapts
    assert make_engine(stored_default, enable_lora=True).runner.model.fused_decode is None
    int8 = make_engine(stored_default, kv_cache_dtype="int8")  # the call writes no int8 cache
    int8.runner.model.fused_decode = counting = Counting(int8.runner.model.fused_decode)
    assert len(served_logits(int8)) > 10 and counting.calls == 0
    build("qwen3", tmp_path / "hf", default_model_dir)  # q/k norms
    qwen3 = make_engine(load_model(write_gguf(tmp_path / "hf", tmp_path / "qwen3.gguf", "Q8_0"), quantized=True))
    assert qwen3.runner.model.fused_decode is None
