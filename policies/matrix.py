"""Support matrices (policies/matrices/<runtime>.yaml): what each runtime supports, cell by cell.

Every cell has a status (yes / no / partial / unverified / unknown), a source (a key of the
file's `sources`, each a URL or repo + path + commit), the version or date it was checked (the
source's, unless the cell says otherwise) and, where the runtime's code decides it, `line`: the
file, release and symbol that decide it. `code` lists the checks `policies.drift` re-runs on
the released source. A cell is written either as a mapping or, for the common case, as one line:
`"<status> <source key>[ | note]"`.

A cell limited by hardware names where it holds (`hardware`) and where its source says it does
not (`not_on`); a family in neither is "unknown" there, never "no": a source that does not
cover a family says nothing about it."""

from __future__ import annotations

import fnmatch
import re
from functools import cache
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Status = Literal["yes", "no", "partial", "unverified", "unknown"]
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
_ONE_LINE = re.compile(r"(yes|no|partial|unverified|unknown)\s+([\w-]+)(?:\s+\|\s*(.*))?", re.S)


class Source(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ref: str = Field(min_length=8)  # a URL, or repo + path (+ commit)
    checked: str = Field(min_length=4)  # the version or date the facts were read for


def _matches(family: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(family, pattern) for pattern in patterns)


class Probe(BaseModel):
    """One mechanical check on a runtime's released source (run by policies.drift): `listed` +
    `has` (a literal list, tuple, set, dict or Literal[...] of strings assigned to a name holds an
    item), `min_capability` (a class's get_min_capability() returns a CUDA capability: the
    NVIDIA families from it on hold) or `matches` (a regex matches a line). The cell holds on
    `families` where the check passes and not where it fails."""
    model_config = ConfigDict(extra="forbid")
    file: str
    families: list[str]
    listed: str | None = None
    has: str | None = None
    within: str | None = None  # the class `listed` is assigned in, where the file assigns it more than once
    min_capability: str | None = None
    matches: str | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> Probe:
        kinds = [k for k in ("listed", "min_capability", "matches") if getattr(self, k)]
        if len(kinds) != 1 or (self.listed and not self.has):
            raise ValueError(f"{self.file}: a probe is one of listed + has, min_capability or matches")
        return self


class Cell(BaseModel):
    model_config = ConfigDict(extra="forbid")
    status: Status
    source: str = Field(min_length=1)
    note: str = ""
    flag: str | None = None  # how to ask for it
    default: bool | None = None  # on without asking (features)
    hardware: list[str] | None = None  # families where it holds (globs); None: wherever the runtime runs
    not_on: list[str] = []  # families where its source says it does not hold (globs)
    line: str | None = None  # the code that decides it: "path @ release: symbol (line N)"
    code: list[Probe] = []  # checks policies.drift re-runs on the released source
    requires: list[str] = []  # other settings it needs, e.g. flash_attention
    runs_on: Literal["accelerator", "cpu"] = "accelerator"  # a hardware cell: the cores it computes on there
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
                raise ValueError(f"{data!r}: a one-line cell reads '<status> <source key>[ | note]'")
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

    def on(self, family: str) -> Status:
        """Its status on one hardware family: `no` where its source says so, `unknown` where the
        source covers other families only."""
        if self.hardware is None or _matches(family, self.hardware):
            return self.status
        return "no" if _matches(family, self.not_on) else "unknown"



class Memory(Cell):
    fraction_of: Literal["total", "free", "none"]  # what the runtime's memory fraction is a share of
    default_fraction: float | None = None
    fraction_by_device: Literal["sglang"] | None = None  # the default follows the device's memory instead
    fraction_covers: Literal["all", "weights_and_kv"] = "all"  # what the runtime itself keeps outside it
    kv_dtype: str = "bf16"  # the KV cache's default element type
    compute_dtype: str | None = None  # weights are held in this type whatever the file's format
    reserve_gib: float | None = None  # what the runtime keeps outside weights and KV, by its own count
    earlier_fractions: dict[str, float] = {}  # release -> the default fraction of the releases before it
    status: Status = "yes"

    def fraction_for(self, memory_gib: float, tp: int, version: str | None = None) -> float | None:
        """The default fraction on a device of `memory_gib` in a `tp`-way group, in the matrix's
        release or, given an older `version` (a published measurement's), in that one."""
        if self.fraction_by_device:
            return sglang_mem_fraction_static(memory_gib, tp)
        older = [(_release(r), f) for r, f in self.earlier_fractions.items() if _release(version) < _release(r)]
        return min(older)[1] if older else self.default_fraction


def _release(version: str | None) -> tuple[int, ...]:
    """A version's numbers ('vLLM 0.10.2 (rocm image)' -> (0, 10, 2)); past every release when it
    has none."""
    match = re.search(r"(\d+(?:\.\d+)+)", version or "")
    return tuple(int(n) for n in match[1].split(".")) if match else (10**6,)


def sglang_mem_fraction_static(memory_gib: float, tp: int) -> float:
    """SGLang 0.5.23's default --mem-fraction-static (arg_groups/memory_hook.py,
    handle_gpu_memory_settings and reserve_for_graph_mb, without DP attention, MLA, speculative
    decoding or pipeline parallelism): (memory - reserved) / memory, reserving MiB for constants
    (512), prefill activations (1.5 x the chunked-prefill size), the group (tp / 8 x 1024),
    decode CUDA graphs (2 x their largest batch) and prefill CUDA graphs (8 per captured size), at
    least 10 GiB on devices above 60 GiB; chunk and graph sizes by the device's memory."""
    mib = memory_gib * 1024
    # (below GiB, chunk, decode graph batch at tp < 4, at tp >= 4); prefill graph sizes by chunk
    tiers = [(20, 2048, 8, 8), (35, 4096, 48, 160), (60, 4096, 32, 160), (90, 8192, 256, 512), (160, 8192, 256, 512)]
    chunk, graphs = next(((c, small if tp < 4 else large) for below, c, small, large in tiers if mib < below * 1024),
                         (16384, 512))
    prefill_graphs = {2048: 42, 4096: 50, 8192: 58, 16384: 74}[chunk]
    reserved = 512 + max(chunk, 2048) * 1.5 + tp / 8 * 1024 + graphs * 2 + prefill_graphs * 8
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


class Release(BaseModel):
    """Where a release's source comes from: a package on the Python registry (a wheel's tree at
    the top, or `subdir` of an sdist as `at`), or a git repository at a tag or commit (as `at`),
    which policies.drift reads from a checkout it is given."""
    model_config = ConfigDict(extra="forbid")
    pip: str | None = None  # name==version
    subdir: str | None = None
    git: str | None = None  # owner/name
    ref: str | None = None
    at: str | None = None  # the folder its files sit under in the probes' paths

    @model_validator(mode="after")
    def _one_place(self) -> Release:
        if bool(self.pip) == bool(self.git) or (self.git and not (self.ref and self.at)):
            raise ValueError("a release is `pip: name==version` or `git: owner/name` with `ref` and `at`")
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
    release: list[Release] = []  # the released source policies.drift reads the `code` checks on
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
            for pattern in [*(cell.hardware or ()), *cell.not_on, *(f for p in cell.code for f in p.families)]:
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
