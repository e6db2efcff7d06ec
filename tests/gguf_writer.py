"""GGUF files written from Hugging Face models the way llama.cpp's `convert_hf_to_gguf.py` writes them
(its `conversion/` package): each architecture's metadata keys, gguf-py's tensor names, and the
converter's transforms (Q/K rows permuted for llama, Gemma's norms + 1, experts stacked, gpt-oss's gate
and up de-interleaved, RoPE scaling as tensors), with the default model's byte-level BPE tokenizer.
For tests: llama.cpp's converter is not installed, and nothing is downloaded.
"""

from __future__ import annotations

import functools
import json
import math
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import MODEL_ARCH, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from safetensors.torch import load_file

from backends.default_model import default_model_path

# Hugging Face model_type -> the architecture the converter writes it as (Mistral: as llama).
ARCHITECTURES = {
    "llama": MODEL_ARCH.LLAMA, "mistral": MODEL_ARCH.LLAMA, "qwen2": MODEL_ARCH.QWEN2, "qwen3": MODEL_ARCH.QWEN3,
    "qwen3_moe": MODEL_ARCH.QWEN3MOE, "gemma2": MODEL_ARCH.GEMMA2, "gemma3_text": MODEL_ARCH.GEMMA3,
    "phi3": MODEL_ARCH.PHI3, "gpt_oss": MODEL_ARCH.GPT_OSS,
}


def write_gguf(model, path: str | Path, qtype: str = "F32", tokenizer: bool = True) -> Path:
    """`model`: a transformers model, or the directory it was saved to. `qtype`: the ggml type of every
    weight matrix (F32, F16, Q8_0, Q4_0, Q4_1, ...); 1-D tensors, norms, biases and routers stay F32 as
    the converter keeps them. MXFP4 quantizes the experts only, as gpt-oss's GGUFs ship. Without
    `tokenizer`, the file has no vocabulary: quicker to read, for tests of the weights alone."""
    with tempfile.TemporaryDirectory() as scratch:
        if isinstance(model, (str, Path)):
            directory = Path(model)
        else:
            model.save_pretrained(scratch)
            directory = Path(scratch)
        hparams = json.loads((directory / "config.json").read_text())
        tensors = {}
        for file in sorted(directory.glob("*.safetensors")):
            tensors.update(load_file(file))
    arch = ARCHITECTURES[hparams["model_type"]]
    qtype = GGMLQuantizationType[qtype]
    writer = GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    rope = _rope(hparams)
    METADATA[arch](writer, hparams, rope)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype == GGMLQuantizationType.F32 else
                         gguf.LlamaFileType.MOSTLY_MXFP4_MOE if qtype == GGMLQuantizationType.MXFP4 else
                         gguf.LlamaFileType[f"MOSTLY_{qtype.name}"])
    for name, value, value_type, item_type in _default_tokenizer() if tokenizer else ():
        writer.add_key_value(name, value, value_type, item_type)
    names = gguf.get_tensor_name_map(arch, hparams["num_hidden_layers"])
    for name, tensor in [*_extra_tensors(arch, hparams, rope), *_converted(arch, hparams, tensors)]:
        gguf_name = name if name in _EXTRA_NAMES else names.get_name(name, try_suffixes=(".weight", ".bias"))
        array = tensor.float().numpy()
        try:
            data_type = _ggml_type(gguf_name, array, qtype)
            data = gguf.quants.quantize(array, data_type)
        except gguf.QuantError:  # a row length the type cannot hold: the converter falls back to F16
            data_type = GGMLQuantizationType.F16
            data = gguf.quants.quantize(array, data_type)
        writer.add_tensor(gguf_name, data, raw_dtype=data_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def _rope(hparams: dict) -> dict:
    """The full-attention layers' RoPE parameters, in transformers 5's `rope_parameters` form, with the
    sliding layers' base as `local_rope_theta` (`TextModel.__init__`, conversion/base.py)."""
    rope = hparams.get("rope_parameters") or hparams.get("rope_scaling") or {}
    full = dict(rope.get("full_attention", rope))
    full.setdefault("rope_theta", hparams.get("rope_theta"))
    full.setdefault("rope_type", full.get("type"))
    full.setdefault("partial_rotary_factor", hparams.get("partial_rotary_factor", 1.0))
    full.setdefault("original_max_position_embeddings", hparams.get("original_max_position_embeddings"))
    full["local_rope_theta"] = rope.get("sliding_attention", {}).get("rope_theta", hparams.get("rope_local_base_freq"))
    return full


def _head_dim(hparams: dict) -> int:
    return hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"]


def _text_model(writer: GGUFWriter, hparams: dict, rope: dict) -> None:
    """`TextModel.set_gguf_parameters` (conversion/base.py)."""
    writer.add_block_count(hparams["num_hidden_layers"])
    writer.add_context_length(hparams["max_position_embeddings"])
    writer.add_embedding_length(hparams["hidden_size"])
    writer.add_feed_forward_length(hparams["intermediate_size"])
    writer.add_head_count(hparams["num_attention_heads"])
    writer.add_head_count_kv(hparams["num_key_value_heads"])
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope["rope_type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if "attention_factor" in rope:
            writer.add_rope_scaling_yarn_attn_factor(rope["attention_factor"])
        if "beta_fast" in rope:
            writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if "beta_slow" in rope:
            writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if rope["rope_theta"] is not None:
        writer.add_rope_freq_base(rope["rope_theta"])
    if rope["local_rope_theta"] is not None:
        writer.add_rope_freq_base_swa(rope["local_rope_theta"])
    writer.add_layer_norm_rms_eps(hparams["rms_norm_eps"])
    experts = hparams.get("num_local_experts", hparams.get("num_experts"))
    if experts is not None:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(hparams["num_experts_per_tok"])
    if "head_dim" in hparams:
        writer.add_key_length(hparams["head_dim"])
        writer.add_value_length(hparams["head_dim"])


def _llama(writer: GGUFWriter, hparams: dict, rope: dict) -> None:
    """`LlamaModel.set_gguf_parameters` (conversion/llama.py)."""
    _text_model(writer, hparams, rope)
    writer.add_vocab_size(hparams["vocab_size"])
    writer.add_rope_dimension_count(_head_dim(hparams))


def _qwen3_moe(writer: GGUFWriter, hparams: dict, rope: dict) -> None:
    """`Qwen2MoeModel.set_gguf_parameters` (conversion/qwen.py)."""
    _text_model(writer, hparams, rope)
    writer.add_expert_feed_forward_length(hparams["moe_intermediate_size"])


def _gemma2(writer: GGUFWriter, hparams: dict, rope: dict) -> None:
    """`Gemma2Model.set_gguf_parameters` (conversion/gemma.py): no RoPE base, llama.cpp's default."""
    writer.add_context_length(hparams["max_position_embeddings"])
    writer.add_embedding_length(hparams["hidden_size"])
    writer.add_block_count(hparams["num_hidden_layers"])
    writer.add_feed_forward_length(hparams["intermediate_size"])
    writer.add_head_count(hparams["num_attention_heads"])
    writer.add_head_count_kv(hparams["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(hparams["rms_norm_eps"])
    writer.add_key_length(hparams["head_dim"])
    writer.add_value_length(hparams["head_dim"])
    writer.add_attn_logit_softcapping(hparams["attn_logit_softcapping"])
    writer.add_final_logit_softcapping(hparams["final_logit_softcapping"])
    writer.add_sliding_window(hparams["sliding_window"])


def _gemma3(writer: GGUFWriter, hparams: dict, rope: dict) -> None:
    """`Gemma3Model.set_gguf_parameters` (conversion/gemma.py), less the values it writes again unchanged."""
    _text_model(writer, hparams, rope)
    if hparams.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(hparams["final_logit_softcapping"])
    if hparams.get("sliding_window_pattern") != 1:
        writer.add_sliding_window(hparams["sliding_window"])


def _phi3(writer: GGUFWriter, hparams: dict, rope: dict) -> None:
    """`Phi3MiniModel.set_gguf_parameters` and the attention factor of its long-context scaling
    (conversion/phi.py)."""
    heads, original = hparams["num_attention_heads"], rope["original_max_position_embeddings"]
    writer.add_context_length(hparams["max_position_embeddings"])
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_embedding_length(hparams["hidden_size"])
    writer.add_feed_forward_length(hparams["intermediate_size"])
    writer.add_block_count(hparams["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(hparams["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(hparams["rms_norm_eps"])
    writer.add_rope_dimension_count(int(rope["partial_rotary_factor"] * hparams["hidden_size"]) // heads)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_sliding_window(hparams.get("sliding_window") or 0)
    if rope.get("long_factor"):
        scale = hparams["max_position_embeddings"] / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)


def _gpt_oss(writer: GGUFWriter, hparams: dict, rope: dict) -> None:
    """`GptOssModel.set_gguf_parameters` (conversion/gpt_oss.py)."""
    _text_model(writer, hparams, rope)
    writer.add_sliding_window(hparams["sliding_window"])
    writer.add_expert_feed_forward_length(hparams["intermediate_size"])


METADATA = {
    MODEL_ARCH.LLAMA: _llama, MODEL_ARCH.QWEN2: _text_model, MODEL_ARCH.QWEN3: _text_model,
    MODEL_ARCH.QWEN3MOE: _qwen3_moe, MODEL_ARCH.GEMMA2: _gemma2, MODEL_ARCH.GEMMA3: _gemma3,
    MODEL_ARCH.PHI3: _phi3, MODEL_ARCH.GPT_OSS: _gpt_oss,
}
_EXTRA_NAMES = {f"{gguf.TENSOR_NAMES[t]}.weight" for t in (gguf.MODEL_TENSOR.ROPE_FREQS,
                                                          gguf.MODEL_TENSOR.ROPE_FACTORS_LONG,
                                                          gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT)}


def _extra_tensors(arch: MODEL_ARCH, hparams: dict, rope: dict):
    """RoPE scaling written as tensors: Llama 3's per-frequency divisors (`LlamaModel.generate_extra_tensors`,
    conversion/llama.py) and Phi-3's long-context factors (`Phi3MiniModel.generate_extra_tensors`)."""
    if arch == MODEL_ARCH.LLAMA and rope["rope_type"] == "llama3":
        dim = _head_dim(hparams)
        freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old_context = rope["original_max_position_embeddings"]
        factors = []
        for freq in freqs:  # float32 arithmetic, as the converter's
            wavelength = 2 * math.pi / freq
            if wavelength < old_context / high:
                factors.append(1.0)
            elif wavelength > old_context / low:
                factors.append(factor)
            else:
                smooth = (old_context / wavelength - low) / (high - low)
                factors.append(1 / ((1 - smooth) / factor + smooth))
        yield "rope_freqs.weight", torch.tensor(factors, dtype=torch.float32)
    if arch == MODEL_ARCH.PHI3 and rope.get("long_factor"):
        yield "rope_factors_long.weight", torch.tensor(rope["long_factor"], dtype=torch.float32)
        yield "rope_factors_short.weight", torch.tensor(rope["short_factor"], dtype=torch.float32)


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """`LlamaModel.permute` (conversion/llama.py): each head's rotate-half halves interleaved."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2) \
        .reshape(weight.shape)


def _converted(arch: MODEL_ARCH, hparams: dict, tensors: dict[str, torch.Tensor]):
    """The checkpoint's tensors as each architecture's `modify_tensors` hands them to the writer, under
    names gguf-py's tensor map knows."""
    experts: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if arch == MODEL_ARCH.GEMMA2 and name == "lm_head.weight":
            continue  # Gemma2Model.filter_tensors: tied to the embeddings
        if arch == MODEL_ARCH.LLAMA and name.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = _permute(tensor, hparams["num_attention_heads"])
        if arch == MODEL_ARCH.LLAMA and name.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = _permute(tensor, hparams["num_key_value_heads"])
        if arch in (MODEL_ARCH.GEMMA2, MODEL_ARCH.GEMMA3) and name.endswith("norm.weight"):
            tensor = tensor + 1  # Gemma's RMSNorm scales by (1 + weight); llama.cpp's by the weight
        if arch == MODEL_ARCH.QWEN3MOE and ".mlp.experts." in name:
            experts[name] = tensor
            continue
        if arch == MODEL_ARCH.GPT_OSS:
            yield from _gpt_oss_tensor(name, tensor)
            continue
        yield name, tensor
    # Qwen2MoeModel.modify_tensors (conversion/qwen.py): each layer's experts stacked into [E, out, in]
    layers = hparams["num_hidden_layers"] if experts else 0
    for layer in range(layers):
        for module in ("gate_proj", "up_proj", "down_proj"):
            stack = [experts.pop(f"model.layers.{layer}.mlp.experts.{e}.{module}.weight")
                     for e in range(hparams.get("num_local_experts", hparams.get("num_experts")))]
            yield f"model.layers.{layer}.mlp.experts.{module}.weight", torch.stack(stack)


def _gpt_oss_tensor(name: str, tensor: torch.Tensor):
    """`GptOssModel.modify_tensors` (conversion/gpt_oss.py), for a checkpoint in bf16 (not MXFP4) layout:
    the experts' [E, in, out] matrices transposed, gate and up (interleaved in one) split apart."""
    if name.endswith("sinks"):
        yield f"{name}.weight", tensor
    elif name.endswith("down_proj_bias"):
        yield name.replace("down_proj_bias", "down_proj.bias"), tensor
    elif name.endswith("down_proj"):
        yield f"{name}.weight", tensor.transpose(-1, -2)
    elif name.endswith("gate_up_proj_bias"):
        yield name.replace("gate_up_proj_bias", "gate_proj.bias"), tensor[..., ::2]
        yield name.replace("gate_up_proj_bias", "up_proj.bias"), tensor[..., 1::2]
    elif name.endswith("gate_up_proj"):
        tensor = tensor.transpose(-1, -2)
        yield name.replace("gate_up_proj", "gate_proj.weight"), tensor[:, ::2, :]
        yield name.replace("gate_up_proj", "up_proj.weight"), tensor[:, 1::2, :]
    else:
        yield name, tensor


def _ggml_type(gguf_name: str, array: np.ndarray, qtype: GGMLQuantizationType) -> GGMLQuantizationType:
    """The converter's choice (`ModelBase.prepare_tensors`, conversion/base.py): F32 for 1-D tensors, norms,
    biases and routers, the requested type for the rest."""
    if (array.ndim <= 1 or gguf_name.endswith("_norm.weight") or not gguf_name.endswith(".weight")
            or ".ffn_gate_inp." in gguf_name):
        return GGMLQuantizationType.F32
    if qtype == GGMLQuantizationType.MXFP4 and "_exps." not in gguf_name:
        return GGMLQuantizationType.F32
    return qtype


@functools.cache
def _default_tokenizer() -> list[tuple[str, object, GGUFValueType, GGUFValueType | None]]:
    """Every `tokenizer.*` field of the default model's GGUF (SmolLM2's byte-level BPE): name, value,
    type and item type. Read once: parsing 49,152 tokens and their merges takes seconds."""
    return [(name, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
            for name, field in GGUFReader(default_model_path()).fields.items() if name.startswith("tokenizer.")]
