"""Writes docs/advisor-search.md (and each case's HTML report beside it): the deployment search
on three cases a launch team asks about, each with the published recipes it can be checked against.

Usage: python -m advisor.perf.cases [docs/advisor-search.md]
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from ..hardware import resolve as hardware
from ..model_facts import resolve as model
from . import frontier
from .search import Pool, parse_slos, search

DOCS = Path(__file__).resolve().parents[2] / "docs"


@dataclass(frozen=True)
class Case:
    slug: str
    title: str
    model: str
    hardware: str
    nodes: int
    price: float | None
    prompt: int
    output: int
    slo: str
    runtimes: tuple[str, ...]
    target_rate: float | None
    recipes: str  # what published deployment recipes do, with their sources, to check the choice against

    @property
    def command(self) -> str:
        return (f"servegate advise --search --model {self.model} --hardware {self.hardware} --nodes {self.nodes} "
                f"--gpus-per-node 8 --prompt-tokens {self.prompt} --output-tokens {self.output} --slo '{self.slo}' "
                f"--runtimes {','.join(self.runtimes)}"
                + (f" --target-rate {self.target_rate:g}" if self.target_rate else "")
                + (f" --price-per-gpu-hour {self.price:g}" if self.price else "") + " --format html")


CASES = (
    Case("llama-70b-h100x16", "A 70B dense model on up to 16 H100s in 2 nodes", "meta-llama/Llama-3.1-70B-Instruct",
         "h100-sxm", 2, 2.5, 2048, 256, "ttft:p90<2000ms;tpot:p90<50ms", ("vllm", "sglang", "tensorrt-llm", "lmdeploy"),
         20.0,
         "vLLM's parallelism guide serves a 70B model with `--tensor-parallel-size 4` on one node and, across "
         "nodes, sets the tensor-parallel size to the GPUs per node and the pipeline-parallel size to the nodes "
         "(TP8 x PP2 on 16 GPUs; docs.vllm.ai, serving/parallelism_scaling). TensorRT-LLM's own tables run "
         "Llama 3.3 70B in FP8 on H100 at TP2 for throughput (calibration set, "
         "trtllm-h100-llama33-70b-fp8-tp2-2048-128). On the frontier: TP8 on one node, and TP8 x PP2 or two "
         "TP8 replicas over both, are the per-user end (over 120 tokens/s per user), so the multi-node recipe "
         "buys latency, not cost; TP2 and TP4 (TensorRT-LLM's throughput shape, vLLM's single-node one) are the "
         "tokens/s/GPU end, but with 64 or more clients they miss a 2 s p90 TTFT unless prefill runs on engines "
         "of its own: the options within the SLO that cost least split prefill from decode over TP2-TP4 engines."),
    Case("deepseek-v3-h200x16", "A DeepSeek-V3-class MoE on 16 H200s in 2 nodes", "deepseek-ai/DeepSeek-V3", "h200", 2,
         3.5, 2048, 512, "ttft:p90<3000ms;tpot:p90<80ms", ("sglang", "vllm", "tensorrt-llm"), 10.0,
         "SGLang's DeepSeek guide recommends FP8 on one 8 x H200 node (TP8), and TP16 across two nodes of smaller "
         "GPUs (`--tp 16 --nnodes 2 --dist-init-addr`); its large-scale recipe adds DP attention with expert "
         "parallelism and prefill/decode disaggregation (lmsys.org, 2025-05-05, 96 H100s). NVIDIA's DeepSeek-R1 "
         "blog runs TP8 for the lowest latency and attention-DP8 x EP8 for the highest throughput on 8 x H200 "
         "(calibration set, nvblog-h200-dsr1-fp8-maxtput-1k-2k). The frontier has the same two ends: TP8 (and "
         "TP8 x PP2) for tokens/s per user, attention-DP x EP for tokens/s per GPU; within the SLO the cheapest "
         "option found splits prefill and decode into attention-DP x EP engines of their own, the large-scale "
         "recipe's shape at two nodes."),
    Case("llama-8b-l4", "An 8B model on L4s at the lowest $/M tokens under a TPOT SLO",
         "meta-llama/Llama-3.1-8B-Instruct", "l4", 1, 0.8, 1024, 256, "tpot:p90<60ms",
         ("vllm", "sglang", "tensorrt-llm", "lmdeploy", "llama-cpp"),
         None,
         "Google's GKE guide to LLM serving on GPUs recommends quantizing so that a model fits one L4 rather than "
         "two (its examples: GPTQ Llama-2 13B and AWQ Gemma 7B each on a single L4) and scaling out with "
         "replicas (cloud.google.com, kubernetes-engine/docs/best-practices/machine-learning/inference/"
         "llm-optimization). The search quantizes too (FP8 everywhere on the frontier: the L4 is an Ada GPU with "
         "FP8 tensor cores), but a single L4 misses a 60 ms p90 TPOT at 64 clients: 300 GB/s reads 8 GB of weights "
         "and the batch's KV too slowly, so the cheapest shapes within the SLO use two L4s per engine (TP2), "
         "replicated; one L4 per replica is cheaper only for a looser TPOT."),
)


def run(case: Case) -> dict:
    return search(model(case.model), Pool(hardware(case.hardware), 8, case.nodes, case.price), case.prompt,
                  case.output, parse_slos(case.slo), list(case.runtimes), case.target_rate)


def render() -> tuple[str, dict[str, str]]:
    """The Markdown page and each case's HTML report."""
    lines = ["# `servegate advise --search`: three cases", "",
             "Generated by `python -m advisor.perf.cases`; the figures are the performance model's (its error "
             "against published measurements: `servegate advise --calibration`). Each case's HTML report, with "
             "the frontier plotted, is beside this page.", ""]
    pages = {}
    for case in CASES:
        result = run(case)
        pages[f"advisor-search/{case.slug}.html"] = frontier.to_html(result, case.title)
        body = frontier.to_markdown(result, case.title).split("\n", 2)[2]  # without its own title
        lines += [f"## {case.title}", "", f"    {case.command} --output {case.slug}.html", "", body.strip(), "",
                  f"HTML report: [advisor-search/{case.slug}.html](advisor-search/{case.slug}.html)", "",
                  f"**Against published recipes.** {case.recipes}", ""]
    return "\n".join(lines), pages


def main() -> None:
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else DOCS / "advisor-search.md"
    text, pages = render()
    target.write_text(text)
    for name, html in pages.items():
        (target.parent / name).parent.mkdir(parents=True, exist_ok=True)
        (target.parent / name).write_text(html)


if __name__ == "__main__":
    main()
