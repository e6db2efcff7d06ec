"""What the advisor knows of a model: from the catalogue (policies/catalog/models.yaml), a local
Hugging Face config.json or model directory, or a GGUF file (its metadata and tensors)."""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import yaml

from .capacity import (
    Architecture,
    Experts,
    MissingArchitectureField,
    bits_per_weight,
    estimate_params,
    gguf_weights,
    safetensors_weights,
)

CATALOG = Path(__file__).resolve().parent.parent / "policies" / "catalog" / "models.yaml"

# config.json `model_type` and GGUF `general.architecture` -> the key the support matrices use.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe",
                 "qwen3moe": "qwen3_moe", "mistral": "mistral", "mixtral": "mixtral", "gemma2": "gemma2",
                 "gemma3": "gemma3",
                 "gemma3_text": "gemma3", "phi3": "phi3", "deepseek_v3": "deepseek_v3", "deepseek2": "deepseek_v3",
                 "gpt_oss": "gpt_oss", "gpt-oss": "gpt_oss", "llama4": "llama4", "llama4_text": "llama4"}
_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
# Checkpoint formats that quantize only the experts: gpt-oss's MXFP4 checkpoints keep attention,
# router, embeddings and head in bf16 (their config's quantization_config.modules_to_not_convert).
EXPERTS_ONLY_FORMATS = {"mxfp4"}
_FILE_DTYPES = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F8_E4M3": "fp8", "F8_E5M2": "fp8", "I8": "int8"}


class UnknownModel(ValueError):
    """Neither a catalogue id nor a readable local path; the message names the nearest ids."""


@dataclass(frozen=True)
class ModelSpec:
    id: str
    architecture: str  # the matrices' key ("" when the family is unknown to them)
    arch: Architecture
    params_total: float
    params_active: float
    max_context: int
    attention_dim: int  # query heads x head dim, for prefill attention FLOPs
    hidden_size: int  # the width of most decode matrix-vector rows; 0 when the config lacks it
    checkpoint_format: str  # bf16, fp8, mxfp4, or a GGUF type
    experts: Experts | None = None
    scaled_context: int | None = None  # with the RoPE scaling its card documents (YaRN), off by default
    scaling_note: str = ""
    weights_bytes: float | None = None  # exact, when read from the weight files
    source: str = ""
    heads: int = 0  # query heads
    vocab_size: int = 0
    mlp_width: int = 0  # a dense layer's MLP intermediate size

    @property
    def moe(self) -> bool:
        return self.experts is not None

    def lora_params(self, rank: int) -> float:
        """Parameters of one LoRA adapter of `rank` on the linear layers vLLM and SGLang target by
        default: q, k, v and o, and in dense layers gate, up and down; rank x (in + out) each."""
        if not rank:
            return 0.0
        h, q, kv = self.hidden_size, self.attention_dim, 2 * (self.arch.kv_heads or 0) * (self.arch.head_dim or 0)
        mlp = 0 if self.experts else self.mlp_width
        per_layer = (h + q + kv) + (q + h) + ((h + 2 * mlp) + (mlp + h) if mlp else 0)
        return rank * per_layer * self.arch.layers

    def weight_bytes(self, fmt: str, tokens: int | None = None) -> float:
        """Bytes of the weights in format `fmt`: all of them (`tokens` None), or those one forward
        pass of `tokens` tokens reads: the weights every token uses (the active count less its
        routed experts) and, per MoE layer, the union of the experts the tokens route to."""
        bits = bits_per_weight(fmt)
        if self.experts is None:
            return (self.params_total if tokens is None else self.params_active) * bits / 8
        e = self.experts
        routed = e.routed_params if tokens is None else e.layers * e.touched(tokens) * e.params
        rest = (self.params_total - e.routed_params if tokens is None
                else self.params_active - e.layers * e.per_token * e.params)
        rest_bits = bits_per_weight("bf16") if fmt.lower() in EXPERTS_ONLY_FORMATS else bits
        return routed * bits / 8 + max(0.0, rest) * rest_bits / 8


@cache
def catalogue() -> dict:
    return yaml.safe_load(CATALOG.read_text())


def resolve(model: str) -> ModelSpec:
    entries = catalogue()["models"]
    if model in entries:
        entry, sources = entries[model], catalogue()["sources"]
        spec = _from_config(model, entry["config"], source=sources[entry["source"]]["ref"],
                            total=entry["params_total"], active=entry.get("params_active"),
                            checkpoint=entry.get("checkpoint_format"))
        if scaling := entry.get("rope_scaling"):
            native = scaling["original_max_position_embeddings"]
            spec = replace(spec, scaled_context=int(native * scaling["factor"]), scaling_note=(
                f"{scaling['type']} RoPE scaling, factor {scaling['factor']:g} over its native {native} tokens "
                f"({sources[scaling['source']]['ref']})"))
        return spec
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return _from_gguf(path)
    if path.name == "config.json" and path.is_file():
        return _from_config(str(path.parent), json.loads(path.read_text()), source=str(path))
    if path.is_dir() and (path / "config.json").is_file():
        cfg = json.loads((path / "config.json").read_text())
        exact = safetensors_weights(path) if any(path.glob("*.safetensors")) else None
        return _from_config(str(path), cfg, source=str(path / "config.json"), exact=exact)
    near = difflib.get_close_matches(model, list(entries), n=3, cutoff=0.4)
    raise UnknownModel(f"model {model!r} is neither in the catalogue nor a local config.json, model directory or "
                       f".gguf file" + (f"; did you mean {', '.join(near)}?" if near else
                                        f"; catalogue: {', '.join(entries)}"))


def _from_config(name: str, cfg: dict, source: str, total: float | None = None, active: float | None = None,
                 checkpoint: str | None = None, exact=None) -> ModelSpec:
    text = cfg.get("text_config", cfg)
    arch = Architecture.from_config(text, source)
    if exact is not None:
        total = exact.params
    if total is None:
        total, active = estimate_params(text, source)
    if active is None:  # dense: all of them; experts: the config's routed share
        active = total
        if Experts.from_config(text):
            estimated_total, estimated_active = estimate_params(text, source)
            active = total * estimated_active / estimated_total
    context = text.get("max_position_embeddings")
    if not context:
        raise MissingArchitectureField(f"{source}: field 'max_position_embeddings' is missing")
    heads = text.get("num_attention_heads") or 0
    if arch.mla:
        query_dim = text.get("qk_nope_head_dim", 0) + arch.qk_rope_head_dim
    else:
        query_dim = arch.head_dim
    if exact is not None:
        checkpoint = _FILE_DTYPES.get(max(exact.params_by_format, key=exact.params_by_format.get))
    fmt = checkpoint or _DTYPES.get(str(text.get("torch_dtype") or cfg.get("torch_dtype") or "bfloat16"), "bf16")
    return ModelSpec(name, ARCHITECTURES.get(text.get("model_type", ""), ""), arch, float(total), float(active),
                     int(context), heads * query_dim, int(text.get("hidden_size") or text.get("n_embd") or 0), fmt,
                     Experts.from_config(text), exact.bytes if exact else None, source, heads=int(heads),
                     vocab_size=int(text.get("vocab_size") or 0),
                     mlp_width=int(text.get("intermediate_size_mlp") or text.get("intermediate_size") or 0))


def _from_gguf(path: Path) -> ModelSpec:
    """A GGUF's architecture from its metadata (`<arch>.block_count`, `.attention.head_count`...)
    and its exact weights from its tensors."""
    from gguf import GGUFReader

    reader = GGUFReader(path)

    def field(key: str):
        item = reader.fields.get(key)
        return None if item is None else item.contents()

    family = field("general.architecture")
    if family is None:
        raise MissingArchitectureField(f"{path}: no general.architecture in its metadata")
    cfg = {"model_type": family, "num_hidden_layers": field(f"{family}.block_count"),
           "hidden_size": field(f"{family}.embedding_length"),
           "num_attention_heads": field(f"{family}.attention.head_count"),
           "num_key_value_heads": field(f"{family}.attention.head_count_kv"),
           "head_dim": field(f"{family}.attention.key_length"),
           "max_position_embeddings": field(f"{family}.context_length"),
           "kv_lora_rank": field(f"{family}.attention.kv_lora_rank"),
           "sliding_window": field(f"{family}.attention.sliding_window")}
    if cfg["kv_lora_rank"] is not None:
        cfg["qk_rope_head_dim"] = field(f"{family}.rope.dimension_count")
    weights = gguf_weights(path)
    count, used = field(f"{family}.expert_count"), field(f"{family}.expert_used_count")
    experts, active = None, weights.params
    if count:  # the routed experts' tensors (blk.N.ffn_{gate,up,down}_exps), one per MoE layer
        tensors = [t for t in reader.tensors if "_exps" in t.name]
        layers = len({t.name.split(".")[1] for t in tensors})
        routed = sum(int(t.n_elements) for t in tensors)
        experts = Experts(int(count), int(used), layers, routed / (count * layers))
        active = weights.params - routed + routed * used / count
    main = max(weights.params_by_format, key=weights.params_by_format.get)
    spec = _from_config(str(path), {k: v for k, v in cfg.items() if v is not None}, source=str(path),
                        total=weights.params, active=active, checkpoint=main)
    return ModelSpec(**{**spec.__dict__, "architecture": ARCHITECTURES.get(family, ""), "experts": experts,
                        "weights_bytes": float(weights.bytes)})
