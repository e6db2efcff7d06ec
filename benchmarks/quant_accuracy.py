"""bf16, an INT8 KV cache or INT8 weights against the fp32 engine: memory, greedy agreement, logit
error.

Both engines run the same chat prompts greedily. Agreement is measured per prompt as the share
of output positions before the first differing token; logit error is the max absolute difference
of the next-token logits at the positions both engines reached with the same tokens so far.
Usage: python benchmarks/quant_accuracy.py [--variant kv|weights|bf16] [--prompts 16] [--max-tokens 64]
"""

from __future__ import annotations

import argparse

import torch

from backends.builtin.config import EngineConfig
from backends.builtin.core.engine import LLMEngine
from backends.builtin.core.sequence import SamplingParams
from backends.builtin.worker.loader import load_model

TOPICS = ["the sea", "gravity", "a city at night", "prime numbers", "bread", "the moon", "trains", "winter",
          "a library", "volcanoes", "chess", "rain", "bees", "deserts", "music", "friendship"]


def chat_prompt(tok, content: str) -> list[int]:
    """The token ids of one user message, templated as a chat request is."""
    text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def recorded(engine: LLMEngine, prompt: list[int], max_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    logits: list[torch.Tensor] = []
    run = engine.runner.run

    def recording(batch):
        done, out, pooled = run(batch)
        logits.append(out[0])
        return done, out, pooled

    engine.runner.run = recording
    try:
        tokens = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0][0]
    finally:
        engine.runner.run = run
    return tokens, logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--variant", default="kv",
                        help="kv (int8 KV cache) | weights (int8 GEMMs) | bf16 (weights, activations and KV)")
    args = parser.parse_args()
    loaded = load_model()
    tok = loaded.tokenizer
    variant = {"kv": {"kv_cache_dtype": "int8"}, "weights": {"weight_quant": "int8"},
               "bf16": {"dtype": "bfloat16"}}[args.variant]
    engines = {"fp32": LLMEngine(EngineConfig(kv_cache_tokens=4096, dtype="float32"), loaded),
               "variant": LLMEngine(EngineConfig(kv_cache_tokens=4096, **variant), loaded)}
    agreement, identical, worst = [], 0, 0.0
    for topic in TOPICS[: args.prompts]:
        prompt = chat_prompt(tok, f"Write a few sentences about {topic}.")
        (ref, ref_logits), (q8, q8_logits) = (recorded(engines[k], prompt, args.max_tokens) for k in engines)
        same = next((i for i, (a, b) in enumerate(zip(ref, q8)) if a != b), min(len(ref), len(q8)))
        agreement.append(same / len(ref))
        identical += ref == q8
        for a, b in zip(ref_logits[: same + 1], q8_logits[: same + 1]):
            worst = max(worst, (a.float() - b.float()).abs().max().item())
    per_token = {k: e.runner.kv_bytes_per_token() for k, e in engines.items()}
    print(f"variant: {args.variant}")
    print(f"KV bytes per token: {per_token['fp32']:.0f} (float32) -> {per_token['variant']:.0f} ({args.variant}), "
          f"{per_token['fp32'] / per_token['variant']:.2f}x smaller")
    print(f"greedy outputs identical: {identical}/{len(agreement)}; mean share of positions before the first "
          f"difference: {sum(agreement) / len(agreement):.3f}")
    print(f"max |logit difference| while the outputs agree: {worst:.4f}")


if __name__ == "__main__":
    main()
