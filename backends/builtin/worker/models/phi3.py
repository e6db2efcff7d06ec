"""Phi-3 and Phi-4-mini: q/k/v and gate/up already fused in the checkpoint, partial rotary
(Phi-4-mini rotates 3/4 of each head), longrope scaling, a sliding window where the file sets one."""

from __future__ import annotations

from dataclasses import replace

from backends.builtin.worker.models.config import SLIDING, ModelConfig, common, layer_types, windows
from backends.builtin.worker.models.rope import Rope


def config(cfg: dict) -> ModelConfig:
    cfg = {**cfg, "head_dim": None}  # Phi-3's heads are hidden_size / heads wide, whatever else the file says
    model = common(cfg, layer_windows=windows(cfg, layer_types(cfg, lambda i: SLIDING)))
    rope = model.rope
    if rope.kind == "longrope":  # transformers derives what the file leaves out from the contexts
        scaling = dict(rope.scaling)
        original = scaling.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
        scaling.setdefault("factor", cfg.get("max_position_embeddings", original) / original)
        rope = Rope.of(rope.theta, rope.rotary_dim, {**scaling, "original_max_position_embeddings": original})
    return replace(model, rope=rope)


ARCHITECTURES = {"phi3": config}
