"""Support matrices (policies/matrices/<runtime>.yaml): what each runtime supports, cell by cell.

Every cell has a status (yes / no / partial / unverified), a source (a key of the file's
`sources`, each a URL or repo + path + commit) and the version or date it was checked (the
source's, unless the cell says otherwise). A cell is written either as a mapping or, for the
common case, as one line: `"<status> <source key>[ | note]"`."""

from __future__ import annotations

import fnmatch
import re
from functools import cache
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Status = Literal["yes", "no", "partial", "unverified"]
MATRICES = Path(__file__).parent / "matrices"

# The hardware families every matrix answers for (a catalogue device names one of them).
HARDWARE_FAMILIES = (
    "nvidia-maxwell", "nvidia-pascal", "nvidia-volta", "nvidia-turing", "nvidia-ampere", "nvidia-ada",
    "nvidia-hopper", "nvidia-blackwell", "amd-cdna2", "amd-cdna3", "amd-cdna4", "amd-rdna3", "amd-rdna4",
    "intel-gaudi", "intel-xpu", "cpu-x86", "cpu-arm", "apple-metal", "google-tpu", "aws-neuron", "huawei-ascend",
)
FEATURES = ("prefix_caching", "continuous_batching", "chunked_prefill", "speculative_decoding", "structured_output",
            "multi_lora", "tensor_parallel", "pipeline_parallel", "pd_disaggregation", "openai_api",
            "prometheus_metrics", "needs_engine_build")
_ONE_LINE = re.compile(r"(yes|no|partial|unverified)\s+([\w-]+)(?:\s+\|\s*(.*))?", re.S)


class Source(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ref: str = Field(min_length=8)  # a URL, or repo + path (+ commit)
    checked: str = Field(min_length=4)  # the version or date the facts were read for


class Cell(BaseModel):
    model_config = ConfigDict(extra="forbid")
    status: Status
    source: str = Field(min_length=1)
    note: str = ""
    flag: str | None = None  # how to ask for it
    default: bool | None = None  # on without asking (features)
    hardware: list[str] | None = None  # families where it holds (globs); None: wherever the runtime runs
    requires: list[str] = []  # other settings it needs, e.g. flash_attention
    value: str | None = None  # e.g. a licence name
    checked: str | None = None  # filled from the source when absent

    @model_validator(mode="before")
    @classmethod
    def _one_line(cls, data):
        if isinstance(data, bool):  # YAML read a bare yes / no: the source is missing
            data = "yes" if data else "no"
        if isinstance(data, str):
            match = _ONE_LINE.fullmatch(data.strip())
            if not match:
                raise ValueError(f"{data!r}: a one-line cell reads '<yes|no|partial|unverified> <source key>[ | note]'")
            return {"status": match[1], "source": match[2], "note": match[3] or ""}
        return data

    @field_validator("status", mode="before")
    @classmethod
    def _yaml_boolean(cls, status):
        """YAML reads a bare yes / no as a boolean."""
        return {True: "yes", False: "no"}.get(status, status) if isinstance(status, bool) else status

    @property
    def usable(self) -> bool:
        return self.status in ("yes", "partial")

    def holds_on(self, family: str) -> bool:
        return self.hardware is None or any(fnmatch.fnmatch(family, pattern) for pattern in self.hardware)


class Memory(Cell):
    fraction_of: Literal["total", "free", "none"]  # what the runtime's memory fraction is a share of
    default_fraction: float | None = None
    fraction_by_device: Literal["sglang"] | None = None  # the default follows the device's memory instead
    fraction_covers: Literal["all", "weights_and_kv"] = "all"  # what the runtime itself keeps outside it
    kv_dtype: str = "bf16"  # the KV cache's default element type
    compute_dtype: str | None = None  # weights are held in this type whatever the file's format
    status: Status = "yes"

    def fraction_for(self, memory_gib: float, tp: int) -> float | None:
        """The default fraction on a device of `memory_gib` in a `tp`-way group."""
        return sglang_mem_fraction_static(memory_gib, tp) if self.fraction_by_device else self.default_fraction


def sglang_mem_fraction_static(memory_gib: float, tp: int) -> float:
    """SGLang's default --mem-fraction-static (server_args.py, ServerArgs._handle_gpu_memory_settings,
    without DP attention, piecewise CUDA graphs or speculative decoding): (memory - reserved) /
    memory, reserving MiB for constants (512), prefill activations (1.5 x the chunked-prefill
    size), CUDA graphs (2 x their largest batch) and the group (tp / 8 x 1024), at least 10 GiB on
    devices above 60 GiB; chunk and graph sizes by the device's memory."""
    mib = memory_gib * 1024
    tiers = [(20, 2048, 8, 8), (35, 2048, 24, 80), (60, 4096, 32, 160), (90, 8192, 256, 512), (160, 8192, 256, 512)]
    chunk, graphs = next(((c, small if tp < 4 else large) for below, c, small, large in tiers if mib < below * 1024),
                         (16384, 512))
    reserved = 512 + max(chunk, 2048) * 1.5 + graphs * 2 + tp / 8 * 1024
    if mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((mib - reserved) / mib, 3)


class Launch(BaseModel):
    """How to start it: `servegate launch <servegate>` (which builds the runtime's own command
    from one spec), or, for runtimes it does not launch, a command template."""
    model_config = ConfigDict(extra="forbid")
    servegate: str | None = None
    command: str | None = None

    @model_validator(mode="after")
    def _one_way(self) -> Launch:
        if not (self.servegate or self.command):
            raise ValueError("launch needs `servegate` (a `servegate launch` runtime) or a `command` template")
        return self


class Matrix(BaseModel):
    model_config = ConfigDict(extra="forbid")
    runtime: str
    name: str
    version: str
    checked: str
    license: Cell
    maintained: Cell
    memory: Memory
    launch: Launch
    sources: dict[str, Source]
    hardware: dict[str, Cell]
    kv_cache: dict[str, Cell]
    weight_quant: dict[str, Cell]
    moe: dict[Literal["support", "expert_parallel"], Cell]
    features: dict[str, Cell]
    architectures: dict[str, Cell]

    @field_validator("hardware")
    @classmethod
    def _every_family(cls, cells: dict[str, Cell]) -> dict[str, Cell]:
        unknown, missing = set(cells) - set(HARDWARE_FAMILIES), set(HARDWARE_FAMILIES) - set(cells)
        if unknown or missing:
            raise ValueError(f"hardware families unknown: {sorted(unknown)}, missing: {sorted(missing)}")
        return cells

    @field_validator("features")
    @classmethod
    def _every_feature(cls, cells: dict[str, Cell]) -> dict[str, Cell]:
        if missing := set(FEATURES) - set(cells):
            raise ValueError(f"features missing: {sorted(missing)}")
        return cells

    @model_validator(mode="after")
    def _sources_resolve(self) -> Matrix:
        for path, cell in self.cells():
            if cell.source not in self.sources:
                raise ValueError(f"{path}: source {cell.source!r} is not among this file's sources "
                                 f"({', '.join(self.sources)})")
            cell.checked = cell.checked or self.sources[cell.source].checked
            for pattern in cell.hardware or ():
                if not fnmatch.filter(HARDWARE_FAMILIES, pattern):
                    raise ValueError(f"{path}: hardware {pattern!r} matches no family")
        return self

    def cells(self):
        """(path, cell) for every cell, e.g. ("kv_cache.fp8_e4m3", Cell)."""
        yield "license", self.license
        yield "maintained", self.maintained
        yield "memory", self.memory
        for section in ("hardware", "kv_cache", "weight_quant", "moe", "features", "architectures"):
            for key, cell in getattr(self, section).items():
                yield f"{section}.{key}", cell

    def cite(self, cell: Cell) -> str:
        """Where a cell's fact comes from, for a report."""
        return f"{self.sources[cell.source].ref} (checked {cell.checked})"


def load_matrix(path: Path) -> Matrix:
    try:
        return Matrix.model_validate(yaml.safe_load(path.read_text()))
    except ValueError as exc:
        raise ValueError(f"{path.name}: {exc}") from exc


@cache
def matrices() -> dict[str, Matrix]:
    """Every shipped matrix by runtime id."""
    loaded = [load_matrix(path) for path in sorted(MATRICES.glob("*.yaml"))]
    return {m.runtime: m for m in loaded}
