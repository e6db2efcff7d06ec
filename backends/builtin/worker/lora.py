"""LoRA adapters, many in one step: read from PEFT's files (or llama.cpp's GGUF conversion of them),
held in host memory, and copied into a
bounded number of compute slots (least recently used out) that each targeted Linear adds from,
every token with its own sequence's adapter (`csrc/lora.cpp`, S-LoRA's gather-matmul).

An adapter changes `W x` into `W x + scaling * B (A x)`; the scaling (PEFT's `lora_alpha / r`,
or `/ sqrt(r)` with rsLoRA) is folded into B when the adapter enters a slot.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from backends.adapter_files import read_factors, verify
from backends.builtin.worker.gguf_weights import unpermute
from backends.builtin.worker.models import PACKED
from backends.builtin.worker.models.config import ModelConfig

# The projections an adapter may target, by Hugging Face's module names (PEFT's `target_modules`).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The model's Linear layers that adapters reach, and the projections each runs (fused ones in order).
LAYER_MODULES = {"self_attn.qkv_proj": PACKED["self_attn.qkv_proj"], "self_attn.o_proj": ("self_attn.o_proj",),
                 "mlp.gate_up_proj": PACKED["mlp.gate_up_proj"], "mlp.down_proj": ("mlp.down_proj",)}
PROJECTIONS = frozenset(part for parts in LAYER_MODULES.values() for part in parts)
NO_LORA = "this engine serves no LoRA adapters: start it with enable_lora (--enable-lora)"


@dataclass
class LoRAWeights:
    """An adapter's factors by Hugging Face module name ("model.layers.0.self_attn.q_proj"):
    A [r, in] and B [out, r] already scaled, float32 on the CPU."""

    rank: int  # the largest of its modules' ranks
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_adapter(path: str | Path, config: ModelConfig, max_rank: int) -> LoRAWeights:
    """A PEFT LoRA directory, a GGUF LoRA file or a factors file (`save_factors`), read strictly
    (`backends/adapter_files.py`) and checked against the model: ValueError naming what does not fit."""
    path = Path(path)
    if path.suffix == ".safetensors":
        adapter = _load_factors(path)
    else:
        factors = read_factors(path)
        adapter = factors.modules
        if factors.gguf_architecture == "llama":  # Q and K rows back from llama.cpp's interleaved RoPE order
            for module, (a, b) in adapter.items():
                if module.endswith(("q_proj", "k_proj")):
                    heads = config.num_attention_heads if module.endswith("q_proj") else config.num_key_value_heads
                    adapter[module] = (a, unpermute(b, heads))
    for module, (a, b) in adapter.items():
        if module.rsplit(".", 1)[-1] not in TARGETS:
            raise ValueError(f"target {module} is not supported (supported: {', '.join(TARGETS)})")
        rank = a.shape[0]
        if rank > max_rank:
            raise ValueError(f"rank {rank} of {module} exceeds max_lora_rank {max_rank}")
        if not _in_model(config, module):
            raise ValueError(f"target {module} is not a layer of this model ({config.num_hidden_layers} layers)")
        expected_in, expected_out = _shape(config, module)
        if tuple(a.shape) != (rank, expected_in) or tuple(b.shape) != (expected_out, rank):
            raise ValueError(f"{module} has factors {tuple(a.shape)} and {tuple(b.shape)}, this model "
                             f"needs ({rank}, {expected_in}) and ({expected_out}, {rank})")
    if not adapter:
        raise ValueError(f"{path.name}: no LoRA factors in the adapter's weights")
    return LoRAWeights(max(a.shape[0] for a, _ in adapter.values()), adapter)


def prepare_adapter(source: str, digest: str | None, config: ModelConfig, max_rank: int, out: str) -> None:
    """Run in a sandbox (`backends/sandbox.py`): the adapter at `source` (its stored copy's bytes
    verified against `digest` where it has one) read and checked against the model, then written
    to `out` as a factors file, which the engine core loads without parsing anything of a tenant's."""
    import torch

    torch.set_num_threads(1)
    if digest is not None:
        verify(source, digest)
    save_factors(read_adapter(source, config, max_rank), out)


def save_factors(adapter: LoRAWeights, out: str | Path) -> None:
    from safetensors.torch import save_file

    tensors = {}
    for module, (a, b) in adapter.factors.items():
        tensors[f"{module}.lora_A"], tensors[f"{module}.lora_B"] = a.contiguous(), b.contiguous()
    save_file(tensors, str(out))


def _load_factors(path: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    from safetensors.torch import load_file

    tensors = load_file(path)
    return {key.removesuffix(".lora_A"): (a, tensors[key.removesuffix("A") + "B"])
            for key, a in tensors.items() if key.endswith(".lora_A")}


def _in_model(config: ModelConfig, module: str) -> bool:
    """`model.layers.<i>.<attention or MLP>.<projection>` with i a layer of this model."""
    parts = module.split(".")
    return (len(parts) == 5 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
            and int(parts[2]) < config.num_hidden_layers and ".".join(parts[3:]) in PROJECTIONS)


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
