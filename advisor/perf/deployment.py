"""One way to serve a model: a runtime on devices split by tensor, pipeline, expert and data
parallelism, with weight and KV precisions, aggregated or disaggregated prefill/decode."""

from __future__ import annotations

from dataclasses import dataclass

from ..hardware import Hardware
from ..model_facts import ModelSpec

# Across nodes each GPU has its own NIC: 400 Gb/s InfiniBand NDR or RoCE (a DGX H100/H200 node's
# eight ConnectX-7), 50 GB/s per direction; the collective's fixed cost is larger than NVLink's.
NETWORK_GBS = 50.0
NETWORK_LATENCY_S = 25e-6


@dataclass(frozen=True)
class Deployment:
    runtime: str
    hardware: Hardware
    tp: int = 1
    pp: int = 1
    ep: int = 1  # experts split across this many GPUs (1: each expert sharded by TP)
    dp: int = 1  # data-parallel ranks: whole replicas, or with `attention_dp` attention ranks sharing the MoE
    attention_dp: bool = False  # the dp ranks form one engine: attention per rank, experts across all of them
    weights: str = "bf16"
    kv: str = "bf16"
    gpus_per_node: int = 8
    network_gbs: float = NETWORK_GBS
    # Disaggregated prefill/decode: `prefill_workers` engines of this shape only prefill and hand
    # their KV over the network to `dp` decode engines. 0: aggregated.
    prefill_workers: int = 0
    lora_slots: int = 0  # LoRA adapters one batch may mix, each held on every GPU (bf16, sharded like the weights)
    lora_rank: int = 0
    version: str | None = None  # the runtime's release, where its memory defaults differ from the matrix's

    @property
    def engine_gpus(self) -> int:
        """GPUs of one engine instance (a replica, or with attention DP the whole EP group)."""
        return self.tp * self.pp * (self.dp if self.attention_dp else 1)

    @property
    def replicas(self) -> int:
        return 1 if self.attention_dp else self.dp

    @property
    def gpus(self) -> int:
        """The decode (or aggregated) engines' GPUs, plus the prefill engines', each engine alike."""
        return self.engine_gpus * (self.replicas + self.prefill_workers)

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    def link(self, group: int) -> tuple[float, float]:
        """(bytes/s per direction, seconds per collective) for a group of `group` GPUs: the
        device's own link within a node, the network once the group spans nodes."""
        if group <= self.gpus_per_node and self.hardware.link_gbs:
            return self.hardware.link_gbs * 1e9, 10e-6
        return self.network_gbs * 1e9, NETWORK_LATENCY_S

    def describe(self) -> str:
        parts = [f"TP{self.tp}"] + [f"PP{self.pp}"] * (self.pp > 1) + [f"EP{self.ep}"] * (self.ep > 1)
        parts += [f"{'attention-DP' if self.attention_dp else 'DP'}{self.dp}"] * (self.dp > 1)
        shape = "x".join(parts)
        if self.prefill_workers:
            engine = "x".join(p for p in parts if not p.startswith("DP"))
            shape = f"{self.prefill_workers}P({engine})+{self.replicas}D({engine})"
        return f"{shape} {self.weights}/{self.kv}"


def divides(model: ModelSpec, d: Deployment) -> str | None:
    """Why the model cannot split this way (a sentence), or None: TP divides the attention and
    KV heads (KV heads may be replicated when TP exceeds them) and the MLP width, PP the layers,
    EP the routed experts."""
    heads = model.attention_dim // model.arch.head_dim if model.arch.head_dim else 0
    if heads and heads % d.tp:
        return f"TP {d.tp} does not divide the {heads} attention heads"
    kv = model.arch.kv_heads
    if kv and d.tp > kv and d.tp % kv:
        return f"TP {d.tp} neither divides nor is a multiple of the {kv} KV heads"
    if kv and d.tp < kv and kv % d.tp:
        return f"TP {d.tp} does not divide the {kv} KV heads"
    if model.arch.layers % d.pp and d.pp > 1 and model.arch.layers < 2 * d.pp:
        return f"PP {d.pp} leaves stages without layers ({model.arch.layers} layers)"
    if d.ep > 1:
        if not model.experts:
            return "expert parallelism needs a mixture of experts"
        if model.experts.routed % d.ep:
            return f"EP {d.ep} does not divide the {model.experts.routed} routed experts"
    return None
