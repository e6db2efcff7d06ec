"""Runs one scheduled batch through the model: inputs, KV cache tensors, logits, and the final
hidden states embedding requests pool."""

from __future__ import annotations

import warnings

import torch

from backends.builtin.config import EngineConfig
from backends.builtin.core.scheduler import ScheduledBatch
from backends.builtin.core.sequence import Sequence
from backends.builtin.worker import kernels
from backends.builtin.worker.attention import AttentionMetadata, LayerKV
from backends.builtin.worker.loader import LoadedModel
from backends.builtin.worker.lora import NO_LORA, LoRASlots, LoRAWeights, read_adapter
from backends.builtin.worker.models import model_weights
from backends.builtin.worker.models.fused import FusedDecode
from backends.builtin.worker.models.layers import CausalLM, Experts
from backends.builtin.worker.quant import ConcatLinear, QuantEmbedding, QuantizedWeight, QuantLinear, fused_linear
from backends.cpu import bf16_native

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def quantized(model: torch.nn.Module, weight_quant: str, device: torch.device) -> torch.nn.Module:
    """int8: every Linear becomes a dynamically quantized one (int8 weights with a scale per output
    row, activations quantized per batch; fbgemm GEMMs, faster than fp32 at decode batch sizes)."""
    if weight_quant == "none":
        return model
    if device.type != "cpu":
        raise ValueError(f"weight_quant int8 runs on the CPU only, not on {device.type}")
    with warnings.catch_warnings():  # eager-mode quantization warns that it moves to torchao
        warnings.simplefilter("ignore")
        qconfig = torch.ao.quantization.per_channel_dynamic_qconfig  # one scale per output row
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear: qconfig}, dtype=torch.qint8)


class PackedLinear(torch.nn.Module):
    """A Linear whose weight oneDNN reorders once into its own blocked layout, as vLLM's CPU build
    prepacks its weights: at the few rows of a decode step, bf16 GEMMs read it faster than a
    row-major weight, and float32 ones run faster than on PyTorch's MKL path."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 16)  # 16: a batch hint
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


class PairedLinear(torch.nn.Module):
    """A bf16 Linear on the native GEMM (`csrc/bf16_linear.cpp`), its weight laid out once in
    pairs of input features for VDPBF16PS: on AVX512-BF16 without AMX, faster than oneDNN's at
    decode's few rows, a little slower at a prompt's hundreds."""

    def __init__(self, linear: torch.nn.Linear, ops) -> None:
        super().__init__()
        n, k = linear.weight.shape
        self.weight = linear.weight.detach().view(n // 16, 16, k // 2, 2).transpose(1, 2).contiguous()
        self.bias = linear.bias
        self.ops = ops

    @property
    def native_projection(self) -> tuple[int, torch.Tensor, torch.Tensor | None]:
        """(kind, weight, bias) as `csrc/decode_layers.cpp` takes a projection: -1, the paired kind."""
        return -1, self.weight, self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.bf16_linear(x.contiguous(), self.weight, self.bias)


def prepacked(model: torch.nn.Module, dtype: torch.dtype, device: torch.device, native: bool) -> torch.nn.Module:
    """bf16 and float32 on the CPU: every Linear laid out once for the GEMM that serves it, the
    native bf16 one where it is built for this CPU, else oneDNN's (float32 sums in another order
    than MKL's, about 1e-4 apart at most, as vLLM's CPU build computes them); `native`: whether the
    native kernels may serve. float64, the tests' reference dtype, as it is."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return model
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return model  # oneDNN's bf16 needs AVX-512 at least: a bf16 model asked for on an AVX2 CPU is left as it is
    gemm = kernels.bf16_linear(device, dtype) if native else None
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child) is torch.nn.Linear:
                n, k = child.weight.shape
                paired = gemm is not None and n % 16 == 0 and k % 2 == 0
                setattr(parent, name, PairedLinear(child, gemm) if paired else PackedLinear(child))
    return model


def _place_quantized(model: torch.nn.Module, module: str, weight, dtype: torch.dtype, tied: bool) -> None:
    """The module named `module` made a quantized one: the embedding table, or a Linear (its bias,
    already loaded, kept); a tied LM head multiplies the embedding's blocks."""
    parent_name, _, child = module.rpartition(".")
    parent = model.get_submodule(parent_name)
    if isinstance(getattr(parent, child), torch.nn.Embedding):
        setattr(parent, child, QuantEmbedding(weight, dtype))
        if tied:
            model.lm_head = QuantLinear(weight)
        return
    bias = getattr(parent, child).bias
    if isinstance(weight, QuantizedWeight):
        setattr(parent, child, QuantLinear(weight, bias))
    elif all(isinstance(part, QuantizedWeight) for part in weight) and bias is None:
        setattr(parent, child, fused_linear(weight))
    else:  # parts of mixed kinds (one dequantized): each its own Linear, outputs concatenated
        parts = [QuantLinear(part) if isinstance(part, QuantizedWeight) else _linear(part, dtype) for part in weight]
        if bias is not None:
            raise ValueError(f"{module}: a bias over parts of mixed quantization is not supported")
        setattr(parent, child, ConcatLinear(parts))


def _linear(weight: torch.Tensor, dtype: torch.dtype) -> torch.nn.Linear:
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=dtype)
    linear.weight = torch.nn.Parameter(weight.to(dtype), requires_grad=False)
    return linear


def weight_summary(model: torch.nn.Module) -> tuple[str, int]:
    """What the weights are stored as ("Q4_1 x210, float32 x1"), and the bytes of weights one
    token's forward reads: every matrix it multiplies (experts: the share of them a token routes
    to), not the embedding table, of which it reads one row."""
    kinds: dict[str, int] = {}
    total = 0.0
    for module in model.modules():
        if isinstance(module, QuantLinear):
            kinds[module.qtype.name] = kinds.get(module.qtype.name, 0) + 1
            total += module.bytes
        elif isinstance(module, torch.nn.Linear):
            kind = str(module.weight.dtype).removeprefix("torch.")
            kinds[kind] = kinds.get(kind, 0) + 1
            total += module.weight.nbytes
        elif isinstance(module, Experts):
            share = model.config.num_experts_per_tok / model.config.num_experts
            total += (module.gate_up_proj.nbytes + module.down_proj.nbytes) * share
    return ", ".join(f"{kind} x{count}" for kind, count in sorted(kinds.items())), int(total)


def pick_dtype(name: str, device: torch.device) -> tuple[torch.dtype, str]:
    """The dtype, and why: `auto` takes bfloat16 where it is native (the CPU's AVX512-BF16 or AMX,
    or a CUDA device that has it), float32 elsewhere, where bf16 would be emulated."""
    if name != "auto":
        return DTYPES[name], "asked"
    if device.type == "cuda":
        return (torch.bfloat16, "CUDA bf16") if torch.cuda.is_bf16_supported() else (torch.float16, "CUDA fp16")
    isa = bf16_native()
    return (torch.bfloat16, f"auto: {isa}") if isa else (torch.float32, "auto: no native bf16 on this CPU")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, num_blocks: int, max_model_len: int) -> None:
        self.device = pick_device(config.device)
        self.dtype, self.dtype_reason = pick_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        cfg = loaded.config
        with torch.device("meta"):
            model = CausalLM(cfg)
        weights = model_weights(loaded.weights, cfg)
        blocks = {name: weights.pop(name) for name in list(weights) if not isinstance(weights[name], torch.Tensor)}
        if blocks and self.device.type != "cpu":
            raise ValueError("a GGUF's quantized weights are multiplied on the CPU only: give --gguf-weights "
                             f"dequantized to run on {self.device}")
        missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
        missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
        if cfg.tie_word_embeddings and "model.embed_tokens.weight" not in blocks:
            model.lm_head.weight = model.model.embed_tokens.weight
        for name, weight in blocks.items():
            missing.remove(name)
            _place_quantized(model, name.removesuffix(".weight"), weight, self.dtype, cfg.tie_word_embeddings)
        model = model.to(device=self.device, dtype=self.dtype).eval()
        if missing or unexpected:
            raise ValueError(f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        self.weights, self.weight_bytes_per_token = weight_summary(model)
        self.model = quantized(model, config.weight_quant, self.device) if config.weight_quant != "none" else \
            prepacked(model, self.dtype, self.device, native=config.attention != "torch")
        self.model.prepare(self.device, max_model_len)
        if config.weight_quant == "none" and config.attention != "torch":
            self.model.ops = kernels.layer_ops(self.device, self.dtype)
        self.config, self.max_lora_rank = cfg, config.max_lora_rank
        self.lora = LoRASlots(self.model, cfg, config.max_loras, config.max_lora_rank, self.dtype, self.device,
                              self.model.ops) if config.enable_lora else None
        self.model.fused_decode = FusedDecode.of(self.model)  # after LoRA has wrapped the projections it adapts
        self.adapters: dict[int, LoRAWeights] = {}  # in host memory, by adapter id
        int8 = config.kv_cache_dtype == "int8"
        self.kv_caches = [
            LayerKV.allocate(num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim, self.dtype,
                             self.device, int8)
            for _ in range(cfg.num_hidden_layers)
        ]
        cache_dtype = self.kv_caches[0].data.dtype
        self.use_kernel = config.attention != "torch" and self.model.plain_attention and kernels.available(
            self.device, cache_dtype, cfg.head_dim)
        self.chunk_kernel = self.use_kernel and kernels.chunk_kernel_serves(cache_dtype)
        if config.attention == "native" and not self.use_kernel:
            raise ValueError(f"the native attention kernels do not serve {self.device} / {cache_dtype} / "
                             f"head_dim {cfg.head_dim} / this model's attention (windows, soft-caps, sinks) here")

    def kv_bytes_per_token(self) -> float:
        kv = self.kv_caches[0]
        return kv.nbytes * len(self.kv_caches) / (kv.data.shape[1] * self.block_size)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for cache in self.kv_caches:
            cache.copy_blocks(src, dst)

    def add_adapter(self, adapter_id: int, path: str) -> None:
        """An adapter's weights read and checked against the model (ValueError naming the misfit)."""
        if self.lora is None:
            raise ValueError(NO_LORA)
        self.adapters[adapter_id] = read_adapter(path, self.config, self.max_lora_rank)

    def drop_adapter(self, adapter_id: int) -> None:
        self.adapters.pop(adapter_id, None)
        self.lora.forget(adapter_id)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor, dict[Sequence, torch.Tensor]]:
        """Compute the batch's new tokens; returns the sequences that now need a next token, with
        their logits ([rows, vocab] float32 on the CPU: a row each, and one more per draft token of
        a speculating sequence, after its own), and each embedding request's share of the
        final hidden states (float32 on the CPU): its prompt's last one once computed ("last"
        pooling), or the sum of this chunk's ("mean", added up across chunks by the scheduler)."""
        input_ids: list[int] = []
        positions: list[int] = []
        ctx_lens, logits_index, done = [], [], []
        hidden_index: list[int] = []  # rows whose final hidden states embedding requests pool
        pooling: list[tuple[Sequence, int, int]] = []  # (sequence, its first row in hidden_index, rows)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            drafts = batch.drafts.get(seq, [])
            input_ids += seq.token_ids[start : start + n - len(drafts)] + drafts
            positions += range(start, start + n)
            ctx_lens.append(start + n)
            if seq.pooling == "mean":
                pooling.append((seq, len(hidden_index), n))
                hidden_index += range(len(input_ids) - n, len(input_ids))
            elif start + n == len(seq) and seq.pooling == "last":
                pooling.append((seq, len(hidden_index), 1))
                hidden_index.append(len(input_ids) - 1)
            elif start + n - len(drafts) == len(seq):
                logits_index += range(len(input_ids) - 1 - len(drafts), len(input_ids))
                done.append(seq)
        if self.lora is not None:
            self.lora.set_step([s.adapter_id for s in batch.seqs], batch.num_new_tokens, self.adapters)
        meta = AttentionMetadata.build(batch.num_new_tokens, ctx_lens, [s.block_table for s in batch.seqs],
                                       self.block_size, self.device, self.dtype, self.use_kernel, self.chunk_kernel,
                                       per_token={i for i, seq in enumerate(batch.seqs) if seq in batch.drafts})
        logits, hidden = self.model(
            torch.tensor(input_ids, device=self.device), torch.tensor(positions, device=self.device),
            self.kv_caches, meta, torch.tensor(logits_index, dtype=torch.long, device=self.device),
            torch.tensor(hidden_index, dtype=torch.long, device=self.device),
        )
        hidden = hidden.cpu()
        return done, logits.cpu(), {seq: hidden[first : first + rows].sum(0) for seq, first, rows in pooling}
