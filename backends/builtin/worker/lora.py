"""LoRA adapters, many in one step: read from PEFT's files (or llama.cpp's GGUF conversion of them),
held in host memory, and copied into a
bounded number of compute slots (least recently used out) that each targeted Linear adds from,
every token with its own sequence's adapter (`csrc/lora.cpp`, S-LoRA's gather-matmul).

An adapter changes `W x` into `W x + scaling * B (A x)`; the scaling (PEFT's `lora_alpha / r`,
or `/ sqrt(r)` with rsLoRA) is folded into B when the adapter enters a slot.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from backends.builtin.worker.gguf_file import gguf_field
from backends.builtin.worker.gguf_weights import hf_name, unpermute
from backends.builtin.worker.models import PACKED
from backends.builtin.worker.models.config import ModelConfig

# The projections an adapter may target, by Hugging Face's module names (PEFT's `target_modules`).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The model's Linear layers that adapters reach, and the projections each runs (fused ones in order).
LAYER_MODULES = {"self_attn.qkv_proj": PACKED["self_attn.qkv_proj"], "self_attn.o_proj": ("self_attn.o_proj",),
                 "mlp.gate_up_proj": PACKED["mlp.gate_up_proj"], "mlp.down_proj": ("mlp.down_proj",)}


@dataclass
class LoRAWeights:
    """An adapter's factors by Hugging Face module name ("model.layers.0.self_attn.q_proj"):
    A [r, in] and B [out, r] already scaled, float32 on the CPU."""

    rank: int  # the largest of its modules' ranks
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_adapter(path: str | Path, config: ModelConfig, max_rank: int) -> LoRAWeights:
    """A PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) or a GGUF LoRA file,
    checked against the model: ValueError naming what does not fit."""
    path = Path(path)
    adapter = _read_gguf(path, config) if path.suffix == ".gguf" else _read_peft(path)
    for module, (a, b) in adapter.items():
        rank = a.shape[0]
        if rank > max_rank:
            raise ValueError(f"{path}: rank {rank} of {module} exceeds max_lora_rank {max_rank}")
        expected_in, expected_out = _shape(config, module)
        if tuple(a.shape) != (rank, expected_in) or tuple(b.shape) != (expected_out, rank):
            raise ValueError(f"{path}: {module} has factors {tuple(a.shape)} and {tuple(b.shape)}, this model "
                             f"needs ({rank}, {expected_in}) and ({expected_out}, {rank})")
    if not adapter:
        raise ValueError(f"{path}: no LoRA factors in the adapter's weights")
    return LoRAWeights(max(a.shape[0] for a, _ in adapter.values()), adapter)


def _read_peft(directory: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """PEFT's factors by module, B scaled by `lora_alpha / r` (its per-module `alpha_pattern`, rsLoRA's
    `/ sqrt(r)`), the settings this engine cannot apply refused by name."""
    config_file = directory / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"{directory} is not a PEFT adapter directory (no adapter_config.json) nor a GGUF file")
    spec = json.loads(config_file.read_text())
    if spec.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{directory}: peft_type {spec['peft_type']!r} is not LORA")
    for key, refusal in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save (full layers)"),
                         ("fan_in_fan_out", "fan_in_fan_out")):
        if spec.get(key):
            raise ValueError(f"{directory}: {refusal} is not supported")
    if spec.get("bias", "none") != "none":
        raise ValueError(f"{directory}: LoRA bias {spec['bias']!r} is not supported (only 'none')")
    weights = _read_tensors(directory)
    factors = {}
    for key, a in weights.items():
        if ".lora_A." not in key:
            if ".lora_B." not in key:
                raise ValueError(f"{directory}: tensor {key} is not a LoRA factor")
            continue
        module = key.split(".lora_A.")[0].removeprefix("base_model.model.")
        b = weights.get(key.replace(".lora_A.", ".lora_B."))
        if b is None:
            raise ValueError(f"{directory}: {module} has lora_A but no lora_B")
        if module.rsplit(".", 1)[-1] not in TARGETS:
            raise ValueError(f"{directory}: target {module} is not supported (supported: {', '.join(TARGETS)})")
        rank = a.shape[0]
        alpha = _pattern(spec.get("alpha_pattern"), module, spec.get("lora_alpha", 8))
        scaling = alpha / math.sqrt(rank) if spec.get("use_rslora") else alpha / rank
        factors[module] = (a.float(), b.float() * scaling)
    return factors


def _read_gguf(path: Path, config: ModelConfig) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """llama.cpp's LoRA GGUF (`convert_lora_to_gguf.py`): `general.type` adapter, `adapter.type` lora,
    tensors `<base tensor>.lora_a` [r, in] and `.lora_b` [out, r], Q and K's B rows in the base's
    interleaved-RoPE order; scaled as llama.cpp's `build_lora_mm` scales them: `adapter.lora.alpha / r`,
    or 1 without an alpha."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    if gguf_field(reader, "general.type") != "adapter" or gguf_field(reader, "adapter.type") != "lora":
        raise ValueError(f"{path} is not a GGUF LoRA adapter (general.type adapter, adapter.type lora)")
    alpha = gguf_field(reader, "adapter.lora.alpha", 0.0)
    architecture = gguf_field(reader, "general.architecture", "llama")
    tensors = {}
    for tensor in reader.tensors:
        array = dequantize(tensor.data, tensor.tensor_type).reshape(tuple(reversed(tensor.shape.tolist())))
        tensors[tensor.name] = torch.from_numpy(array.astype("float32"))
    factors = {}
    for name, a in tensors.items():
        if not name.endswith(".lora_a"):
            continue
        base = name.removesuffix(".lora_a")
        b = tensors.get(f"{base}.lora_b")
        if b is None:
            raise ValueError(f"{path}: {base} has lora_a but no lora_b")
        try:
            module = hf_name(base, architecture).removesuffix(".weight")
        except (KeyError, ValueError):
            raise ValueError(f"{path}: target {base} is not supported") from None
        if module.rsplit(".", 1)[-1] not in TARGETS:
            raise ValueError(f"{path}: target {module} is not supported (supported: {', '.join(TARGETS)})")
        if architecture == "llama" and base.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.num_attention_heads if "attn_q" in base else config.num_key_value_heads
            b = unpermute(b, heads)
        factors[module] = (a, b * (alpha / a.shape[0] if alpha else 1.0))
    return factors


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    if (directory / "adapter_model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(directory / "adapter_model.safetensors")
    if (directory / "adapter_model.bin").is_file():
        return torch.load(directory / "adapter_model.bin", map_location="cpu", weights_only=True)
    raise ValueError(f"{directory}: no adapter_model.safetensors or adapter_model.bin")


def _pattern(patterns: dict | None, module: str, default):
    """PEFT's per-module override (`alpha_pattern`): the first key matching the module's name's end."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(in, out) features of a Hugging Face projection of this model."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    name = module.rsplit(".", 1)[-1]
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}[name]


class LoRALinear(torch.nn.Module):
    """A Linear (of any kind: prepacked, native bf16, plain) plus the adapters in the slots, each
    token with the slot its `LoRASlots.token_slots` names (-1: none). A fused Linear's parts (q, k,
    v) each have `max_rank` rows of A and B per slot, B only over the part's own output columns."""

    def __init__(self, base: torch.nn.Module, slots: LoRASlots, parts: list[tuple[str, int]], in_features: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.base, self.slots, self.max_rank = base, slots, max_rank
        self.names = [name for name, _ in parts]  # Hugging Face's, in output order
        ends = list(itertools.accumulate(size for _, size in parts))
        self.columns = [slice(end - size, end) for end, (_, size) in zip(ends, parts)]
        self.offsets = torch.tensor([0, *ends])  # the native kernel's form of `columns`
        rows = len(parts) * max_rank
        self.a = torch.empty(slots.max_loras, rows, in_features, dtype=dtype, device=device)
        self.b = torch.empty(slots.max_loras, rows, ends[-1], dtype=dtype, device=device)  # B transposed
        self.widths = torch.zeros(slots.max_loras, len(parts), dtype=torch.int32)  # ranks in use, per part

    def load(self, slot: int, adapter: LoRAWeights) -> None:
        """Only the rows a part's rank uses, and its own columns, are ever read: no clearing."""
        for p, name in enumerate(self.names):
            a, b = adapter.factors.get(name, (torch.empty(0, 0), None))
            rank, first = a.shape[0], p * self.max_rank
            if rank:
                self.a[slot, first:first + rank] = a
                self.b[slot, first:first + rank, self.columns[p]] = b.T
            self.widths[slot, p] = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        slots = self.slots.token_slots
        if slots is None:
            return y
        if self.slots.ops is not None:
            self.slots.ops.lora_add(y, x.contiguous(), self.a, self.b, slots, self.widths, self.offsets)
            return y
        for slot in slots.unique().tolist():  # the reference: per adapter in the step and part
            if slot < 0:
                continue
            tokens = (slots == slot).nonzero().squeeze(1)
            for p, (rank, columns) in enumerate(zip(self.widths[slot].tolist(), self.columns)):
                rows = slice(p * self.max_rank, p * self.max_rank + rank)
                delta = (x[tokens].float() @ self.a[slot, rows].float().T) @ self.b[slot, rows, columns].float()
                y[tokens, columns] += delta.to(y.dtype)
        return y


class LoRASlots:
    """`max_loras` compute slots over the model's targeted Linears; adapters enter them least
    recently used out, as the steps that run them need them."""

    def __init__(self, model: torch.nn.Module, config: ModelConfig, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, ops) -> None:
        self.max_loras, self.ops, self.device = max_loras, ops, device
        self.resident: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self.loads = 0  # adapters copied into a slot
        self.token_slots: torch.Tensor | None = None  # this step's slot per token, None: no adapter in it
        self.layers: list[LoRALinear] = []
        if config.num_experts:
            raise ValueError(f"LoRA adapters are served on dense models only: {config.architecture} has "
                             "mixture-of-experts layers")
        for i, layer in enumerate(model.model.layers):
            for attr, parts in LAYER_MODULES.items():
                parent_name, name = attr.split(".")
                parent = getattr(layer, parent_name)
                named = [(f"model.layers.{i}.{part}", _shape(config, part)[1]) for part in parts]
                in_features = _shape(config, parts[0])[0]
                wrapped = LoRALinear(getattr(parent, name), self, named, in_features, max_rank, dtype, device)
                setattr(parent, name, wrapped)
                self.layers.append(wrapped)

    def set_step(self, adapter_ids: list[int], token_counts: list[int], adapters: dict[int, LoRAWeights]) -> None:
        """The step's sequences' adapters (0: none) and tokens: each adapter in a slot, each token
        given its slot. The scheduler admits no more adapters to a step than there are slots."""
        if not any(adapter_ids):
            self.token_slots = None
            return
        needed = set(adapter_ids) - {0}
        slot_of = {}
        for adapter_id in needed:
            slot = self.resident.get(adapter_id)
            if slot is None:
                slot = self._free_slot(needed)
                for layer in self.layers:
                    layer.load(slot, adapters[adapter_id])
                self.loads += 1
            self.resident[adapter_id] = slot
            self.resident.move_to_end(adapter_id)
            slot_of[adapter_id] = slot
        per_seq = torch.tensor([slot_of.get(a, -1) for a in adapter_ids], dtype=torch.int32)
        self.token_slots = per_seq.repeat_interleave(torch.tensor(token_counts)).to(self.device)

    def _free_slot(self, keep: set[int]) -> int:
        """An unused slot, or the least recently used one of an adapter this step does not run."""
        used = set(self.resident.values())
        for slot in range(self.max_loras):
            if slot not in used:
                return slot
        victim = next(a for a in self.resident if a not in keep)
        return self.resident.pop(victim)

    def forget(self, adapter_id: int) -> None:
        """An unloaded adapter's slot, free again."""
        self.resident.pop(adapter_id, None)
