"""The built-in engine on a CUDA device, in process (no HTTP): greedy agreement with transformers on
the same device, the shared-prefix load at concurrency 16, decode steps by batch size, and where
a decode step's time goes.

- agreement: 20 prompts (chat and completion, short and over 1,000 tokens), all in one batch through
  the engine in float32, each alone through transformers' `generate` on the engine's converted
  Hugging Face directory, float32 with TF32 off; where they differ, the reference's margin between
  its top two logits at the first differing token;
- load: 32 requests in 4 groups (a 512-token prefix per group, 32 tokens of its own, 64 output
  tokens, EOS ignored), 16 in flight, a new one added as one finishes, as `servegate bench
  --dataset shared-prefix --max-concurrency 16` sends them; two warm-up requests first;
- decode steps at batch 1 to 256 with 600 tokens of context each (4 groups sharing 512), and one
  step at batch 16 under torch.profiler: the GPU's busy time against the step's wall time.

Usage: python benchmarks/cuda_engine.py [--model PATH] [--device cuda] [--dtypes bfloat16,float32] [--out FILE]
(runs on the CPU too, slowly, with --device cpu: a dry run of the script itself).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from decode_step import decode_step_ms, prompt
from quant_accuracy import TOPICS, chat_prompt

from advisor.measure.metrics import RequestResult, summarize
from backends.builtin.config import EngineConfig
from backends.builtin.core.engine import LLMEngine
from backends.builtin.core.sequence import SamplingParams
from backends.builtin.worker.loader import load_model, model_dir

OPENINGS = ["The three laws of thermodynamics are", "def fibonacci(n):", "Once upon a time, in a small village,",
            "The capital of France is", "Photosynthesis is the process by which"]
LONG = ("A lighthouse keeper logs the weather every hour: wind, swell, the colour of the sky, which ships pass "
        "and how far out. Over forty years the logs fill a shelf, and a historian who reads them finds the "
        "slow change of a coast. ")


def agreement_prompts(tok) -> list[list[int]]:
    chats = [chat_prompt(tok, f"Write a few sentences about {t}.") for t in TOPICS[:10]]
    chats += [chat_prompt(tok, LONG * (24 + 2 * i) + "Summarize this.") for i in range(2)]
    texts = OPENINGS + [LONG * (25 + 3 * i) + f"Question {i}: what does the historian find? Answer:" for i in range(3)]
    return chats + [tok.encode(t, add_special_tokens=False) for t in texts]


def agreement(loaded, device: str, max_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = agreement_prompts(loaded.tokenizer)
    engine = LLMEngine(EngineConfig(device=device, dtype="float32", kv_cache_tokens=32768), loaded)
    ours = [out[0] for out in engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))]
    del engine
    hf = AutoModelForCausalLM.from_pretrained(model_dir(loaded.source), dtype=torch.float32).to(device).eval()
    rows = []
    for ids, got in zip(prompts, ours):
        with torch.inference_mode():
            x = torch.tensor([ids], device=device)
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                              output_logits=True, return_dict_in_generate=True)
        want = out.sequences[0, len(ids):].tolist()
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        margin = None
        if first is not None:
            top2 = out.logits[first][0].float().topk(2).values
            margin = round(float(top2[0] - top2[1]), 5)
        rows.append({"prompt_tokens": len(ids), "identical": got == want, "first_difference": first,
                     "reference_top2_margin": margin})
    del hf
    return {"prompts": len(rows), "identical": sum(r["identical"] for r in rows), "rows": rows}


def shared_prefix_load(engine: LLMEngine, requests: int = 32, concurrency: int = 16, groups: int = 4,
                       shared: int = 512, own: int = 32, output: int = 64, salt: int = 0) -> dict:
    """The load's figures, measured and summarized as `servegate bench` does (`RequestResult`s, `summarize`)."""
    params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
    queue = [prompt(i + salt, shared + own, groups, shared) for i in range(requests)]
    results = [RequestResult(prompt_tokens=len(ids)) for ids in queue]
    sent, start = 0, time.perf_counter()

    def send():
        nonlocal sent
        results[sent].start = time.perf_counter() - start
        engine.add_request(f"{salt}-{sent}", queue[sent], params)
        sent += 1

    for _ in range(min(concurrency, requests)):
        send()
    while engine.has_work:
        outputs = engine.step()
        now = time.perf_counter() - start
        for out in outputs:
            result = results[int(out.request_id.split("-")[1])]
            result.output_tokens += len(out.token_ids)
            if result.ttft is None:
                result.ttft = now - result.start
            if out.finish_reason:
                result.e2el = now - result.start
                if sent < requests:
                    send()
    summary = summarize(results, time.perf_counter() - start)
    return {"output_tok_s": round(summary["output_throughput"], 1),
            **{key: round(summary[key], 1) for key in ("median_ttft_ms", "mean_ttft_ms", "median_tpot_ms")},
            "seconds": round(summary["duration"], 2)}


def decode_profile(engine: LLMEngine, batch: int, device: str) -> dict:
    """Wall time of decode steps at `batch` against the device's busy time over them."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        wall = decode_step_ms(engine, batch, 600, 10, groups=4, shared=512)
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events) / 1e3 / 10  # us over 10 steps -> ms a step
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:8]
    return {"wall_ms": round(wall, 2), "device_busy_ms": round(busy, 2), "kernel_launches_per_step": launches // 10,
            "top": [[e.key[:60], round(e.self_device_time_total / 1e3 / 10, 3)] for e in top]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: the default one)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt in the agreement part")
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--out", default=None, help="write the figures here as JSON too")
    args = parser.parse_args()
    loaded = load_model(args.model)
    report = {"device": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
              "torch": torch.__version__}
    report["agreement"] = agreement(loaded, args.device, args.max_tokens)
    print(json.dumps({k: v for k, v in report["agreement"].items() if k != "rows"}), flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    for dtype in args.dtypes.split(","):
        engine = LLMEngine(EngineConfig(device=args.device, dtype=dtype, kv_cache_tokens=640 * max(batches) + 4096,
                                        max_num_seqs=max(batches)), loaded)
        shared_prefix_load(engine, requests=2, concurrency=1, salt=1000)  # the bench's warm-ups
        figures = {"load_c16": [shared_prefix_load(engine, salt=s) for s in (0, 100)],
                   "decode_step_ms": {b: round(decode_step_ms(engine, b, 600, 20, groups=4, shared=512), 2)
                                      for b in batches},
                   "decode_profile_b16": decode_profile(engine, 16, args.device)}
        report[dtype] = figures
        print(dtype, json.dumps(figures), flush=True)
        del engine
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
