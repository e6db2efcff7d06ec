"""Engine settings: one plain dataclass, defaults sized for a small model on a CPU."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    model: str = ""  # a GGUF file, or an HF directory (config.json + safetensors); "" = default model
    served_name: str = ""  # the model id clients ask for; "" = derived from the file name
    device: str = "auto"  # "auto" picks CUDA when present, else CPU
    dtype: str = "float32"  # float32 | bfloat16 | float16 | float64
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # None: sized from kv_cache_tokens
    kv_cache_tokens: int = 16384  # KV capacity when num_kv_blocks is None (~720 MiB for the default model in fp32)
    max_num_batched_tokens: int = 2048  # token budget of one step (decode first, then prefill chunks)
    max_num_seqs: int = 64  # running sequences at most
    max_model_len: int | None = None  # None: the model's own context length
    enable_prefix_caching: bool = True
    weight_quant: str = "none"  # none | int8 (CPU: dynamic int8 GEMMs, faster, no longer exact)
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | int8 (per-token, per-head absmax scales)
    attention: str = "auto"  # decode attention: auto (native kernel where it builds) | native | torch
    cache_dir: str | None = None  # converted-weights cache; None: ~/.cache/servegate

    def blocks(self) -> int:
        return self.num_kv_blocks or -(-self.kv_cache_tokens // self.block_size)
