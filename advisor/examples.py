"""Writes docs/advisor-examples.md: the advisor's own reports for a catalogue of scenarios.

Usage: python -m advisor.examples [docs/advisor-examples.md]

Beside it, docs/advisor-report/ gets the HTML report of three of them; their screenshots are
headless Chromium's (`chromium --headless --screenshot=NAME.png --window-size=1250,3000 NAME.html`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from .advise import Workload, advise
from .hardware import resolve as hardware
from .model_facts import resolve as model
from .report import to_html, to_markdown

ADAPTERS = ["support=./adapters/support", "sales=./adapters/sales", "legal=./adapters/legal", "code=./adapters/code"]
# (title, command-line flags, model, hardware, gpus, workload); each section's "why" lives in
# WHY, keyed by title, so a reader can check the answer by hand.
SCENARIOS = [
    ("DeepSeek-V3 on 8 x H200", "--model deepseek-ai/DeepSeek-V3 --hardware h200 --gpus 8 --concurrency 16",
     "deepseek-ai/DeepSeek-V3", "h200", 8, Workload(concurrency=16)),
    ("gpt-oss-120b on 1 x H100", "--model openai/gpt-oss-120b --hardware h100-sxm --concurrency 16",
     "openai/gpt-oss-120b", "h100-sxm", 1, Workload(concurrency=16)),
    ("Mixtral 8x7B on 1 x MI300X", "--model mistralai/Mixtral-8x7B-Instruct-v0.1 --hardware mi300x --concurrency 16",
     "mistralai/Mixtral-8x7B-Instruct-v0.1", "mi300x", 1, Workload(concurrency=16)),
    ("Llama 3.1 8B on 1 x L4, 32 users", "--model meta-llama/Llama-3.1-8B-Instruct --hardware l4 --concurrency 32",
     "meta-llama/Llama-3.1-8B-Instruct", "l4", 1, Workload(concurrency=32)),
    ("Qwen2.5-72B AWQ on 2 x A100 80 GB",
     "--model Qwen/Qwen2.5-72B-Instruct --weight-quant awq --hardware a100-80gb --gpus 2 --concurrency 16",
     "Qwen/Qwen2.5-72B-Instruct", "a100-80gb", 2, Workload(weight_quant="awq", concurrency=16)),
    ("A 7B model on 1 x Ascend 910B", "--model Qwen/Qwen2.5-7B-Instruct --hardware ascend-910b --concurrency 16",
     "Qwen/Qwen2.5-7B-Instruct", "ascend-910b", 1, Workload(concurrency=16)),
    ("A 7B model on an M3 Max",
     "--model Qwen/Qwen2.5-7B-Instruct --hardware m3-max --weight-quant Q4_K_M --concurrency 1 --offline",
     "Qwen/Qwen2.5-7B-Instruct", "m3-max", 1, Workload(weight_quant="Q4_K_M", concurrency=1, offline=True)),
    ("A 7B model on a CPU server",
     "--model Qwen/Qwen2.5-7B-Instruct --hardware cpu-x86 --weight-quant Q4_K_M --prompt-tokens 256 "
     "--output-tokens 128 --concurrency 2 --slo-ttft-ms 10000 --slo-tpot-ms 200",
     "Qwen/Qwen2.5-7B-Instruct", "cpu-x86", 1,
     Workload(weight_quant="Q4_K_M", prompt_tokens=256, output_tokens=128, concurrency=2, slo_ttft_ms=10000,
              slo_tpot_ms=200)),
    ("A request no runtime can meet: Llama 3.1 70B at 20 ms a token on 8 x L4",
     "--model meta-llama/Llama-3.1-70B-Instruct --hardware l4 --gpus 8 --slo-tpot-ms 20",
     "meta-llama/Llama-3.1-70B-Instruct", "l4", 8, Workload(slo_tpot_ms=20)),
    ("Llama 3.1 8B with four LoRA adapters on 1 x L40S",
     "--model meta-llama/Llama-3.1-8B-Instruct --hardware l40s --concurrency 16 --lora-rank 16 "
     + " ".join(f"--lora {a}" for a in ADAPTERS),
     "meta-llama/Llama-3.1-8B-Instruct", "l40s", 1, Workload(concurrency=16, lora_rank=16, lora_paths=ADAPTERS)),
    ("gpt-oss-20b on a 16 GB RTX 5080", "--model openai/gpt-oss-20b --hardware rtx-5080 --concurrency 4",
     "openai/gpt-oss-20b", "rtx-5080", 1, Workload(concurrency=4)),
    ("Qwen3-30B-A3B on a CPU server",
     "--model Qwen/Qwen3-30B-A3B --hardware cpu-x86 --weight-quant Q4_K_M --prompt-tokens 256 --output-tokens 128 "
     "--concurrency 2 --slo-ttft-ms 10000 --slo-tpot-ms 200",
     "Qwen/Qwen3-30B-A3B", "cpu-x86", 1,
     Workload(weight_quant="Q4_K_M", prompt_tokens=256, output_tokens=128, concurrency=2, slo_ttft_ms=10000,
              slo_tpot_ms=200)),
    ("Qwen3-8B on an M4 Max", "--model Qwen/Qwen3-8B --hardware m4-max --concurrency 4 --offline",
     "Qwen/Qwen3-8B", "m4-max", 1, Workload(concurrency=4, offline=True)),
    ("A rate one device does not serve: Llama 3.1 8B at 500 req/s on 1 x H100",
     "--model meta-llama/Llama-3.1-8B-Instruct --hardware h100-sxm --request-rate 500",
     "meta-llama/Llama-3.1-8B-Instruct", "h100-sxm", 1, Workload(request_rate=500)),
]

WHY = {
    "DeepSeek-V3 on 8 x H200": (
        "DeepSeek-V3's FP8 weights (671e9 parameters, 78 GiB a device at TP 8) leave room on 141 GB H200s; "
        "TensorRT-LLM, vLLM, SGLang and LMDeploy serve the architecture, TGI is in maintenance mode (its README) "
        "and llama.cpp has no FP8 weights. The decode estimate is the one to check: at batch 16 each MoE layer "
        "reads 256 x (1 - (248/256)^16) = 102 of its 256 experts, not 8, so a step reads 58 layers x 102 x "
        "44.0e6 weights + 16.6e9 weights every token uses = 277 GB, 9.0 ms over 8 x 4.8 TB/s x 0.8, plus 1.3 ms "
        "of tensor-parallel all-reduces (61 layers x 2 x ~11 us on NVLink 4, 450 GB/s a direction: "
        "AIConfigurator's h200_sxm.yaml) and 0.3 ms of MLA cache: about 10.7 ms a token (a test in "
        "tests/test_advisor.py holds this hand calculation). vLLM and SGLang differ only in how much KV cache "
        "fits: vLLM's 0.92 of memory (vllm/config/cache.py) holds activations too, SGLang's 0.897 at 141 GB and "
        "TP 8 (its server_args.py heuristic) holds only weights and KV. The goodput estimates differ by less "
        "than the estimate resolves: they tie, and --measure decides. Expert "
        "parallelism is not assumed (SGLang's DeepSeek recipe runs TP 8); --expert-parallel asks for it."),
    "gpt-oss-120b on 1 x H100": (
        "gpt-oss-120b's checkpoint quantizes only its experts to MXFP4 (4.25 bits with scales) and keeps "
        "attention, router, embeddings and head in bf16: 60.8 GiB, as OpenAI's model card lists, and it fits "
        "one 80 GB H100. At batch 16 each layer reads 128 x (1 - (124/128)^16) = 51 of its 128 experts, about "
        "27 GB a step: ~10 ms a token over 3.35 TB/s x 0.8, where counting only the 4 active experts said "
        "1.3 ms. TensorRT-LLM is no longer excluded on Hopper: its gpt-oss deployment guide runs H200 with BF16 "
        "activations and MXFP4 weights on the TRITON MoE backend."),
    "Mixtral 8x7B on 1 x MI300X": (
        "Mixtral routes each token to 2 of 8 experts, but 16 tokens touch 8 x (1 - (6/8)^16) = 7.9 of them, so "
        "a decode step at batch 16 reads nearly all 46.7e9 weights (93 GB in bf16): 22 ms over 5.3 TB/s x 0.8, "
        "where the active-parameter shortcut said 6.7 ms. TensorRT-LLM is NVIDIA only; vLLM and SGLang run on "
        "ROCm (their hardware cells); llama.cpp serves Mixtral converted to its llama architecture."),
    "Llama 3.1 8B on 1 x L4, 32 users": (
        "16 GB of bf16 weights on a 24 GB L4 leave 3-5 GB of KV cache: vLLM's 0.92 of memory must also hold "
        "activations and CUDA graphs (3.5 GB reserved, after AIConfigurator), SGLang's 0.847 (its server_args.py "
        "heuristic for a card under 35 GB at TP 1) holds only weights and KV. At 128 KiB a token (32 layers x 8 KV "
        "heads x 128 x 2 x 2 bytes) that is 24 and 34 sequences of 1,280 tokens. Decode is bandwidth-bound: "
        "16 GB over 300 GB/s x 0.8 is 67 ms a step, above the 50 ms TPOT SLO at any batch: no runtime meets "
        "the SLO. The alternatives are the fixes, each estimated: fp8 weights (native on the L4's Ada; vLLM "
        "also runs them as W8A16 through FP8 Marlin from sm75), AWQ, or a second card."),
    "Qwen2.5-72B AWQ on 2 x A100 80 GB": (
        "AWQ stores 4 bits a weight plus an fp16 scale and zero per group of 128: 72.7e9 x 4.25 / 8 = 38.6 GB, "
        "19.3 GB a device at TP 2, leaving most of each 80 GB for KV. vLLM's AWQ cell lists Ampere (its "
        "quantization hardware table), TGI is excluded for a new deployment, TensorRT-LLM serves AWQ as W4A16. "
        "A decode step at batch 16 reads 19.3 GB a device over 2.04 TB/s x 0.8 (12 ms) plus 80 layers x 2 "
        "all-reduces over NVLink 3 (300 GB/s a direction)."),
    "A 7B model on 1 x Ascend 910B": (
        "The Ascend column is reachable now that the catalogue has the 910B, whose figures are secondary (no "
        "Huawei datasheet; the device note says so): 64 GB, 1.6 TB/s and ~320 FP16 TFLOPS used. vLLM runs there "
        "through the vllm-ascend plugin (partial), SGLang with --device npu, LMDeploy's PyTorch engine on "
        "Atlas 800T A2, llama.cpp through its CANN backend; TensorRT-LLM is NVIDIA only. Treat the estimates "
        "as rough until --measure."),
    "A 7B model on an M3 Max": (
        "On Apple silicon the serving runtimes are llama.cpp (Metal) and Ollama, which bundles it; vLLM, "
        "SGLang, TGI and TensorRT-LLM have no Metal backend in their hardware cells. Q4_K_M is 4.9 bits a "
        "weight (llama-quantize's size table), 4.3 GiB, and decode reads it at 400 GB/s x 0.8: about 14 ms a "
        "token for one user. Apple publishes no GPU TFLOPS: the catalogue derives 14.3 from the 40-core GPU "
        "(40 x 128 FP32 ALUs x 2 x 1.398 GHz), and the calibration against llama.cpp's Apple-silicon table "
        "(prompt processing and generation on M1 Max to M4 Max) fits the share of it Metal kernels reach."),
    "A 7B model on a CPU server": (
        "A generic 16-core DDR5 server (76.8 GB/s, the catalogue's derivation): llama.cpp and Ollama run GGUF on "
        "CPU, vLLM's CPU build serves bf16. Q4_K_M's 4.4 GiB read at 76.8 x 0.8 GB/s is ~75 ms a token, within a "
        "200 ms SLO; the prefill is compute-bound, 2 x 7.6e9 x 256 FLOPs over 1.28 TFLOPS x 0.45 = 6.8 s, which "
        "is why the TTFT SLO here is 10 s: a CPU serves short prompts or patient users. On this class of "
        "machine `--hardware local` measures the real bandwidth and FLOPS instead of the datasheet's."),
    "A request no runtime can meet: Llama 3.1 70B at 20 ms a token on 8 x L4": (
        "141 GB of bf16 weights over 8 L4s is 17.6 GB a card: 73 ms a step over 300 GB/s x 0.8 before any KV or "
        "PCIe all-reduce, so no runtime reaches 20 ms a token, and none is recommended. The alternatives are "
        "estimated by the same model: 8-bit or 4-bit weights halve or quarter the bytes but still miss 20 ms; "
        "16 or 32 cards split them further, but over PCIe 4.0 (32 GB/s a direction) 80 layers x 2 all-reduces "
        "grow with every card; the SLO the fastest runtime reaches here is printed with its goodput."),
    "Llama 3.1 8B with four LoRA adapters on 1 x L40S": (
        "Four rank-16 adapters on every attention and MLP projection are 4 x 16 x 32 layers x (4,096 + 6,144 + "
        "4,096 + 4,096 + 4,096 + 28,672 + 14,336 + 4,096) = 0.14e9 parameters, 0.29 GB in bf16, held beside the "
        "weights (vLLM's --max-loras slots, SGLang's --max-loras-per-batch) and read once a step for each adapter "
        "the batch mixes. The launch lines load them at start: vLLM with --enable-lora --max-loras 4 "
        "--max-lora-rank 16 --lora-modules (vllm/config/lora.py takes ranks 1, 8, 16, 32, ... 512), SGLang with "
        "--enable-lora --max-loras-per-batch --lora-paths, llama-server with one --lora per adapter loaded unapplied "
        "(--lora-init-without-apply: each request names its own with `lora`), LMDeploy through its PyTorch "
        "engine (--backend pytorch --adapters). Ollama takes one "
        "ADAPTER per Modelfile and MLX one adapter at a time: both are excluded. Each request may run to the "
        "model's 131,072 tokens (--max-model-len), not the mean prompt."),
    "gpt-oss-20b on a 16 GB RTX 5080": (
        "gpt-oss-20b's checkpoint is 12.8 GiB (MXFP4 experts, bf16 attention), and OpenAI says it runs within 16 GB. "
        "It does in llama.cpp and Ollama, which keep their own reserve (llama.cpp's compute buffer and the device "
        "context, about 1 GiB; Ollama's 457 MiB per CUDA device plus its graph estimate), not vLLM's 3.5 GB "
        "activation and CUDA-graph reserve: 15.9 GiB x 0.92 - 12.8 - 1.0 leaves 0.8 GiB, some 33,000 tokens of "
        "KV cache: 49 KB a token over 24 layers x 8 KV heads x 64 x 2 x bf16, half of it, since every other "
        "layer keeps only its 128-token sliding window. vLLM, SGLang and TensorRT-LLM keep "
        "more than the 3 GiB left and are excluded; TGI has no gpt_oss model."),
    "Qwen3-30B-A3B on a CPU server": (
        "On a CPU box the weights that run are GGUF's: Q4_K_M puts Qwen3-30B-A3B's 30.5e9 parameters in about 17 "
        "GiB, and llama.cpp (or Ollama on top of it) loads them. SGLang's CPU backend takes fp8, w8a8_int8, awq, "
        "gptq and mxfp4 but no GGUF (CPU_QUANTIZATION_METHODS in its quantization/__init__.py), vLLM 0.34.0 has "
        "no GGUF at all, and LMDeploy, TensorRT-LLM and TGI do not run on a CPU for a new deployment. A decode step "
        "reads the 3.3e9 active parameters' share of the union of routed experts the batch touches."),
    "Qwen3-8B on an M4 Max": (
        "On a Mac, llama.cpp and MLX run on the GPU through Metal. vLLM runs on macOS too, but as its CPU "
        "platform (vllm/platforms/__init__.py takes darwin as a CPU platform): its estimate, made for the GPU, "
        "overstates it, and the runs-on-the-cpu-cores rule marks it down. SGLang's MLX backend is partial. "
        "LMDeploy, TGI and TensorRT-LLM do not run there."),
    "A rate one device does not serve: Llama 3.1 8B at 500 req/s on 1 x H100": (
        "No runtime serves 500 requests a second of 1,024 + 256 tokens within 2 s to the first token and 50 ms a "
        "token on one H100. Each runtime's scheduler is simulated at offered rates up to 1.5 x its roofline "
        "capacity (the goodput curve of the HTML report); the peak of that curve is the most one deployment serves "
        "within the SLO, so the answer is not a recommendation but the rate divided by the best peak, rounded up, "
        "in devices, and the runtimes are ordered by their peaks.")
}


def render() -> str:
    parts = ["# Advisor examples", "",
             "Generated by `python -m advisor.examples`: each section is `servegate advise` on one scenario, "
             "verbatim, after a paragraph on why the answer is right and where its facts come from. TTFT, TPOT and "
             "goodput are each runtime's own scheduler simulated over the workload, with the range its calibration "
             "against published measurements gives; the roofline column is the single formula the paragraphs work "
             "through by hand. Confirm them with `--measure`.",
             ""]
    decisive: dict[tuple[str, str], dict] = {}
    for title, flags, model_id, device, gpus, workload in SCENARIOS:
        report = advise(model(model_id), hardware(device), gpus, workload)
        body = to_markdown(report).replace("# servegate advise\n", "").replace("\n## ", "\n### ")
        parts += [f"## {title}", "", f"`servegate advise {flags}`", "", f"Why: {WHY[title]}", body]
        for c in report.candidates:
            for r in c.reasons:
                if r["cell"] and r["kind"] in ("exclude", "score"):
                    decisive[(c.name, r["cell"]["path"])] = r["cell"]
    parts += ["## The cells these answers rest on", "",
              "Every matrix cell that excluded or scored a runtime above, with the date its source was read.", "",
              "| runtime | cell | status | code | source | checked |", "|---|---|---|---|---|---|",
              *(f"| {name} | `{path}` | {cell['status']} | {cell.get('line') or ''} | {cell['source']} | "
                f"{cell['checked']} |"
                for (name, path), cell in sorted(decisive.items())), ""]
    return "\n".join(parts)


# The scenarios whose HTML report docs/advisor-report/ keeps, with a screenshot of each.
PAGES = {"Llama 3.1 8B with four LoRA adapters on 1 x L40S": "lora-l40s",
         "Llama 3.1 8B on 1 x L4, 32 users": "l4-no-slo",
         "A rate one device does not serve: Llama 3.1 8B at 500 req/s on 1 x H100": "h100-beyond-capacity"}


def pages(folder: Path) -> list[Path]:
    """The HTML reports of PAGES, written to `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for title, _, model_id, device, gpus, workload in SCENARIOS:
        if title in PAGES:
            path = folder / f"{PAGES[title]}.html"
            path.write_text(to_html(advise(model(model_id), hardware(device), gpus, workload)))
            written.append(path)
    return written


def main() -> None:
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/advisor-examples.md")
    target.write_text(render())
    print(f"wrote {target}")
    for page in pages(target.parent / "advisor-report"):
        print(f"wrote {page}")


if __name__ == "__main__":
    main()
