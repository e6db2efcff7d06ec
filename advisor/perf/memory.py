"""How many tokens of KV cache one engine rank holds: the device's memory under the runtime's
own budget semantics (a share of the total, a share of what the weights left free, or all of the
usable memory), less the weights one GPU holds and the reserve."""

from __future__ import annotations

from policies.matrix import matrices

from ..capacity import memory_plan, reserved_bytes
from ..model_facts import ModelSpec
from .deployment import Deployment
from .schedulers import Scheduler, scheduler
from .steps import StepCost

GIB = 2**30


def weight_bytes_per_gpu(model: ModelSpec, d: Deployment) -> float:
    """The shared weights split by TP and PP; the experts across every GPU of a stage (with
    attention DP, all the ranks' GPUs), whatever the EP/MoE-TP split of them."""
    total = model.weight_bytes(d.weights)
    experts = 0.0
    if model.experts:
        dense_only = ModelSpec(**{**model.__dict__, "experts": None, "params_total": model.params_total
                                  - model.experts.routed_params})
        experts = total - dense_only.weight_bytes(d.weights)
        total -= experts
    adapters = d.lora_slots * model.lora_params(d.lora_rank) * 2
    return (total + adapters) / (d.tp * d.pp) + experts / (d.tp * (d.dp if d.attention_dp else 1) * d.pp)


def activation_bytes(model: ModelSpec, d: Deployment, sched: Scheduler) -> float:
    """The peak a step at the runtime's own limits holds outside the KV cache, per GPU: its
    token budget's activations (the residual stream and a few hidden-wide buffers, the MLP's gate,
    up and product) and, for its largest batch, float32 logits to sample from (as AIConfigurator
    counts activations apart from its fixed reserve)."""
    width = model.experts.params / (3 * model.hidden_size) if model.experts else model.mlp_width
    tokens = sched.step_tokens
    return (tokens * (4 * model.hidden_size + 3 * width) * 2 / d.tp
            + sched.max_seqs * model.vocab_size * 4 / d.tp)


def kv_tokens(model: ModelSpec, d: Deployment, cost: StepCost, context: int) -> int:
    """KV tokens per rank (0 when the weights do not fit)."""
    hw = d.hardware
    m = matrices().get(d.runtime) or matrices()["vllm"]
    weights = weight_bytes_per_gpu(model, d)
    own = m.memory.reserve_gib if hw.gpu else None  # counts the runtime's activations already
    reserved = reserved_bytes(hw.gpu, d.tp * d.pp, weights, own)
    if hw.gpu and own is None:
        reserved += activation_bytes(model, d, scheduler(d.runtime, hw))
    if m.memory.fraction_covers == "weights_and_kv":
        reserved = 0.0
    if m.memory.fraction_of == "none":
        capacity, fraction = hw.memory_gib * GIB * hw.usable_share, None
    else:
        capacity, fraction = hw.memory_gib * GIB, m.memory.fraction_for(hw.memory_gib, d.tp * d.pp, d.version)
    plan = memory_plan(capacity, weights, cost.kv_per_token, context, m.memory.fraction_of, fraction,
                       reserved)
    return plan.kv_tokens
