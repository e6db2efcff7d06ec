"""Decode-step cost of the built-in engine against its bound, on the default model.

The bound is what any exact implementation must do for one decode step: the model's weight
GEMMs at batch B, plus one exact attention pass over the same KV laid out contiguously.
Usage: python benchmarks/decode_step.py [--batch 32] [--context 512] [--steps 20] [--attention auto|native|torch]
       [--weight-quant none|int8] [--dtype auto|float32|bfloat16] [--profile] [--onednn]
       [--groups G --shared N]
--groups/--shared: the sequences fall in G groups (taken in turn) whose prompts share their first N
tokens, as the served shared-prefix load's do; the prefix cache then holds each group's prefix once.
--profile prints where a decode step's time goes, by operator (torch.profiler); --onednn keeps
bf16 Linears on oneDNN where the native GEMM would serve them (to compare the two).
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
import torch.nn.functional as F

from backends.builtin.config import EngineConfig
from backends.builtin.core.engine import LLMEngine
from backends.builtin.core.sequence import SamplingParams


def timed(fn, repeat: int, device: torch.device | None = None) -> float:
    def finished():  # a CUDA device runs the calls after they return
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    finished()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    finished()
    return (time.perf_counter() - start) / repeat


def bound_ms(engine: LLMEngine, batch: int, context: int, repeat: int) -> tuple[float, float]:
    """(bare weight GEMMs, contiguous exact attention) in ms for one decode step."""
    model, cfg = engine.runner.model, engine.loaded.config
    dtype, device = engine.runner.dtype, engine.runner.device
    x = torch.randn(batch, cfg.hidden_size, dtype=dtype, device=device)
    h = torch.randn(batch, cfg.intermediate_size, dtype=dtype, device=device)

    @torch.inference_mode()
    def gemms():  # every layer's own weights: one layer's would stay in the CPU's last-level cache
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj(x), attn.o_proj(x), mlp.gate_up_proj(x), mlp.down_proj(h)
        model.lm_head(x)

    q = torch.randn(batch, cfg.num_attention_heads, 1, cfg.head_dim, dtype=dtype, device=device)
    k = torch.randn(batch, cfg.num_key_value_heads, context, cfg.head_dim, dtype=dtype, device=device)
    v = torch.randn_like(k)

    @torch.inference_mode()
    def attention():
        for _ in range(cfg.num_hidden_layers):
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    return timed(gemms, repeat, device) * 1000, timed(attention, repeat, device) * 1000


def prompt(i: int, context: int, groups: int, shared: int) -> list[int]:
    """Sequence i's prompt: its group's first `shared` tokens (with groups), then its own."""
    own = [(i * 131 + j * 7) % 40000 + 100 for j in range(context)]
    if not groups:
        return own
    return [(i % groups * 997 + j * 13) % 40000 + 100 for j in range(shared)] + own[shared:]


def decode_step_ms(engine: LLMEngine, batch: int, context: int, steps: int, around=None, groups: int = 0,
                   shared: int = 0) -> float:
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", prompt(i, context, groups, shared), params)
    sched = engine.scheduler
    while sched.num_waiting or any(s.num_output_tokens == 0 for s in sched.running):
        engine.step()  # prefill everything first
    with around or contextlib.nullcontext():  # the decode steps alone
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        elapsed = (time.perf_counter() - start) / steps * 1000
    for i in range(batch):
        engine.abort(f"r{i}")
    return elapsed


def kernel_ms(engine: LLMEngine, batch: int, context: int, repeat: int) -> float | None:
    """The native paged-attention kernel alone over every layer's worth of one step: `batch` query
    tokens with `context` keys each, in the engine's dtype, each layer its own cache with its blocks
    in a random order (one cache read 30 times would stay in the CPU's last-level cache); None where
    the kernel is off."""
    from backends.builtin.worker import kernels
    from backends.builtin.worker.attention import LayerKV

    if not engine.runner.use_kernel:
        return None
    cfg, block_size = engine.loaded.config, engine.config.block_size
    blocks = -(-context // block_size)
    caches = [LayerKV.allocate(batch * blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
                               engine.runner.dtype, torch.device("cpu"), False)
              for _ in range(cfg.num_hidden_layers)]
    for cache in caches:
        cache.data.normal_()
    tables = torch.randperm(batch * blocks).view(batch, blocks)
    positions = torch.full((batch,), context - 1)
    q = torch.randn(batch, cfg.num_attention_heads, cfg.head_dim, dtype=engine.runner.dtype)

    def layers():
        for cache in caches:
            kernels.paged_attention(q, cache, tables, positions, cfg.head_dim**-0.5)

    return min(timed(layers, repeat) for _ in range(5)) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--attention", default="auto", help="auto | native | torch")
    parser.add_argument("--weight-quant", default="none", help="none | int8 (the bound then uses int8 GEMMs too)")
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16")
    parser.add_argument("--profile", action="store_true", help="the top operators of the timed steps")
    parser.add_argument("--onednn", action="store_true", help="bf16 Linears on oneDNN, not the native GEMM")
    parser.add_argument("--groups", type=int, default=0, help="groups of sequences sharing a prompt prefix")
    parser.add_argument("--shared", type=int, default=0, help="tokens of that prefix (with --groups)")
    args = parser.parse_args()
    if args.onednn:
        from backends.builtin.worker import kernels

        kernels.bf16_linear = lambda device, dtype: None  # the runner then prepacks every Linear for oneDNN
    engine = LLMEngine(EngineConfig(kv_cache_tokens=args.batch * (args.context + args.steps + 32),
                                    attention=args.attention, weight_quant=args.weight_quant, dtype=args.dtype))
    profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if args.profile else None
    step = decode_step_ms(engine, args.batch, args.context, args.steps, profile, args.groups, args.shared)
    if profile is not None:
        print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    gemm, attention = bound_ms(engine, args.batch, args.context, args.steps)
    bound = gemm + attention
    kind = "native kernel" if engine.runner.use_kernel else "PyTorch gather + SDPA"
    linears = type(engine.runner.model.lm_head).__name__  # PairedLinear: the native bf16 GEMM
    shared = f", {args.groups} groups sharing {args.shared} tokens" if args.groups else ""
    print(f"decode step ({kind}, {engine.runner.dtype}, {linears}), batch {args.batch}, context {args.context}"
          f"{shared}: {step:.1f} ms")
    print(f"bound: bare GEMMs {gemm:.1f} ms + contiguous attention {attention:.1f} ms = {bound:.1f} ms")
    print(f"ratio: {step / bound:.2f}x")
    kernel = kernel_ms(engine, args.batch, args.context, args.steps)
    if kernel is not None:
        print(f"of which the attention kernel alone, {engine.runner.model.config.num_hidden_layers} layers: "
              f"{kernel:.1f} ms (best of 5)")


if __name__ == "__main__":
    main()
