"""Decode speed of prompt-lookup speculative decoding on the default model, one request at a time.

Two workloads: `copy`, where the answer repeats long spans of the prompt (a text returned with its
typos fixed, code returned with a variable renamed, a passage quoted back), and `fresh`, questions
whose answers are new text (the small model still repeats a phrase of its own now and then).
Each prompt runs greedy without speculation, then with `--k` draft tokens, `--rounds` times:
alternated prompt by prompt, so the load of a shared machine weighs on both alike, and on one
engine, speculation switched between runs (two engines' copies of the weights and caches can
differ by several percent in speed, whichever speculates). A decode's time starts after the step
that prefilled its prompt. Reports decode tokens/s without and with speculation (each round's,
their median, and the best round's), the speed-up, the drafts accepted and the tokens a decode
step emits; the outputs must be the same.
Usage: python benchmarks/ngram_speculation.py [--k 5] [--min-n 2] [--max-n 5] [--rounds 3] [--max-tokens 256]
       [--dtype auto] [--gguf-weights quantized] [--workloads copy,fresh]
"""

from __future__ import annotations

import argparse
import statistics
import time

from backends.builtin.config import EngineConfig
from backends.builtin.core.engine import LLMEngine
from backends.builtin.core.sequence import SamplingParams

TYPOS = """The history of the printing press begins in the middle of the fifteenth century, when Johannes
Gutenberg, a goldsmith from Mainz, combined several existing technologys into a single system. He used
movable metal type, an oil-based ink that stuck to metal, and a wooden press adapted from those used to
make wine. Before his invention, books were copied by hand, which was slow and expensive, and only
monasteries, universities and wealthy families could aford them. Within fifty years of the first printed
Bible, presses were working in more then two hundred cities across Europe, and millions of books had
been produced. The price of a book fell sharply, literacy spread, and ideas could travel faster than
ever before. Scholars could compare identical copies of a text, which made it easier to correct errors
and to build on the work of others. Many historians beleive that the printing press helped to make the
Reformation, the Renaissance and the Scientific Revolution possible."""

CODE = '''def summarize_orders(orders, tax_rate):
    total = 0
    count = 0
    largest = None
    for order in orders:
        if order["status"] != "paid":
            continue
        amount = order["price"] * order["quantity"]
        total = total + amount
        count = count + 1
        if largest is None or amount > largest:
            largest = amount
    average = total / count if count else 0
    tax = total * tax_rate
    return {
        "total": total,
        "count": count,
        "largest": largest,
        "average": average,
        "tax": tax,
        "total_with_tax": total + tax,
    }'''

PASSAGE = """The lighthouse stood at the end of a narrow spit of land, a white tower with a red lamp room,
and for ninety years its keepers had climbed the same one hundred and twelve steps every evening to
light the lamp. The last keeper, a quiet man named Thomas Hale, kept a logbook in which he wrote the
weather, the ships that passed and the birds that rested on the railing. When the light was automated
in 1987, he packed the logbooks into a wooden crate and gave them to the town museum, where they remain
today, open to anyone who asks to read them."""

WORKLOADS = {
    "copy": [f"Copy this text and fix the typos. Return only the corrected text.\n\n{TYPOS}",
             f"Repeat the following code exactly, but rename the variable `total` to `subtotal`.\n\n{CODE}",
             f"Quote the following passage back to me exactly as it is written.\n\n{PASSAGE}"],
    "fresh": ["Why is the sky blue?", "Explain how vaccines train the immune system, in a few paragraphs.",
              "Who was Marie Curie?", "What is the difference between weather and climate?"],
}


def decode(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[list[int], float]:
    """The output and the seconds its decode steps took (after the step that prefilled the prompt)."""
    engine.add_request(f"r{engine.steps}", prompt, params)
    tokens = [t for out in engine.step() for t in out.token_ids]
    start = time.perf_counter()
    while engine.has_work:
        tokens += [t for out in engine.step() for t in out.token_ids]
    return tokens, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--k", type=int, default=5, help="draft tokens (num_speculative_tokens)")
    parser.add_argument("--min-n", type=int, default=2, help="prompt_lookup_min")
    parser.add_argument("--max-n", type=int, default=5, help="prompt_lookup_max")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--gguf-weights", default="quantized", help="quantized (the engine's default) | dequantized")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    args = parser.parse_args()

    # no prefix cache: each run prefills its whole prompt, so both runs' prompt tokens are computed
    # alike (a cached prefix would leave fewer rows to the last chunk, and below 16 bf16 rows the
    # quantized weights take the integer kernels, whose rounding differs)
    engine = LLMEngine(EngineConfig(dtype=args.dtype, num_speculative_tokens=args.k, prompt_lookup_min=args.min_n,
                                    prompt_lookup_max=args.max_n, gguf_weights=args.gguf_weights,
                                    enable_prefix_caching=False))
    tok = engine.tokenizer
    modes = {"off": 0, "on": args.k}  # draft tokens
    print(f"weights {engine.runner.weights}, dtype {engine.runner.dtype} ({engine.runner.dtype_reason}), k={args.k}, "
          f"n-grams {args.min_n}..{args.max_n}, max_tokens {args.max_tokens}, rounds {args.rounds}")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    for name in args.workloads.split(","):
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True,
                                                      tokenize=False), add_special_tokens=False)
                   for ask in WORKLOADS[name]]
        decode(engine, prompts[0], SamplingParams(max_tokens=8, temperature=0.0))  # warm
        seconds = {mode: [0.0] * args.rounds for mode in modes}
        outputs: dict[str, list[list[int]]] = {mode: [] for mode in modes}
        before, steps = engine.stats(), {mode: 0 for mode in modes}
        for round_ in range(args.rounds):
            for prompt in prompts:
                for mode, k in list(modes.items())[:: 1 if round_ % 2 == 0 else -1]:  # neither always first
                    engine.scheduler.num_speculative_tokens = k
                    first = engine.steps
                    tokens, took = decode(engine, prompt, params)
                    seconds[mode][round_] += took
                    outputs[mode].append(tokens)
                    steps[mode] += engine.steps - first
        assert outputs["on"] == outputs["off"], "speculation changed the output"
        after = engine.stats()
        drafted = after["spec_decode_draft_tokens_total"] - before["spec_decode_draft_tokens_total"]
        accepted = after["spec_decode_accepted_tokens_total"] - before["spec_decode_accepted_tokens_total"]
        decoded = sum(len(t) - 1 for t in outputs["on"][: len(prompts)])  # a round's decoded tokens
        decode_steps = steps["on"] / args.rounds - len(prompts)  # less the prefills
        rates = {mode: [decoded / s for s in seconds[mode]] for mode in modes}
        median = {mode: statistics.median(r) for mode, r in rates.items()}
        best = {mode: max(r) for mode, r in rates.items()}
        print(f"{name}: {len(prompts)} prompts, output tokens {[len(t) for t in outputs['on'][: len(prompts)]]}")
        for mode in modes:
            print(f"  {mode:3s}: decode tok/s by round {', '.join(f'{r:.1f}' for r in rates[mode])}; "
                  f"median {median[mode]:.1f}, best {best[mode]:.1f}")
        print(f"  speed-up {median['on'] / median['off']:.2f}x (median), {best['on'] / best['off']:.2f}x (best); "
              f"{accepted}/{drafted} draft tokens accepted ({accepted / max(drafted, 1):.0%}), "
              f"{decoded / decode_steps:.2f} tokens per decode step")


if __name__ == "__main__":
    main()
