"""Model files -> (config, weights, tokenizer).

Two sources: a Hugging Face directory (config.json + *.safetensors + tokenizer files), and a
GGUF file. A GGUF file is converted once into such a directory under the cache, so every later
start just memory-maps safetensors: its weights either dequantized with the `gguf` package (a
plain Hugging Face directory, which vLLM and transformers read too) or, for the engine by
default, its quantized weights kept in their ggml blocks (`quant.QuantizedWeight`, stored as
uint8 tensors named in the file's metadata). Nothing is ever downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGMLQuantizationType
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from backends.builtin.worker.gguf_file import gguf_field
from backends.builtin.worker.gguf_weights import GGUF_TO_HF_ARCH, read_gguf
from backends.builtin.worker.models import SUPPORTED_ARCHITECTURES, model_config
from backends.builtin.worker.models.config import ModelConfig
from backends.builtin.worker.quant import QuantizedWeight
from backends.default_model import default_model_path

CONVERTER_VERSION = "3"  # bump when the conversion changes, to invalidate caches
QUANTIZED = "servegate.quantized"  # safetensors metadata: {name: [ggml type, in_features]} of kept blocks
# transformers resolves its names lazily, and two threads resolving them at once (two engines
# starting together) can see a half-imported module: one import at a time.
_TRANSFORMERS = threading.Lock()


def load_tokenizer(*args, **kwargs):
    """transformers' AutoTokenizer.from_pretrained (slow to import: only loading needs it)."""
    with _TRANSFORMERS:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(*args, **kwargs)


@dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: object  # a transformers PreTrainedTokenizerFast
    source: Path


def model_name(path: Path) -> str:
    name = path.stem if path.is_file() else path.name
    return name.split(".")[0] if path.suffix == ".gguf" else name


def unsupported(source: Path, architecture: object, supported=SUPPORTED_ARCHITECTURES) -> ValueError:
    return ValueError(f"{source}: architecture {architecture!r} is not supported by the built-in engine "
                      f"(supported: {', '.join(sorted(supported))})")


def check_servable(path: str | os.PathLike | None = None) -> None:
    """Refuse, in one line, a model the engine cannot serve, from its metadata alone (config.json's
    `model_type`, a GGUF's `general.architecture`): before minutes go into converting or loading it."""
    from gguf import GGUFReader

    source = Path(path) if path else default_model_path()
    if not source.exists():
        raise FileNotFoundError(f"model not found: {source} (give a GGUF file or a Hugging Face directory)")
    if source.suffix == ".gguf":
        architecture = gguf_field(GGUFReader(source), "general.architecture")
        if architecture not in GGUF_TO_HF_ARCH:
            raise unsupported(source, architecture, GGUF_TO_HF_ARCH)
    elif (source / "config.json").is_file():
        architecture = json.loads((source / "config.json").read_text()).get("model_type")
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise unsupported(source, architecture)
        if not any(source.glob("*.safetensors")):
            raise FileNotFoundError(f"{source}: no *.safetensors weights")
    else:
        raise FileNotFoundError(f"{source}: neither a GGUF file nor a Hugging Face directory (no config.json)")


def model_dir(path: str | os.PathLike | None = None, cache_dir: str | None = None, quantized: bool = False) -> Path:
    """The Hugging Face directory of a model: itself, or a GGUF file's conversion (made once);
    `quantized`: the conversion that keeps the quantized weights as the file has them."""
    source = Path(path) if path else default_model_path()
    if not source.exists():
        raise FileNotFoundError(f"model not found: {source} (give a GGUF file or a Hugging Face directory)")
    return gguf_to_hf_dir(source, cache_dir, quantized) if source.suffix == ".gguf" else source


def load_model(path: str | os.PathLike | None = None, cache_dir: str | None = None,
               quantized: bool = False) -> LoadedModel:
    source = Path(path) if path else default_model_path()
    return LoadedModel(model_name(source), *load_hf_dir(model_dir(source, cache_dir, quantized)), source)


def read_model_config(directory: Path) -> ModelConfig:
    """The engine's config of the model in a Hugging Face directory, without its weights."""
    return model_config(json.loads((directory / "config.json").read_text()))


def load_hf_dir(directory: Path) -> tuple[ModelConfig, dict[str, torch.Tensor | QuantizedWeight], object]:
    cfg = json.loads((directory / "config.json").read_text())
    if cfg.get("model_type") not in SUPPORTED_ARCHITECTURES:
        raise unsupported(directory, cfg.get("model_type"))
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors weights")
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    for file in files:
        weights.update(load_file(file))
        with safe_open(file, "pt") as opened:
            kept = json.loads((opened.metadata() or {}).get(QUANTIZED, "{}"))
        for name, (qtype, in_features) in kept.items():
            raw = weights[name]
            weights[name] = QuantizedWeight(GGMLQuantizationType[qtype], (raw.shape[0], in_features), raw)
    config = model_config(cfg)
    if "lm_head.weight" not in weights and not config.tie_word_embeddings:
        raise ValueError(f"{directory}: lm_head.weight is missing and embeddings are not tied")
    return config, weights, load_tokenizer(directory)


def _cache_root(cache_dir: str | None) -> Path:
    root = cache_dir or os.environ.get("SERVEGATE_CACHE_DIR") or Path.home() / ".cache" / "servegate"
    return Path(root)


def gguf_to_hf_dir(path: Path, cache_dir: str | None = None, quantized: bool = False) -> Path:
    """The converted directory for `path`, converting on first use (atomically)."""
    stat = path.stat()
    variant = "quantized" if quantized else "dequantized"
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{CONVERTER_VERSION}|{variant}"
    target = _cache_root(cache_dir) / "models" / f"{model_name(path)}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if (target / "model.safetensors").exists():
        return target
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config, weights = read_gguf(path, dequantize=not quantized)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    kept = {name: [w.type_name, w.shape[1]] for name, w in weights.items() if isinstance(w, QuantizedWeight)}
    save_file({name: w.raw if isinstance(w, QuantizedWeight) else w for name, w in weights.items()},
              str(tmp / "model.safetensors"), metadata={QUANTIZED: json.dumps(kept)})
    _write_tokenizer(path, tmp, config["max_position_embeddings"])
    if target.exists():  # another process converted it meanwhile
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, target)
    return target


def _write_tokenizer(path: Path, directory: Path, max_length: int) -> None:
    """The GGUF's tokenizer as llama.cpp reads it where we can rebuild it (byte-level BPE);
    otherwise transformers' own conversion."""
    from gguf import GGUFReader

    from backends.builtin.worker import gguf_tokenizer

    reader = GGUFReader(path)
    if gguf_tokenizer.buildable(reader):
        gguf_tokenizer.write(reader, directory, max_length)
    else:
        load_tokenizer(path.parent, gguf_file=path.name).save_pretrained(directory)
