"""Engine settings: one plain dataclass, defaults sized for a small model on a CPU, checked when
it is made (as nano-vllm's `Config` is), so a typo fails before any weight loads. Each field's
`help` is what `servegate serve --help` shows: the command's options are these fields."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Literal

Dtype = Literal["auto", "float32", "bfloat16", "float16", "float64"]


def _help(text: str, default, flags: str | None = None):
    return field(default=default, metadata={"help": text, "flags": flags})


@dataclass
class EngineConfig:
    model: str = _help("GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct).", "")
    served_name: str = _help("Model id clients use (default: from the file name).", "")
    device: str = _help("auto (CUDA when present, else CPU) | cpu | cuda | cuda:N", "auto")
    dtype: Dtype = _help("Weights and activations; auto: bfloat16 where the CPU multiplies it natively "
                         "(AVX512-BF16, AMX) or on CUDA, else float32.", "auto")
    block_size: int = _help("Tokens per KV block.", 16)
    num_kv_blocks: int | None = _help("KV blocks (default: sized from --kv-cache-tokens).", None)
    kv_cache_tokens: int = _help("KV cache capacity in tokens (~720 MiB for the default model in fp32).", 16384)
    max_num_batched_tokens: int = _help("Token budget of one engine step (decode first, then prefill chunks).",
                                        2048)
    long_prefill_tokens: int = _help("A prompt with more tokens than this left to compute waits a step rather "
                                     "than hold up the first tokens of shorter ones admitted before it.", 256)
    max_num_seqs: int = _help("Running sequences at most.", 64)
    max_model_len: int | None = _help("Context length cap (default: the model's own).", None)
    enable_prefix_caching: bool = _help("Automatic prefix caching.", True, "--prefix-caching/--no-prefix-caching")
    gguf_weights: Literal["quantized", "dequantized"] = _help(
        "A GGUF's quantized weights: kept in their blocks and multiplied as they are by native kernels "
        "(Q8_0, Q4_0, Q4_1, Q4_K, Q6_K; other types are dequantized), or all dequantized to --dtype at load "
        "(exactly the file's values, about 4x the bytes a Q4 step reads).", "quantized")
    weight_quant: Literal["none", "int8"] = _help("int8: dynamic int8 GEMMs on CPU, faster, no longer exact.", "none")
    kv_cache_dtype: Literal["auto", "int8"] = _help("auto: the model's dtype; int8: per-token, per-head scales.",
                                                    "auto")
    attention: Literal["auto", "native", "torch"] = _help(
        "Native CPU kernels (attention of decode tokens and prompt chunks, the layers' element-wise ops, bf16 "
        "GEMMs on AVX512-BF16 without AMX; bf16 chunks on AMX tiles where AMX runs): auto (where they build) | "
        "native | torch (PyTorch only, the reference).",
        "auto")
    enable_lora: bool = _help("Serve LoRA adapters (PEFT directories), given with --lora or loaded at run time.",
                              False, "--enable-lora/--no-enable-lora")
    lora: list[str] = field(default_factory=list, metadata={
        "help": "An adapter served from the start, as NAME=PATH (repeat for more; implies --enable-lora).",
        "flags": None})
    max_loras: int = _help("Adapters one step may run together (compute slots; the others wait in host memory).", 4)
    max_lora_rank: int = _help("The largest adapter rank served (slots are sized for it).", 16)
    pooling_type: Literal["last", "mean"] = _help(
        "Embeddings: the prompt's final hidden states (after the last norm) pooled into one L2-normalized vector, "
        "the last token's (vLLM's default for a decoder model served with --convert embed) | the mean of all.",
        "last")
    num_speculative_tokens: int = _help(
        "Speculative decoding by prompt lookup (vLLM's ngram method): draft tokens a decoding sequence proposes "
        "from an earlier occurrence of its last n-gram, verified in one forward with its next token; the output is "
        "unchanged. 0: off.", 0)
    prompt_lookup_min: int = _help("The shortest n-gram whose recurrence proposes drafts.", 2)
    prompt_lookup_max: int = _help("The longest n-gram matched (the longest match proposes).", 5)
    cache_dir: str | None = _help("Converted-weights cache (default: ~/.cache/servegate).", None)
    engine_process: bool = _help("Step the engine in a process of its own (vLLM v1's engine-core split), "
                                 "so HTTP work never holds up a step; else on a thread of this process.",
                                 True, "--engine-process/--no-engine-process")

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(EngineConfig)
        for f in dataclasses.fields(self):
            choices = typing.get_args(hints[f.name]) if typing.get_origin(hints[f.name]) is Literal else ()
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name} {getattr(self, f.name)!r} is not one of {', '.join(choices)}")
        for name in ("block_size", "kv_cache_tokens", "max_num_batched_tokens", "long_prefill_tokens", "max_num_seqs",
                     "num_kv_blocks", "max_model_len", "max_loras", "max_lora_rank", "prompt_lookup_min",
                     "prompt_lookup_max"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be 0 (off) or a positive integer, "
                             f"not {self.num_speculative_tokens!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min {self.prompt_lookup_min} is more than prompt_lookup_max "
                             f"{self.prompt_lookup_max}")
        device = self.device.split(":")
        if device[0] not in ("auto", "cpu", "cuda") or len(device) > 2 or (len(device) == 2 and (
                device[0] != "cuda" or not device[1].isdigit())):
            raise ValueError(f"device {self.device!r} is not auto, cpu, cuda or cuda:N")
        for spec in self.lora:
            name, _, path = spec.partition("=")
            if not name or not path:
                raise ValueError(f"lora {spec!r} is not NAME=PATH")
        self.enable_lora = self.enable_lora or bool(self.lora)

    def adapters(self) -> dict[str, str]:
        """The adapters to serve from the start: name -> path."""
        return dict(spec.partition("=")[::2] for spec in self.lora)

    def blocks(self) -> int:
        return self.num_kv_blocks or -(-self.kv_cache_tokens // self.block_size)
