"""GGUF files -> a Hugging Face config dict and state dict, with the parameter names and layouts of the
official Hugging Face checkpoints.

llama.cpp's converter (`convert_hf_to_gguf.py` and its `conversion/` package) renames every tensor
(gguf-py's `tensor_mapping.py`), writes the config as `<arch>.*` metadata, and per architecture reshapes
some tensors. Each architecture's table below undoes exactly that; facts the GGUF does not carry come
from what llama.cpp hard-codes for the architecture (`src/models/<arch>.cpp`).

With `dequantize=False`, 2-D weights in a ggml type the native kernels multiply stay as they are in the
file (`quant.QuantizedWeight`); other types are dequantized.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from backends.builtin.worker.gguf_file import gguf_field
from backends.builtin.worker.quant import SUPPORTED as KERNEL_TYPES
from backends.builtin.worker.quant import QuantizedWeight


def unpermuted_rows(rows: int, num_heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's Q/K permutation (`LlamaModel.permute`, conversion/llama.py):
    it interleaves each head's two rotate-half halves for its RoPE; Hugging Face keeps them apart."""
    return torch.arange(rows).reshape(num_heads, rows // num_heads // 2, 2).transpose(1, 2).reshape(rows)


def unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    return weight[unpermuted_rows(weight.shape[0], num_heads)]


def _split_experts(layer: int, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face checkpoints keep one module per expert; llama.cpp stacks them into [E, out, in]
    (`Qwen2MoeModel.modify_tensors`, conversion/qwen.py)."""
    weights = {}
    for part, module in (("ffn_gate_exps", "gate_proj"), ("ffn_up_exps", "up_proj"), ("ffn_down_exps", "down_proj")):
        for expert, weight in enumerate(parts[f"{part}.weight"]):
            weights[f"model.layers.{layer}.mlp.experts.{expert}.{module}.weight"] = weight.clone()
    return weights


def _gpt_oss_experts(layer: int, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """gpt-oss keeps gate and up interleaved in one [E, H, 2I] (`gate_up_proj[..., ::2]` is the gate) and
    down as [E, I, H]; llama.cpp de-interleaves them into [E, I, H] gate and up and transposes down
    (`GptOssModel.modify_tensors`, conversion/gpt_oss.py)."""
    gate, up = parts["ffn_gate_exps.weight"], parts["ffn_up_exps.weight"]
    experts, intermediate, hidden = gate.shape
    prefix = f"model.layers.{layer}.mlp.experts"
    return {
        f"{prefix}.gate_up_proj": torch.stack((gate, up), dim=2).reshape(experts, 2 * intermediate, hidden)
        .transpose(1, 2).contiguous(),
        f"{prefix}.gate_up_proj_bias": torch.stack((parts["ffn_gate_exps.bias"], parts["ffn_up_exps.bias"]), dim=2)
        .reshape(experts, 2 * intermediate),
        f"{prefix}.down_proj": parts["ffn_down_exps.weight"].transpose(1, 2).contiguous(),
        f"{prefix}.down_proj_bias": parts["ffn_down_exps.bias"],
    }


def _gemma_query_scale(layers_27b: int) -> Callable[[dict, Callable], dict]:
    """llama.cpp scales queries by 1/sqrt(hidden / heads) for the 27B model, recognized by its layer count,
    and by 1/sqrt(head_dim) otherwise (src/models/gemma2.cpp, gemma3.cpp); the GGUF does not store it."""
    def derive(config: dict, meta: Callable) -> dict:
        large = config["num_hidden_layers"] == layers_27b
        return {"query_pre_attn_scalar": config["hidden_size"] // config["num_attention_heads"] if large
                else config["head_dim"]}
    return derive


def _phi3_rotary(config: dict, meta: Callable) -> dict:
    """Phi-3 writes the rotary dimensions (`rope.dimension_count`), Hugging Face the rotary fraction."""
    return {"partial_rotary_factor": (meta("rope.dimension_count") or config["head_dim"]) / config["head_dim"]}


def _gpt_oss_yarn(config: dict, meta: Callable) -> dict:
    """gpt-oss's YaRN keeps its correction range unrounded (`truncate: false` in its Hugging Face config);
    the GGUF has no key for it."""
    return {"rope_scaling": {**config["rope_scaling"], "truncate": False}} if "rope_scaling" in config else {}


@dataclass(frozen=True)
class Architecture:
    model_type: str  # Hugging Face's
    hf_class: str
    metadata: dict[str, str]  # GGUF key, less its "<arch>." -> Hugging Face config key (besides COMMON_METADATA)
    blocks: dict[str, str]  # GGUF block tensor, less its "blk.N." -> Hugging Face name, less "model.layers.N."
    fixed: dict = field(default_factory=dict)  # config facts the GGUF does not store: llama.cpp hard-codes them
    permuted_qk: bool = False  # Q/K rows permuted by the converter (llama only)
    norm_shift: float = 0.0  # the converter adds this to every norm weight
    swa_pattern: int = 0  # every n-th layer is full attention, the rest sliding, unless the GGUF says otherwise
    experts: Callable[[int, dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    derive: Callable[[dict, Callable], dict] | None = None  # config entries computed from the others and metadata


COMMON_METADATA = {
    "context_length": "max_position_embeddings", "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size", "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
}
GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}
# Tensors llama.cpp derives from the config's RoPE scaling: read back into the config.
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def _modules(**modules: str) -> dict[str, str]:
    """Each GGUF module's weight and bias (`attn_q` -> `self_attn.q_proj`)."""
    return {f"{gguf}.{kind}": f"{hf}.{kind}" for gguf, hf in modules.items() for kind in ("weight", "bias")}


ATTENTION = _modules(attn_norm="input_layernorm", attn_q="self_attn.q_proj", attn_k="self_attn.k_proj",
                     attn_v="self_attn.v_proj", attn_output="self_attn.o_proj")
QK_NORMS = _modules(attn_q_norm="self_attn.q_norm", attn_k_norm="self_attn.k_norm")
MLP = _modules(ffn_gate="mlp.gate_proj", ffn_up="mlp.up_proj", ffn_down="mlp.down_proj")
LLAMA_BLOCK = {**ATTENTION, **_modules(ffn_norm="post_attention_layernorm"), **MLP}
# Gemma norms around both attention and MLP: llama.cpp calls the pre-MLP one ffn_norm.
GEMMA_BLOCK = {**ATTENTION, **MLP, **_modules(post_attention_norm="post_attention_layernorm",
                                               ffn_norm="pre_feedforward_layernorm",
                                               post_ffw_norm="post_feedforward_layernorm")}
MOE_METADATA = {"expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
                "expert_feed_forward_length": "moe_intermediate_size"}

ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(
        "llama", "LlamaForCausalLM",
        # Mistral 7B is written as llama, its sliding window dropped by llama.cpp's converter: one only where
        # a file has it.
        {"rope.dimension_count": "head_dim", "attention.sliding_window": "sliding_window"},
        LLAMA_BLOCK, {"hidden_act": "silu"}, permuted_qk=True),
    "qwen2": Architecture("qwen2", "Qwen2ForCausalLM", {}, LLAMA_BLOCK, {"hidden_act": "silu"}),
    "qwen3": Architecture("qwen3", "Qwen3ForCausalLM", {}, {**LLAMA_BLOCK, **QK_NORMS}, {"hidden_act": "silu"}),
    "qwen3moe": Architecture(
        "qwen3_moe", "Qwen3MoeForCausalLM", MOE_METADATA,
        {**ATTENTION, **QK_NORMS, **_modules(ffn_norm="post_attention_layernorm", ffn_gate_inp="mlp.gate")},
        # llama.cpp renormalizes the chosen experts' weights (src/models/qwen3moe.cpp) and makes every layer MoE.
        {"hidden_act": "silu", "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
        experts=_split_experts),
    "gemma2": Architecture(
        "gemma2", "Gemma2ForCausalLM",
        {"attn_logit_softcapping": "attn_logit_softcapping", "final_logit_softcapping": "final_logit_softcapping",
         "attention.sliding_window": "sliding_window"},
        GEMMA_BLOCK, {"hidden_activation": "gelu_pytorch_tanh", "sliding_window": 4096},
        norm_shift=1.0, swa_pattern=2, derive=_gemma_query_scale(layers_27b=46)),
    "gemma3": Architecture(
        "gemma3_text", "Gemma3ForCausalLM",
        {"final_logit_softcapping": "final_logit_softcapping", "attention.sliding_window": "sliding_window",
         "rope.freq_base_swa": "rope_local_base_freq"},
        {**GEMMA_BLOCK, **QK_NORMS}, {"hidden_activation": "gelu_pytorch_tanh", "rope_local_base_freq": 10000.0},
        norm_shift=1.0, swa_pattern=6, derive=_gemma_query_scale(layers_27b=62)),
    "phi3": Architecture(
        "phi3", "Phi3ForCausalLM",
        {"attention.sliding_window": "sliding_window",
         "rope.scaling.original_context_length": "original_max_position_embeddings"},
        # Phi-3 keeps Q, K and V in one projection, and gate and up in one (llama.cpp's ffn_up, [2I, H]).
        _modules(attn_norm="input_layernorm", attn_qkv="self_attn.qkv_proj", attn_output="self_attn.o_proj",
                 ffn_norm="post_attention_layernorm", ffn_up="mlp.gate_up_proj", ffn_down="mlp.down_proj"),
        {"hidden_act": "silu"}, derive=_phi3_rotary),
    "gpt-oss": Architecture(
        "gpt_oss", "GptOssForCausalLM",
        {**MOE_METADATA, "expert_count": "num_local_experts", "expert_feed_forward_length": "intermediate_size",
         "attention.sliding_window": "sliding_window"},
        {**ATTENTION, **_modules(post_attention_norm="post_attention_layernorm", ffn_gate_inp="mlp.router"),
         "attn_sinks.weight": "self_attn.sinks"},
        # The SwiGLU clamp is hard-coded in llama.cpp (llama-graph.cpp, LLM_FFN_SWIGLU_OAI_MOE).
        {"hidden_act": "silu", "swiglu_limit": 7.0},
        swa_pattern=2, experts=_gpt_oss_experts, derive=_gpt_oss_yarn),
}
SUPPORTED = frozenset(ARCHITECTURES)
GGUF_TO_HF_ARCH = {arch: spec.model_type for arch, spec in ARCHITECTURES.items()}


def hf_name(name: str, architecture: str = "llama") -> str:
    """The Hugging Face name of a (non-expert) GGUF tensor; KeyError where the architecture has none."""
    if not name.startswith("blk."):
        return GLOBAL_TENSORS[name]
    _, layer, part = name.split(".", 2)
    return f"model.layers.{layer}.{ARCHITECTURES[architecture].blocks[part]}"


def read_gguf(path: str | Path, dequantize: bool = True) -> tuple[dict, dict[str, torch.Tensor | QuantizedWeight]]:
    """The Hugging Face config dict and state dict (fp32, or `QuantizedWeight` for quantized 2-D weights where
    `dequantize` is False) of a GGUF file."""
    reader = GGUFReader(path)
    arch = gguf_field(reader, "general.architecture")
    spec = ARCHITECTURES.get(arch)
    if spec is None:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(sorted(SUPPORTED))})")
    tensors = {t.name: t for t in reader.tensors}
    config = _config(reader, arch, spec, tensors)
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    experts: dict[int, dict[str, torch.Tensor]] = defaultdict(dict)
    for name, tensor in tensors.items():
        if name in ROPE_TENSORS:
            continue
        if "_exps." in name and spec.experts:
            _, layer, part = name.split(".", 2)
            experts[int(layer)][part] = _dequantized(tensor)
            continue
        try:
            target = hf_name(name, arch)
        except KeyError:
            raise ValueError(f"{path}: tensor {name} has no Hugging Face counterpart in {arch}") from None
        rows, module = None, name.split(".")[-2]
        if spec.permuted_qk and module in ("attn_q", "attn_k"):
            heads = config["num_attention_heads" if module == "attn_q" else "num_key_value_heads"]
            rows = unpermuted_rows(int(tensor.shape[-1]), heads)
        shift = spec.norm_shift if name.endswith("norm.weight") else 0.0
        weights[target] = _weight(tensor, dequantize, rows, shift)
    for layer, parts in sorted(experts.items()):
        weights.update(spec.experts(layer, parts))
    return config, weights


def _config(reader: GGUFReader, arch: str, spec: Architecture, tensors: dict) -> dict:
    def meta(key: str):
        return gguf_field(reader, f"{arch}.{key}")

    config = {"architectures": [spec.hf_class], "model_type": spec.model_type, **copy.deepcopy(spec.fixed)}
    for key, hf_key in {**COMMON_METADATA, **spec.metadata}.items():
        value = meta(key)
        if value is not None:
            config[hf_key] = _decimal(value) if isinstance(value, float) else value
    # llama.cpp's defaults where the file has no value (llama-model.cpp, load_hparams)
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    config.setdefault("rope_theta", 10000.0)
    config["vocab_size"] = int(tensors["token_embd.weight"].shape[-1])
    config["tie_word_embeddings"] = "output.weight" not in tensors
    config["attention_bias"] = "blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors
    config["bos_token_id"] = gguf_field(reader, "tokenizer.ggml.bos_token_id")
    config["eos_token_id"] = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    if "sliding_window" in config and not config["sliding_window"]:
        config["sliding_window"] = None  # 0: none (Phi-3 writes 0 for a model without one)
    if spec.swa_pattern:
        config["layer_types"] = _layer_types(meta("attention.sliding_window_pattern") or spec.swa_pattern,
                                             config["num_hidden_layers"], bool(config.get("sliding_window")))
    rope_scaling = _rope_scaling(meta, tensors)
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    if "rope_freqs.weight" in tensors:  # Llama 3's scaling, stored as one divisor per frequency
        config["rope_freq_factors"] = _decimals(tensors["rope_freqs.weight"])
    if spec.derive:
        config.update(spec.derive(config, meta))
    return config


def _layer_types(pattern: int | list[bool], layers: int, sliding: bool) -> list[str]:
    """llama.cpp's `set_swa_pattern`: with a pattern of n, every n-th layer is full attention (hparams.cpp);
    the GGUF may instead list each layer."""
    swa = pattern if isinstance(pattern, list) else [layer % pattern < pattern - 1 for layer in range(layers)]
    return ["sliding_attention" if sliding and is_swa else "full_attention" for is_swa in swa]


def _rope_scaling(meta, tensors: dict) -> dict | None:
    """Hugging Face's `rope_scaling` from the keys the converter writes for it (`TextModel.set_gguf_parameters`,
    conversion/base.py), and Phi-3's long-context factors (`Phi3MiniModel.generate_extra_tensors`)."""
    kind = meta("rope.scaling.type")
    if "rope_factors_long.weight" in tensors:
        return {"rope_type": "longrope", "long_factor": _decimals(tensors["rope_factors_long.weight"]),
                "short_factor": _decimals(tensors["rope_factors_short.weight"])}
    if kind == "linear":
        return {"rope_type": "linear", "factor": _decimal(meta("rope.scaling.factor"))}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": _decimal(meta("rope.scaling.factor")),
                   "original_max_position_embeddings": meta("rope.scaling.original_context_length")}
        for key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                            ("yarn_attn_factor", "attention_factor")):
            if meta(f"rope.scaling.{key}") is not None:
                scaling[hf_key] = _decimal(meta(f"rope.scaling.{key}"))
        return scaling
    return None


def _decimal(value: float) -> float:
    """A float32 from the file as the shortest decimal that is that float32 (1e-06, not 9.99999997e-07):
    the value of the Hugging Face config it was written from."""
    return float(str(np.float32(value)))


def _decimals(tensor) -> list[float]:
    return [_decimal(v) for v in _dequantized(tensor).tolist()]


def _dequantized(tensor) -> torch.Tensor:
    array = gguf_dequantize(tensor.data, tensor.tensor_type).reshape(tuple(reversed(tensor.shape.tolist())))
    return torch.from_numpy(np.require(array, np.float32, ["C", "W"]))  # copies read-only memmaps


def _weight(tensor, dequantize: bool, rows: torch.Tensor | None, shift: float) -> torch.Tensor | QuantizedWeight:
    """One tensor, its rows reordered by `rows`, less `shift`. A quantized 2-D weight stays quantized unless
    asked otherwise; a row reorder moves whole rows of blocks, a shift needs the values."""
    if not dequantize and tensor.tensor_type in KERNEL_TYPES and len(tensor.shape) == 2 and not shift:
        weight = QuantizedWeight.from_gguf(tensor)
        return weight if rows is None else weight.permute_rows(rows)
    weight = _dequantized(tensor)
    if rows is not None:
        weight = weight[rows]
    return weight - shift if shift else weight
