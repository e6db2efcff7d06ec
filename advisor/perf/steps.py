"""What one forward step costs a deployment: a roofline per step over the bytes it reads (the
weights its tokens touch, with a mixture of experts' union of routed experts, and each decoding
sequence's KV) and the FLOPs it does (2 per active weight per token, plus attention over each
token's context), at the fitted shares of the device's peaks, plus tensor-, expert- and
pipeline-parallel communication over the link the group spans, plus the runtime's fixed cost."""

from __future__ import annotations

from dataclasses import dataclass

from ..capacity import bits_per_weight, kv_bytes_per_token
from ..model_facts import EXPERTS_ONLY_FORMATS, ModelSpec
from .deployment import Deployment
from .efficiency import Efficiency, device_class

LOW_PRECISION = {"fp8": "fp8", "nvfp4": "fp4", "mxfp4": "fp4"}  # weight formats whose matmuls run below bf16
KV_ALIASES = {"auto": "bf16", "fp16": "bf16", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "nvfp4": "fp4"}


@dataclass(frozen=True)
class Step:
    """What one engine rank runs in a step."""
    decodes: int = 0  # sequences each producing one token
    decode_context: float = 0.0  # the sum of their context lengths
    prefill: int = 0  # prompt tokens
    prefill_context: float = 0.0  # the sum over those tokens of the context each attends to
    attended: float | None = None  # the sum over decodes of the cells each attends, where not its own context


class StepCost:
    """Seconds per step for one model on one deployment, with fitted efficiencies."""

    def __init__(self, model: ModelSpec, d: Deployment, eff: Efficiency, speculative: float = 1.0):
        self.model, self.d = model, d
        hw, cls = d.hardware, device_class(d.hardware)
        runtime = eff.of(d.runtime, hw)
        fmt = d.weights.lower()
        bits = bits_per_weight(fmt)
        rest_bits = bits_per_weight("bf16") if fmt in EXPERTS_ONLY_FORMATS else bits
        layers = model.arch.layers
        self.stage_layers = layers / d.pp
        e = model.experts
        routed_active = e.layers * e.per_token * e.params if e else 0.0
        shared_active = model.params_active - routed_active  # attention, shared experts, dense layers, head
        # Per GPU of one pipeline stage. The experts spread over every GPU of the stage (the TP
        # group, times the attention-DP ranks): EP places whole experts, `ep` ways, and what is
        # left of the split shards each expert (MoE TP), as TP shards everything without EP.
        self.dense_bytes = shared_active * rest_bits / 8 / (d.tp * d.pp)
        self.dense_flops = 2 * shared_active / (d.tp * d.pp)
        split = d.tp * (d.dp if d.attention_dp else 1)
        self.local_experts = e.routed / d.ep if e else 0.0
        self.expert_bytes = e.params * bits / 8 / max(1, split // d.ep) if e else 0.0
        self.moe_layers = e.layers / d.pp if e else 0.0
        self.expert_flops = 2 * routed_active / (split * d.pp)
        # Grouped expert GEMMs reach a share of what dense ones do, less the narrower each GPU's
        # slice of an expert: DeepSeek's 2,048-wide experts sharded 8 ways by TP are 256 wide,
        # whole under EP; Llama 4 Maverick's are 8,192 wide.
        width = e.params / (3 * model.hidden_size) / max(1, split // d.ep) if e and model.hidden_size else 0.0
        self.moe_tiles = width / (width + eff.moe_width) if width else 1.0  # narrow slices fill few MMA tiles
        self.moe = eff.moe
        self.attention = eff.attention
        layers_us = eff.layer_us * self.stage_layers + eff.moe_layer_us * self.moe_layers
        self.layer_cost = layers_us / 1e6 * (cls == "gpu")
        kv = KV_ALIASES.get(d.kv.lower(), d.kv.lower())
        self.kv_per_token = kv_bytes_per_token(model.arch, kv if kv != "fp4" else "fp4", tp=d.tp) / d.pp
        # Attention FLOPs per (query token, context token) pair: QK^T and AV, 2 each per head
        # dimension. MLA decodes in the latent space (queries absorbed into the 512-wide latent:
        # 2 x (latent + rope) + 2 x latent per head), and prefills as ordinary attention.
        self.prefill_attention = 4 * model.attention_dim / d.tp * self.stage_layers
        self.decode_attention = (model.heads * 2 * (2 * model.arch.kv_lora_rank + model.arch.qk_rope_head_dim) / d.tp
                                 * self.stage_layers if model.arch.mla else self.prefill_attention)
        speed = runtime["speed"]
        self.bandwidth = hw.bandwidth_gbs * 1e9 * eff.bandwidth[cls] * speed
        precision = LOW_PRECISION.get(fmt) if cls == "gpu" else None
        peak = {"fp8": hw.fp8_tflops, "fp4": getattr(hw, "fp4_tflops", None)}.get(precision) if precision else None
        share = eff.compute[cls] * (eff.precision[precision] if peak else 1.0)
        self.flops = ((peak or hw.bf16_tflops or 0.0) * 1e12 * share * runtime["compute_speed"]) or None
        self.overhead = runtime["overhead_ms"] / 1000
        self.frontend = runtime["request_ms"] / 1000
        self.per_sequence = runtime["per_sequence_us"] / 1e6  # scheduling, sampling
        self.hidden = model.hidden_size
        self.speculative = speculative  # tokens verified per decode step (1 without speculation)
        # A LoRA adapter's A and B matrices beside every targeted layer: each adapter a batch
        # mixes is read once a step, and every token pays its 2 x rank x (in + out) FLOPs.
        self.lora_params = model.lora_params(d.lora_rank) / (d.tp * d.pp) if d.lora_slots else 0.0

    def seconds(self, s: Step) -> float:
        """One step for every rank of the engine (ranks run in lockstep, each on its own batch)."""
        d = self.d
        pp = d.pp
        # A pipeline holds `pp` micro-batches in flight: each stage runs 1/pp of the step's tokens
        # through 1/pp of the layers, and a token crosses all stages before its next step.
        decodes = s.decodes * self.speculative / pp
        tokens = decodes + s.prefill / pp
        ranks = d.dp if d.attention_dp else 1
        kv = self.kv_per_token * s.decode_context / pp
        attended = s.decode_context if s.attended is None else s.attended
        attention = (self.decode_attention * attended * self.speculative
                     + self.prefill_attention * s.prefill_context) / pp
        if self.moe_layers:
            e = self.model.experts
            routed_tokens = tokens * ranks
            touched = self.local_experts * (1 - (1 - e.per_token / e.routed) ** routed_tokens)
            experts_memory = self.moe_layers * touched * self.expert_bytes
            experts_flops = self.expert_flops * routed_tokens
        kernel = self._roofline(self.dense_bytes, self.dense_flops * tokens)
        if self.lora_params:
            adapters = min(d.lora_slots, max(1, s.decodes))
            kernel += self._roofline(adapters * self.lora_params * 2, 2 * self.lora_params * tokens)
        kernel += self._roofline(kv, attention) / self.attention  # attention kernels reach less of the peaks
        if self.moe_layers:
            kernel += self._roofline(experts_memory, experts_flops / self.moe_tiles) / self.moe
        stage = kernel + self.layer_cost + self._collectives(tokens)
        hop = 0.0
        if pp > 1:
            bandwidth, latency = d.link(d.tp * pp)
            hop = (pp - 1) * (latency + tokens * self.hidden * 2 / bandwidth)
        return pp * stage + hop + self.overhead + self.per_sequence * s.decodes

    def _roofline(self, memory: float, flops: float) -> float:
        """Seconds for kernels that read `memory` bytes and do `flops`, smoothed where the bounds meet."""
        memory_s = memory / self.bandwidth
        compute_s = flops / self.flops if self.flops else 0.0
        return (memory_s ** 4 + compute_s ** 4) ** 0.25

    def _collectives(self, tokens: float) -> float:
        d, total = self.d, 0.0
        message = tokens * self.hidden * 2  # bf16 activations
        if d.tp > 1:  # two all-reduces per layer, ring: 2(N-1)/N of the message per device
            bandwidth, latency = d.link(d.tp)
            total += 2 * self.stage_layers * (latency + 2 * (d.tp - 1) / d.tp * message / bandwidth)
        if d.ep > 1 and self.moe_layers:  # dispatch and combine all-to-alls per MoE layer
            bandwidth, latency = d.link(d.engine_gpus // d.pp)
            total += 2 * self.moe_layers * (latency + (d.ep - 1) / d.ep * message / bandwidth)
        return total

    def kv_transfer(self, prompt: int) -> float:
        """Seconds to hand one prompt's KV from a prefill engine to a decode engine over the network."""
        return NETWORK_HANDOFF_S + prompt * self.kv_per_token * self.d.pp * self.d.tp / (self.d.network_gbs * 1e9)


NETWORK_HANDOFF_S = 1e-3  # a transfer's setup (NIXL/Mooncake handshake and block lookup)
