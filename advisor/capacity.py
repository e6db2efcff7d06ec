"""Capacity model: what a model's KV cache costs per token, from its architecture.

Formulas (sources in the project's reference notes on advisor tools):
- MHA/GQA: 2 (K and V) x layers x ceil(kv_heads / tp) x head_dim x bytes, using the config's own
  `head_dim` when it has one (Qwen3-32B: 128, not hidden / heads = 80);
- MLA (DeepSeek V2/V3): layers x (kv_lora_rank + qk_rope_head_dim) x bytes, not sharded by TP;
- sliding-window layers hold at most `window` tokens, so at a context length they cost
  min(context, window) / context of a full layer per token.
And what a decode step reads: a mixture-of-experts layer reads the union of the experts its
tokens route to, and tensor parallelism adds two all-reduces of the activations per layer.
It refuses to guess: a missing field is named in the error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Bytes per KV element. llama.cpp's block types carry their scales: q8_0 is 34 bytes per 32
# elements, q4_0 18, q4_1 20, q5_0 22, q5_1 24, iq4_nl 18 (ggml's block sizes); nvfp4 stores an
# fp8 scale per 16 values.
KV_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "int8": 1,
                  "int4": 0.5, "fp4": 0.5625, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32, "q5_0": 22 / 32,
                  "q5_1": 24 / 32, "iq4_nl": 18 / 32}


class MissingArchitectureField(ValueError):
    """The config lacks a field the formula needs; the message names it."""


@dataclass(frozen=True)
class Architecture:
    layers: int
    kv_heads: int | None  # None for MLA
    head_dim: int | None
    kv_lora_rank: int | None = None  # MLA
    qk_rope_head_dim: int | None = None  # MLA
    sliding_window: int | None = None
    sliding_layers: int = 0  # how many of `layers` use the window

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank is not None

    @classmethod
    def from_config(cls, cfg: dict, source: str = "config") -> Architecture:
        """From a Hugging Face config.json (the text config of a multimodal one)."""
        cfg = cfg.get("text_config", cfg)

        def need(*names: str):
            for name in names:
                if cfg.get(name) is not None:
                    return cfg[name]
            raise MissingArchitectureField(f"{source}: field {' or '.join(map(repr, names))} is missing")

        layers = need("num_hidden_layers", "n_layer", "num_layers")
        if cfg.get("kv_lora_rank") is not None:
            return cls(layers, None, None, cfg["kv_lora_rank"], need("qk_rope_head_dim"))
        heads = need("num_attention_heads", "n_head")
        kv_heads = cfg.get("num_key_value_heads") or heads  # absent means plain MHA, as transformers reads it
        head_dim = cfg.get("head_dim") or need("hidden_size", "n_embd") // heads
        window, sliding = cfg.get("sliding_window"), 0
        if window and cfg.get("layer_types"):
            sliding = sum(t == "sliding_attention" for t in cfg["layer_types"])
        elif window and cfg.get("use_sliding_window", True) and cfg.get("model_type") in ("mistral", "mixtral"):
            sliding = layers
        return cls(layers, kv_heads, head_dim, sliding_window=window if sliding else None, sliding_layers=sliding)


def kv_bytes_per_token(arch: Architecture, kv_dtype: str = "bf16", tp: int = 1, context: int | None = None) -> float:
    """KV cache bytes one token costs on one GPU, averaged over a sequence of `context` tokens
    (which only matters for sliding-window layers)."""
    if kv_dtype not in KV_DTYPE_BYTES:
        raise ValueError(f"unknown KV dtype {kv_dtype!r} (choose from {', '.join(KV_DTYPE_BYTES)})")
    size = KV_DTYPE_BYTES[kv_dtype]
    if arch.mla:
        return arch.layers * (arch.kv_lora_rank + arch.qk_rope_head_dim) * size
    per_layer = 2 * math.ceil(arch.kv_heads / tp) * arch.head_dim * size
    full = arch.layers - arch.sliding_layers
    share = min(context, arch.sliding_window) / context if arch.sliding_layers and context else 1.0
    return per_layer * (full + arch.sliding_layers * share)


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts layout: in each of `layers` MoE layers, `routed` experts of `params`
    weights each (a gated MLP: gate, up and down), `per_token` of them chosen per token. Shared
    experts, dense layers and attention are the rest of the weights, read on every step."""
    routed: int
    per_token: int
    layers: int
    params: float

    @property
    def routed_params(self) -> float:
        return self.routed * self.layers * self.params

    def touched(self, tokens: int) -> float:
        """Expected distinct experts one layer reads for `tokens` tokens, each routed to
        `per_token` of `routed` experts uniformly and independently: E(1 - (1 - k/E)^B).
        DeepSeek-V3 at 16 tokens: 256 x (1 - (248/256)^16) = 102 experts, not 8."""
        return self.routed * (1 - (1 - self.per_token / self.routed) ** tokens)

    @classmethod
    def from_config(cls, cfg: dict) -> Experts | None:
        """From a config's expert fields (Mixtral's num_local_experts, Qwen's num_experts,
        DeepSeek's n_routed_experts and first_k_dense_replace dense layers); None for a dense model."""
        routed = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
        if not routed:
            return None
        for name in ("num_experts_per_tok", "hidden_size"):
            if cfg.get(name) is None:
                raise MissingArchitectureField(f"config: field {name!r} is missing for a mixture of experts")
        width = cfg.get("moe_intermediate_size") or cfg.get("intermediate_size")
        if not width:
            raise MissingArchitectureField("config: field 'moe_intermediate_size' or 'intermediate_size' is missing")
        dense = (cfg.get("first_k_dense_replace") or 0) + len(cfg.get("mlp_only_layers") or ())
        return cls(int(routed), int(cfg["num_experts_per_tok"]), cfg["num_hidden_layers"] - dense,
                   3.0 * cfg["hidden_size"] * width)


@dataclass(frozen=True)
class Weights:
    params: int
    bytes: int
    params_by_format: dict[str, int]  # e.g. {"Q4_1": ..., "Q8_0": ..., "F32": ...}

    @property
    def bits_per_weight(self) -> float:
        return self.bytes * 8 / self.params


def gguf_weights(path) -> Weights:
    """Parameters and bytes of a GGUF file's tensors, from each tensor's quantization type
    (block and byte sizes as the `gguf` package defines them): no guess about k-quant mixes."""
    from gguf import GGUFReader
    from gguf.constants import GGML_QUANT_SIZES

    params = size = 0
    by_format: dict[str, int] = {}
    for tensor in GGUFReader(path).tensors:
        block, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
        count = int(tensor.n_elements)
        params += count
        size += count // block * block_bytes
        by_format[tensor.tensor_type.name] = by_format.get(tensor.tensor_type.name, 0) + count
    return Weights(params, size, by_format)


SAFETENSORS_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1,
                           "I32": 4, "I64": 8, "BOOL": 1}


def safetensors_weights(directory) -> Weights:
    """Parameters and bytes of a Hugging Face directory's *.safetensors, read from their headers."""
    import json
    import struct
    from pathlib import Path

    params = size = 0
    by_format: dict[str, int] = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        with open(file, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            count = math.prod(entry["shape"])
            params += count
            size += count * SAFETENSORS_DTYPE_BYTES[entry["dtype"]]
            by_format[entry["dtype"]] = by_format.get(entry["dtype"], 0) + count
    if not params:
        raise FileNotFoundError(f"{directory}: no *.safetensors weights")
    return Weights(params, size, by_format)


# -- weights by format ------------------------------------------------------------------------
# Bits per weight with the format's scales: AWQ/GPTQ store an fp16 scale and zero per group of
# 128 (4 + 32/128), MXFP4 an 8-bit scale per 32 values, NVFP4 an fp8 scale per 16.
WEIGHT_BITS = {"fp32": 32.0, "bf16": 16.0, "fp16": 16.0, "fp8": 8.0, "int8_w8a8": 8.0, "int8": 8.0, "awq": 4.25,
               "gptq": 4.25, "mxfp4": 4.25, "nvfp4": 4.5, "bitsandbytes": 4.5, "exl2": 4.5}
# llama.cpp's quantization mixes keep some tensors at higher precision, so their effective bits
# follow from the sizes `llama-quantize` lists for Llama-3-8B (8.03e9 weights; GiB) in
# tools/quantize/quantize.cpp (QUANT_OPTIONS).
_GGUF_GIB_AT_LLAMA3_8B = {"Q3_K_S": 3.41, "Q3_K_M": 3.74, "Q3_K_L": 4.03, "Q4_0": 4.34, "Q4_K_S": 4.37,
                          "Q4_K_M": 4.58, "Q5_0": 5.21, "Q5_K_S": 5.21, "Q5_K_M": 5.33, "Q6_K": 6.14, "Q8_0": 7.96}
GGUF_BITS = {name: gib * 2**30 * 8 / 8.03e9 for name, gib in _GGUF_GIB_AT_LLAMA3_8B.items()}


def bits_per_weight(fmt: str) -> float:
    """Effective bits per weight of a format: a checkpoint dtype, a quantization method, or a
    GGUF type (a llama.cpp mix such as Q4_K_M, or a pure ggml type such as Q4_1)."""
    if fmt.lower() in WEIGHT_BITS:
        return WEIGHT_BITS[fmt.lower()]
    if fmt.lower() == "gguf":  # no type named: llama.cpp's most used mix
        return GGUF_BITS["Q4_K_M"]
    if fmt.upper() in GGUF_BITS:
        return GGUF_BITS[fmt.upper()]
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[fmt.upper()]]
    except KeyError:
        known = sorted({*WEIGHT_BITS, *GGUF_BITS})
        raise ValueError(f"unknown weight format {fmt!r} (known: {', '.join(known)}, or any ggml type)") from None
    return block_bytes * 8 / block


def estimate_params(cfg: dict, source: str = "config") -> tuple[float, float]:
    """(total, active) parameters of a decoder from its config: embeddings (and an untied head),
    attention, a gated MLP (3 matrices) or its experts, norms. MLA models are left to their
    published counts: their projections are too varied to rebuild from a few fields."""
    cfg = cfg.get("text_config", cfg)
    if cfg.get("kv_lora_rank") is not None:
        raise MissingArchitectureField(f"{source}: an MLA model's parameter count is not derived from its config; "
                                       "use a catalogue entry or the weight files")

    def need(*names: str):
        for name in names:
            if cfg.get(name) is not None:
                return cfg[name]
        raise MissingArchitectureField(f"{source}: field {' or '.join(map(repr, names))} is missing")

    arch = Architecture.from_config(cfg, source)
    hidden, vocab, heads = need("hidden_size"), need("vocab_size"), need("num_attention_heads")
    attention = hidden * arch.head_dim * (2 * heads + 2 * arch.kv_heads)
    experts = Experts.from_config(cfg)
    if experts:
        # a dense layer's MLP, where there are any (DeepSeek's first layers, Llama 4's interleaved ones)
        dense = 3 * hidden * (cfg.get("intermediate_size_mlp") or cfg.get("intermediate_size") or 0)
        router = hidden * experts.routed
        # Shared experts run for every token: DeepSeek's n_shared_experts, Llama 4's one per MoE layer.
        shared = (cfg.get("n_shared_experts") or (1 if str(cfg.get("model_type")).startswith("llama4") else 0)) \
            * experts.params
        dense_layers = arch.layers - experts.layers
        mlp_total = experts.layers * (experts.routed * experts.params + router + shared) + dense_layers * dense
        mlp_active = experts.layers * (experts.per_token * experts.params + router + shared) + dense_layers * dense
    else:
        mlp_total = mlp_active = arch.layers * 3 * hidden * need("intermediate_size")
    embeddings = vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    norms = arch.layers * 2 * hidden + hidden
    return (embeddings + norms + arch.layers * attention + mlp_total,
            embeddings + norms + arch.layers * attention + mlp_active)


# -- memory -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryPlan:
    """Per device (one GPU of a tensor-parallel group, or the machine)."""
    capacity: float  # bytes
    weights: float
    reserved: float  # activations, CUDA graphs, communication buffers, the OS share
    kv_budget: float
    kv_bytes_per_token: float
    context: int

    @property
    def kv_tokens(self) -> int:
        return max(0, int(self.kv_budget // self.kv_bytes_per_token))

    @property
    def max_sequences(self) -> int:
        return self.kv_tokens // self.context

    @property
    def fits(self) -> bool:
        return self.max_sequences >= 1


def reserved_bytes(gpu: bool, devices: int, weights: float, own_gib: float | None = None) -> float:
    """What a device keeps outside weights and KV: the runtime's own figure where its matrix has
    one (llama.cpp's and Ollama's compute buffers and device context); else on a GPU 3.5 GB
    "other" plus NCCL buffers with tensor parallelism (AIConfigurator's system files, after
    vLLM-like runtimes); elsewhere 0.8 GB plus 5% of the weights (tools.metakraftlabs.com)."""
    if own_gib is not None:
        return own_gib * 2**30
    return 3.5e9 + (0.4e9 if devices > 1 else 0) if gpu else 0.8e9 + 0.05 * weights


def memory_plan(capacity: float, weights: float, kv_per_token: float, context: int, fraction_of: str,
                fraction: float | None, reserved: float) -> MemoryPlan:
    """The KV budget under a runtime's memory semantics (sources in the matrices' `memory`):
    `total`: vLLM's --gpu-memory-utilization and SGLang's --mem-fraction-static take a share of the
    device, from which weights and activations come; `free`: TensorRT-LLM's and LMDeploy's KV
    fraction is a share of what the weights left free; `none`: llama.cpp, Ollama and the built-in
    engine size the KV cache by context, so all of the usable memory may hold it."""
    if fraction_of == "total":
        budget = capacity * fraction - weights - reserved
    elif fraction_of == "free":
        budget = (capacity - weights - reserved) * fraction
    else:
        budget = capacity - weights - reserved
    return MemoryPlan(capacity, weights, reserved, max(0.0, budget), kv_per_token, context)


# -- communication ----------------------------------------------------------------------------
# One collective's fixed cost: AIConfigurator's `p2p_latency` (10 us in every one of its
# systems/*.yaml, "a nonofficial correction based on observations").
COLLECTIVE_LATENCY_S = 10e-6


def tensor_parallel_seconds(tokens: int, hidden: int, layers: int, gpus: int, link_gbs: float | None) -> float:
    """Seconds a forward pass of `tokens` spends in tensor-parallel collectives: two all-reduces of
    the bf16 activations per layer (after attention and after the MLP), each a fixed latency plus
    the ring's 2(N-1)/N of the message over one device's link (GB/s, one direction). Expert
    parallelism as vLLM and SGLang run it by default (an all-gather before the experts, a
    reduce-scatter after) moves the same bytes as the MLP's all-reduce."""
    if gpus == 1:
        return 0.0
    if not link_gbs:
        raise ValueError("a tensor-parallel estimate needs the devices' link bandwidth")
    message = tokens * hidden * 2
    return 2 * layers * (COLLECTIVE_LATENCY_S + 2 * (gpus - 1) / gpus * message / (link_gbs * 1e9))


# -- roofline ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Derates:
    """Shares of the datasheet peaks a real kernel reaches: bandwidth 0.8 (AIConfigurator's
    mem_bw_empirical_scaling_factor), prefill compute 0.45 and decode compute 0.30
    (llm-optimizer's mfu_prefill / mfu_decode). Assumptions, not facts: override them. A
    measured bandwidth is already what a kernel reached: `advise.default_derates` leaves it whole."""
    bandwidth: float = 0.8
    prefill_compute: float = 0.45
    decode_compute: float = 0.30


@dataclass(frozen=True)
class Roofline:
    bandwidth: float  # bytes/s across the devices
    flops: float | None  # FLOP/s across the devices; None when no figure is known
    derates: Derates = Derates()

    def decode_terms(self, active_weight_bytes: float, kv_bytes_read: float, active_params: float,
                     batch: int) -> tuple[float, float]:
        """Seconds per decode step of `batch` sequences if bound by memory (reading the weights once
        and each sequence's KV) and if bound by compute (the batch's matmuls)."""
        memory = (active_weight_bytes + kv_bytes_read) / (self.bandwidth * self.derates.bandwidth)
        compute = 2 * active_params * batch / (self.flops * self.derates.decode_compute) if self.flops else 0.0
        return memory, compute

    def prefill(self, active_params: float, tokens: int, layers: int, attention_dim: int,
                active_weight_bytes: float) -> float | None:
        """Seconds to prefill `tokens` (compute-bound: 2 FLOPs per active weight per token, plus
        causal attention), never less than reading the weights once; None without a FLOPS figure."""
        if not self.flops:
            return None
        flops = 2 * active_params * tokens + 2 * layers * tokens * tokens * attention_dim
        return max(flops / (self.flops * self.derates.prefill_compute),
                   active_weight_bytes / (self.bandwidth * self.derates.bandwidth))
