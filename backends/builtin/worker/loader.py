"""Model files -> (config, weights, tokenizer).

Two sources: a Hugging Face directory (config.json + *.safetensors + tokenizer files), and a
GGUF file. A GGUF file is converted once into such a directory under the cache
(read back into Hugging Face's config and parameters by `gguf_weights`, dequantized), so every
later start just memory-maps safetensors. Nothing is ever downloaded.
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
from safetensors.torch import load_file, save_file

from backends.builtin.worker.gguf_file import gguf_field
from backends.builtin.worker.gguf_weights import GGUF_TO_HF_ARCH, read_gguf
from backends.builtin.worker.models import SUPPORTED_ARCHITECTURES, model_config
from backends.builtin.worker.models.config import ModelConfig
from backends.default_model import default_model_path

CONVERTER_VERSION = "3"  # bump when the conversion changes, to invalidate caches
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
    else:
        raise FileNotFoundError(f"{source}: neither a GGUF file nor a Hugging Face directory (no config.json)")


def model_dir(path: str | os.PathLike | None = None, cache_dir: str | None = None) -> Path:
    """The Hugging Face directory of a model: itself, or a GGUF file's conversion (made once)."""
    source = Path(path) if path else default_model_path()
    if not source.exists():
        raise FileNotFoundError(f"model not found: {source} (give a GGUF file or a Hugging Face directory)")
    return gguf_to_hf_dir(source, cache_dir) if source.suffix == ".gguf" else source


def load_model(path: str | os.PathLike | None = None, cache_dir: str | None = None) -> LoadedModel:
    source = Path(path) if path else default_model_path()
    return LoadedModel(model_name(source), *load_hf_dir(model_dir(source, cache_dir)), source)


def load_hf_dir(directory: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], object]:
    cfg = json.loads((directory / "config.json").read_text())
    if cfg.get("model_type") not in SUPPORTED_ARCHITECTURES:
        raise unsupported(directory, cfg.get("model_type"))
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(file))
    config = model_config(cfg)
    if "lm_head.weight" not in weights and not config.tie_word_embeddings:
        raise ValueError(f"{directory}: lm_head.weight is missing and embeddings are not tied")
    return config, weights, load_tokenizer(directory)


def _cache_root(cache_dir: str | None) -> Path:
    root = cache_dir or os.environ.get("SERVEGATE_CACHE_DIR") or Path.home() / ".cache" / "servegate"
    return Path(root)


def gguf_to_hf_dir(path: Path, cache_dir: str | None = None) -> Path:
    """The converted directory for `path`, converting on first use (atomically)."""
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{CONVERTER_VERSION}"
    target = _cache_root(cache_dir) / "models" / f"{model_name(path)}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if (target / "model.safetensors").exists():
        return target
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config, weights = read_gguf(path)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    save_file(weights, str(tmp / "model.safetensors"))
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
