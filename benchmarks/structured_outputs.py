"""Structured outputs side by side: servegate's engine and vLLM's CPU build (`backends/peers.py`),
each alone on this CPU, on the 54 schemas of `tests/fixtures/json_schemas.json`:

    python benchmarks/structured_outputs.py [--concurrency 16] [--rounds 2] [--systems builtin,vllm]

For each system, through the `openai` SDK, greedy, with the penalties the tests use (a 135M model
otherwise loops inside strings): the share of outputs that parse and validate against their
schema (jsonschema, draft 2020-12 with formats), and the output throughput at the given
concurrency with every request constrained by its schema (`response_format: json_schema`) and
with the same requests unconstrained, each made to write as many tokens as its answer in the
constrained run just before (`max_tokens` and `ignore_eos`), after a warm-up. Then the grammar
compile time per schema, each library on the same tokenizer: llguidance as servegate runs it
(grammar text, matcher, first token mask), and xgrammar as vLLM runs it (`GrammarCompiler`,
8 threads, `compile_json_schema`) in vLLM's own environment.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.measure.baselines import servegate_command, servegate_env  # noqa: E402
from backends import peers  # noqa: E402
from backends.builtin.worker.loader import default_model_path, gguf_to_hf_dir, load_tokenizer  # noqa: E402
from backends.launch import free_port, supervised  # noqa: E402

SCHEMAS = json.loads((Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "json_schemas.json").read_text())
PENALTIES = {"frequency_penalty": 0.5, "extra_body": {"repetition_penalty": 1.1}}

XGRAMMAR_COMPILE = """
import json, sys, time
import xgrammar
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=int(sys.argv[2]))
compiler = xgrammar.GrammarCompiler(info, max_threads=8)
times = []
for case in json.load(open(sys.argv[3])):
    start = time.perf_counter()
    compiler.compile_json_schema(json.dumps(case["schema"]), any_whitespace=True)
    times.append(time.perf_counter() - start)
print(json.dumps(times))
"""


def messages(case: dict) -> list[dict]:
    return [{"role": "user", "content": f"{case['prompt']} Answer in JSON matching this schema: "
                                        f"{json.dumps(case['schema'])}"}]


async def run(client: openai.AsyncOpenAI, model: str, concurrency: int, lengths: list[int] | None = None
              ) -> tuple[float, list[int], list[str]]:
    """Every schema's request at once under the concurrency cap: constrained by its schema, or,
    given `lengths`, unconstrained and made to write exactly as many tokens (`ignore_eos`), so
    that both runs do the same work but for the masks. (seconds, tokens per request, the names
    of the schemas whose output did not validate)."""
    limit = asyncio.Semaphore(concurrency)

    async def one(i: int, case: dict) -> tuple[int, bool]:
        if lengths is None:
            extra = {"response_format": {"type": "json_schema", "json_schema": {
                "name": case["name"], "schema": case["schema"], "strict": True}}, "max_tokens": 256, **PENALTIES}
        else:
            extra = {"max_tokens": lengths[i], "frequency_penalty": 0.5,
                     "extra_body": {**PENALTIES["extra_body"], "ignore_eos": True}}
        async with limit:
            answer = await client.chat.completions.create(model=model, messages=messages(case), temperature=0,
                                                          **extra)
        return answer.usage.completion_tokens, lengths is not None or valid(answer.choices[0].message.content or "",
                                                                             case["schema"])

    start = time.perf_counter()
    results = await asyncio.gather(*[one(i, case) for i, case in enumerate(SCHEMAS)])
    invalid = [case["name"] for case, (_, ok) in zip(SCHEMAS, results) if not ok]
    return time.perf_counter() - start, [tokens for tokens, _ in results], invalid


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
                                        ).validate(json.loads(text))
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def measure(url: str, key: str, model: str, args) -> dict:
    async def rounds():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=900) as client:
            await run(client, model, args.concurrency)  # warm-up: vLLM compiles its batch shapes
            figures = {"free": [], "constrained": []}
            for _ in range(args.rounds):  # each free run writes what the constrained run before it wrote
                figures["constrained"].append(await run(client, model, args.concurrency))
                figures["free"].append(await run(client, model, args.concurrency, figures["constrained"][-1][1]))
            return figures

    figures = asyncio.run(rounds())

    def throughput(runs) -> float:
        return statistics.mean(sum(tokens) / seconds for seconds, tokens, _ in runs)

    free, constrained = throughput(figures["free"]), throughput(figures["constrained"])
    invalid = sorted({name for _, _, names in figures["constrained"] for name in names})
    return {"valid": len(SCHEMAS) - max(len(names) for _, _, names in figures["constrained"]), "invalid": invalid,
            "free_tok_s": free, "constrained_tok_s": constrained, "ratio": constrained / free}


def servegate_compile_times(model_dir: Path, vocab_size: int) -> list[float]:
    from backends.builtin.core.structured import Grammars, grammar, mask
    from backends.constraints import Constraint

    grammars = Grammars(load_tokenizer(model_dir), vocab_size, [2])

    class Row:  # what `mask` reads of a sequence
        def __init__(self, matcher):
            self.matcher = matcher

    import torch

    times = []
    for case in SCHEMAS:
        start = time.perf_counter()
        constraint = Constraint("json_schema", json.dumps(case["schema"]))
        grammar(constraint)
        mask(torch.zeros(1, vocab_size), [Row(grammars.matcher(constraint))])
        times.append(time.perf_counter() - start)
    return times


def vllm_compile_times(model_dir: Path, vocab_size: int) -> list[float]:
    fixture = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "json_schemas.json"
    done = subprocess.run([str(peers.vllm_python()), "-c", XGRAMMAR_COMPILE, str(model_dir), str(vocab_size),
                           str(fixture)], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--systems", default="builtin,vllm")
    args = parser.parse_args()
    model_dir = gguf_to_hf_dir(default_model_path())
    vocab_size = 49152
    print("| system | outputs valid | unconstrained tok/s | constrained tok/s | constrained / unconstrained |")
    print("|---|---|---|---|---|")
    for system in args.systems.split(","):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        if system == "builtin":
            with servegate_env() as (env, key), supervised(servegate_command(port), url, "/ready", env, 600):
                result = measure(url, key, "SmolLM2-135M-Instruct", args)
        else:
            with supervised(peers.vllm_command(model_dir, port, "smollm2"), url, "/health", peers.vllm_env(), 900):
                result = measure(url, "none", "smollm2", args)
        print(f"| {system} | {result['valid']}/{len(SCHEMAS)} {' '.join(result['invalid'])} | "
              f"{result['free_tok_s']:.1f} | {result['constrained_tok_s']:.1f} | {result['ratio']:.2f} |", flush=True)
    print("\n| grammar library | p50 compile ms | mean ms | max ms |")
    print("|---|---|---|---|")
    for name, times in (("llguidance (servegate)", servegate_compile_times(model_dir, vocab_size)),
                        ("xgrammar (vLLM)", vllm_compile_times(model_dir, vocab_size))):
        ms = [1000 * t for t in times]
        print(f"| {name} | {statistics.median(ms):.2f} | {statistics.mean(ms):.2f} | {max(ms):.2f} |")


if __name__ == "__main__":
    main()
