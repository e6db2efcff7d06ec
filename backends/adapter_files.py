"""LoRA adapters' files as a tenant hands them over: PEFT directories (`adapter_config.json` with
`adapter_model.safetensors` or `.bin`) and llama.cpp's GGUF LoRA files, all of it untrusted.

- `snapshot` copies an adapter's files, as they are at registration, into a content-addressed store
  (`<store>/<digest>/`): each file opened without following a link and, for a tenant's, checked to
  lie in the tenant's own directory once open, so a link or a later swap can serve nothing else.
  Backends read the copy; `verify` refuses a copy whose bytes no longer hash to its digest.
- `read_factors` reads an adapter strictly, whatever the model: the config's fields by type,
  PEFT's `alpha_pattern` keys matched by RE2 (linear time: no pattern can stall a reader), every
  tensor a LoRA factor of a sane shape and dtype. Errors are ValueErrors naming the problem.
- `check` runs `read_factors` in a sandbox (`backends/sandbox.py`): a file that crashes, hangs or
  floods a parser costs a child process, not the gateway or an engine.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import stat
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
GGUF_NAME = "adapter.gguf"  # a GGUF adapter's name in the store (a tenant's file name is not kept)
MAX_CONFIG_BYTES = 1 << 20
MAX_PATTERNS = 1024
CHECK_TIMEOUT_S = 60.0
CHECK_MEMORY_BYTES = 4 << 30  # beyond the checker's own start: a few copies of the largest adapter allowed
CHUNK = 1 << 20


@dataclass
class Factors:
    """An adapter's factors by Hugging Face module name ("model.layers.0.self_attn.q_proj"): A [r, in]
    and B [out, r] with the scaling folded into B, float32. `gguf_architecture`: a GGUF file's, whose
    Q and K rows are in llama.cpp's order (the model's reader puts them back)."""

    modules: dict
    gguf_architecture: str | None = None


# -- the content-addressed store ----------------------------------------------------------------
def snapshot(source: str | os.PathLike, store: Path, within: Path | None, max_bytes: int) -> tuple[str, Path]:
    """Copy the adapter at `source` into `store`: (its digest, the copy's path, which backends read).
    `within`: the directory every file must lie in once opened (a tenant's own); None: anywhere.
    ValueError naming what is missing, too large or out of bounds."""
    source = Path(source)
    if source.suffix == ".gguf":
        files = {GGUF_NAME: source}
    else:
        weights = next((source / name for name in PEFT_WEIGHTS if (source / name).exists()), None)
        if weights is None:
            raise ValueError(f"{source}: not a PEFT adapter directory ({PEFT_CONFIG} with one of "
                             f"{', '.join(PEFT_WEIGHTS)}) nor a .gguf file")
        files = {PEFT_CONFIG: source / PEFT_CONFIG, weights.name: weights}
    store.mkdir(parents=True, exist_ok=True)
    partial = store / f".partial-{uuid.uuid4().hex}"
    partial.mkdir()
    try:
        total, digest = 0, hashlib.sha256()
        for name, path in sorted(files.items()):
            total += _copy(path, partial / name, within, max_bytes - total, digest, name)
        final = store / digest.hexdigest()
        try:
            partial.rename(final)
        except OSError:  # the same bytes were stored before
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return digest.hexdigest(), final / GGUF_NAME if GGUF_NAME in files else final


def _copy(path: Path, target: Path, within: Path | None, budget: int, digest, name: str) -> int:
    """One file, read through the one descriptor that was checked, into `target` and the digest."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except OSError as exc:  # ELOOP: the file is a symbolic link
        raise ValueError(f"{path}: cannot be read as a regular file ({os.strerror(exc.errno)})") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path}: not a regular file")
        opened = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if within is not None and not opened.is_relative_to(within):
            raise ValueError(f"{path}: lies outside {within}/ once links are followed")
        if info.st_size > budget:
            raise ValueError(f"{path}: the adapter's files exceed the {_mib(budget + info.st_size)} allowed")
        digest.update(f"{name}\0{info.st_size}\0".encode())
        copied = 0
        with open(target, "wb") as out:
            while chunk := file.read(CHUNK):
                copied += len(chunk)
                if copied > info.st_size:  # grew while read
                    raise ValueError(f"{path}: changed while it was read")
                digest.update(chunk)
                out.write(chunk)
        if copied != info.st_size:
            raise ValueError(f"{path}: changed while it was read")
    return copied


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.0f} MiB"


def verify(path: str | os.PathLike, digest: str) -> None:
    """The stored copy at `path` still hashes to `digest`; else ValueError."""
    path = Path(path)
    directory = path.parent if path.name == GGUF_NAME else path
    found = hashlib.sha256()
    for file in sorted(p for p in directory.iterdir() if not p.name.startswith(".")):
        found.update(f"{file.name}\0{file.stat().st_size}\0".encode())
        with open(file, "rb") as opened:
            while chunk := opened.read(CHUNK):
                found.update(chunk)
    if found.hexdigest() != digest:
        raise ValueError(f"the adapter's stored files changed since they were checked (digest {digest[:12]}...)")


# -- reading ------------------------------------------------------------------------------------
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]


class PeftConfig(BaseModel):
    """The fields of PEFT's `adapter_config.json` that change how a LoRA adapter computes; the
    others are PEFT's bookkeeping, ignored."""

    model_config = ConfigDict(extra="ignore")

    peft_type: Literal["LORA"] = "LORA"
    r: Annotated[int, Field(strict=True, gt=0)] = 8
    lora_alpha: Number = 8
    alpha_pattern: dict[str, Number] | None = None
    rank_pattern: dict[str, Annotated[int, Field(strict=True, gt=0)]] | None = None
    use_rslora: Annotated[bool, Field(strict=True)] = False
    use_dora: Literal[False, None] = False
    modules_to_save: Literal[None] | Annotated[list, Field(max_length=0)] = None
    fan_in_fan_out: Literal[False, None] = False
    bias: Literal["none"] = "none"


# A factor's module, as PEFT names it: "base_model.model.model.layers.0.self_attn.q_proj".
MODULE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.")
FLOAT_DTYPES = ("F32", "F16", "BF16")


def read_factors(path: str | os.PathLike) -> Factors:
    """The adapter's factors, read strictly (ValueError naming the first problem)."""
    path = Path(path)
    if path.suffix == ".gguf":
        return _read_gguf(path)
    return Factors(_read_peft(path))


def check(path: str | os.PathLike) -> None:
    """`read_factors` in a sandbox, bounded in time and memory: ValueError naming the problem."""
    from backends import sandbox

    sandbox.run(_summary, (str(path),), what="reading the adapter", timeout_s=CHECK_TIMEOUT_S,
                memory_bytes=CHECK_MEMORY_BYTES)


def _summary(path: str) -> int:
    return len(read_factors(path).modules)


def _read_peft(directory: Path) -> dict:
    config_file = directory / PEFT_CONFIG
    if not config_file.is_file():
        raise ValueError(f"{directory} is not a PEFT adapter directory (no {PEFT_CONFIG}) nor a GGUF file")
    if config_file.stat().st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"{PEFT_CONFIG} is larger than {_mib(MAX_CONFIG_BYTES)}")
    try:
        spec = PeftConfig.model_validate_json(config_file.read_bytes())
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the file"
        raise ValueError(f"{PEFT_CONFIG}: {where}: {first['msg']}") from None
    patterns = _compiled(spec.alpha_pattern or {})
    tensors, factors = _read_tensors(directory), {}
    for key, a in tensors.items():
        if ".lora_B." in key:
            continue
        module = _module(key, ".lora_A.")
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        rank = a.shape[0]
        alpha = next((value for pattern, value in patterns if pattern.match(module)), spec.lora_alpha)
        scaling = alpha / math.sqrt(rank) if spec.use_rslora else alpha / rank
        factors[module] = (a.float(), b.float() * scaling)
    if not factors:
        raise ValueError(f"{directory}: no LoRA factors in the adapter's weights")
    return factors


def _compiled(alpha_pattern: dict[str, float]) -> list[tuple[object, float]]:
    """PEFT's per-module alphas: the first key matching a module name's end (`(.*\\.)?(key)$`),
    compiled by RE2, which matches in linear time; a key RE2 cannot run is refused."""
    import re2

    if len(alpha_pattern) > MAX_PATTERNS:
        raise ValueError(f"{PEFT_CONFIG}: alpha_pattern has {len(alpha_pattern)} keys, more than {MAX_PATTERNS}")
    options = re2.Options()
    options.log_errors = False
    compiled = []
    for key, value in alpha_pattern.items():
        try:
            compiled.append((re2.compile(rf"(.*\.)?({key})$", options), value))
        except re2.error as exc:
            raise ValueError(f"{PEFT_CONFIG}: alpha_pattern key {key[:80]!r} is not a regular expression "
                             f"this server runs (RE2 syntax: {exc})") from None
    return compiled


def _module(key: str, marker: str) -> str:
    if not set(key) <= MODULE_CHARS or len(key) > 256 or marker not in key:
        raise ValueError(f"tensor {key[:80]!r} is not a LoRA factor")
    return key.split(marker)[0].removeprefix("base_model.model.")


def _read_tensors(directory: Path) -> dict:
    """Every tensor of the weights file, checked to be a 2-D float factor, A's and B's paired."""
    import torch

    safetensors = directory / PEFT_WEIGHTS[0]
    if safetensors.is_file():
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(safetensors, "pt") as opened:
                for key in opened.keys():
                    part = opened.get_slice(key)
                    _check_tensor(key, part.get_dtype(), part.get_shape())
                tensors = {key: opened.get_tensor(key) for key in opened.keys()}
        except SafetensorError as exc:
            raise ValueError(f"{PEFT_WEIGHTS[0]} is not a valid safetensors file: {exc}") from None
    elif (directory / PEFT_WEIGHTS[1]).is_file():
        try:
            tensors = torch.load(directory / PEFT_WEIGHTS[1], map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ValueError(f"{PEFT_WEIGHTS[1]} is not a readable PyTorch weights file: {exc}") from None
        if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            raise ValueError(f"{PEFT_WEIGHTS[1]} does not hold a dictionary of tensors")
        for key, tensor in tensors.items():
            _check_tensor(str(key), {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
                          .get(tensor.dtype, str(tensor.dtype)), list(tensor.shape))
    else:
        raise ValueError(f"{directory}: no {' or '.join(PEFT_WEIGHTS)}")
    for key, a in tensors.items():
        if ".lora_A." in key:
            b = tensors.get(key.replace(".lora_A.", ".lora_B."))
            if b is None:
                raise ValueError(f"{_module(key, '.lora_A.')} has lora_A but no lora_B")
            if b.shape[1] != a.shape[0]:
                raise ValueError(f"{_module(key, '.lora_A.')}: lora_A has rank {a.shape[0]}, lora_B {b.shape[1]}")
        elif ".lora_B." in key:
            if key.replace(".lora_B.", ".lora_A.") not in tensors:
                raise ValueError(f"{_module(key, '.lora_B.')} has lora_B but no lora_A")
        else:
            raise ValueError(f"tensor {key[:80]!r} is not a LoRA factor")
    return tensors


def _check_tensor(key: str, dtype: str, shape: list[int]) -> None:
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"tensor {key[:80]!r} is {dtype}, not a float type ({', '.join(FLOAT_DTYPES)})")
    if len(shape) != 2 or not all(shape):
        raise ValueError(f"tensor {key[:80]!r} has shape {list(shape)}, not a 2-D factor")


def _read_gguf(path: Path) -> Factors:
    """llama.cpp's LoRA GGUF (`convert_lora_to_gguf.py`): `general.type` adapter, `adapter.type` lora,
    tensors `<base tensor>.lora_a` [r, in] and `.lora_b` [out, r], scaled as llama.cpp's
    `build_lora_mm` scales them: `adapter.lora.alpha / r`, or 1 without an alpha."""
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from backends.builtin.worker.gguf_file import gguf_field
    from backends.builtin.worker.gguf_weights import hf_name

    try:
        reader = GGUFReader(path)
    except Exception as exc:
        raise ValueError(f"{path.name} is not a valid GGUF file: {exc}") from None
    if gguf_field(reader, "general.type") != "adapter" or gguf_field(reader, "adapter.type") != "lora":
        raise ValueError(f"{path.name} is not a GGUF LoRA adapter (general.type adapter, adapter.type lora)")
    alpha = gguf_field(reader, "adapter.lora.alpha", 0.0)
    architecture = gguf_field(reader, "general.architecture", "llama")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ValueError(f"{path.name}: adapter.lora.alpha is not a number")
    if not isinstance(architecture, str):
        raise ValueError(f"{path.name}: general.architecture is not a string")
    tensors = {}
    for tensor in reader.tensors:
        shape = list(reversed(tensor.shape.tolist()))
        if len(shape) != 2 or not all(shape):
            raise ValueError(f"tensor {tensor.name[:80]!r} has shape {shape}, not a 2-D factor")
        array = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        tensors[tensor.name] = torch.from_numpy(array.astype("float32"))
    factors = {}
    for name, a in tensors.items():
        if not name.endswith(".lora_a"):
            if not name.endswith(".lora_b"):
                raise ValueError(f"tensor {name[:80]!r} is not a LoRA factor")
            continue
        base = name.removesuffix(".lora_a")
        b = tensors.get(f"{base}.lora_b")
        if b is None or b.shape[1] != a.shape[0]:
            raise ValueError(f"{base[:80]}: lora_a of rank {a.shape[0]} has no lora_b of that rank")
        try:
            module = hf_name(base, architecture).removesuffix(".weight")
        except (KeyError, ValueError):
            raise ValueError(f"target {base[:80]} is not supported") from None
        factors[module] = (a, b * (alpha / a.shape[0] if alpha else 1.0))
    if not factors:
        raise ValueError(f"{path.name}: no LoRA factors in the adapter")
    return Factors(factors, architecture)
