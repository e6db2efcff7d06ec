"""Re-derive the support matrices' cells from the runtimes' released source and report drift.

    python -m policies.drift [--source tgi=DIR ...] [--tree vllm=DIR ...] [--runtime vllm ...]

For each matrix with a `release`, the source is fetched from the Python package registry (`pip
download`: a wheel's Python tree, or a folder of an sdist) or read from a checkout given with
`--source AT=DIR` (git releases: TGI, TensorRT-LLM, tpu-inference and Ollama are no registry
packages); `--tree RUNTIME=DIR` reads a runtime's source already laid out. Every cell's `code`
checks run on it; what they find is written to policies/matrices/derived/<runtime>.yaml with the
line that decided each, and compared with the cell: a family where the code says yes must read
yes or partial, one where it says no must read no. The tests compare the committed cells with
that last output, so a cell edited by hand against its code, or a check added without re-running
this, fails CI.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from .matrix import HARDWARE_FAMILIES, MATRICES, Matrix, Probe, Release, matrices

DERIVED = MATRICES / "derived"
# The lowest CUDA compute capability of each NVIDIA family (x10), as get_min_capability() counts.
NVIDIA_CAPABILITY = {"nvidia-maxwell": 50, "nvidia-pascal": 60, "nvidia-volta": 70, "nvidia-turing": 75,
                     "nvidia-ampere": 80, "nvidia-ada": 89, "nvidia-hopper": 90, "nvidia-blackwell": 100}
SOURCE_SUFFIXES = (".py", ".rs", ".go", ".h", ".c", ".cpp", ".cu", ".cuh", ".m", ".txt", ".cmake", ".json", ".toml")


class ProbeError(ValueError):
    """A check that no longer finds what it reads (the file, the name, the method is gone)."""


@dataclass(frozen=True)
class Finding:
    holds: bool
    line: str  # path:line


def families(patterns: list[str]) -> list[str]:
    return [f for f in HARDWARE_FAMILIES if any(fnmatch.fnmatch(f, p) for p in patterns)]


def run_probe(probe: Probe, root: Path) -> tuple[dict[str, bool], Finding]:
    """What one check says, family by family, and the line it read."""
    path = root / probe.file
    if not path.is_file():
        raise ProbeError(f"{probe.file}: no such file in the release")
    text = path.read_text(errors="replace")
    if probe.matches:
        pattern = re.compile(probe.matches)
        line = next((n for n, row in enumerate(text.splitlines(), 1) if pattern.search(row)), None)
        finding = Finding(line is not None, f"{probe.file}:{line or '-'}")
        return {f: finding.holds for f in families(probe.families)}, finding
    tree = ast.parse(text)
    if probe.listed:
        items, line = _literal_strings(tree, probe.listed, probe.within, probe.file)
        finding = Finding(probe.has in items, f"{probe.file}:{line}")
        return {f: finding.holds for f in families(probe.families)}, finding
    capability, line = _min_capability(tree, probe.min_capability, probe.file)
    verdicts = {f: NVIDIA_CAPABILITY.get(f, 0) >= capability if f in NVIDIA_CAPABILITY else True
                for f in families(probe.families)}
    return verdicts, Finding(True, f"{probe.file}:{line} (>= {capability})")


def _literal_strings(tree: ast.Module, name: str, within: str | None, file: str) -> tuple[set[str], int]:
    """The strings of the literal assigned to `name` at module level or in a class body (of
    `within`, where given)."""
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == (within or n.name)]
    if within and not classes:
        raise ProbeError(f"{file}: no class {within}")
    statements = [*([] if within else tree.body), *(s for c in classes for s in c.body)]
    found = [s for s in statements if (isinstance(s, ast.Assign) and any(_named(t) == name for t in s.targets))
             or (isinstance(s, ast.AnnAssign) and s.value is not None and _named(s.target) == name)]
    if len(found) != 1:
        raise ProbeError(f"{file}: {name} is assigned {len(found)} times (one expected; give `within`)")
    value = found[0].value
    if isinstance(value, ast.Subscript):  # Literal["a", "b"]
        value = value.slice if isinstance(value.slice, ast.Tuple) else ast.Tuple(elts=[value.slice])
    elements = value.keys if isinstance(value, ast.Dict) else getattr(value, "elts", None)
    if elements is None:
        raise ProbeError(f"{file}: {name} is not a literal list, tuple, set, dict or Literal[...]")
    return {e.value for e in elements if isinstance(e, ast.Constant) and isinstance(e.value, str)}, found[0].lineno


def _named(target: ast.expr) -> str | None:
    return target.id if isinstance(target, ast.Name) else target.attr if isinstance(target, ast.Attribute) else None


def _min_capability(tree: ast.Module, cls: str, file: str) -> tuple[int, int]:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for method in node.body:
                if isinstance(method, ast.FunctionDef) and method.name == "get_min_capability":
                    returns = [r for r in ast.walk(method) if isinstance(r, ast.Return)
                               and isinstance(r.value, ast.Constant) and isinstance(r.value.value, int)]
                    if returns:
                        return returns[-1].value.value, returns[-1].lineno
    raise ProbeError(f"{file}: no {cls}.get_min_capability returning a number")


def derive(matrix: Matrix, root: Path) -> dict:
    """Every checked cell's families by what its code says, with the lines read."""
    cells = {}
    for path, cell in matrix.cells():
        if not cell.code:
            continue
        says: dict[str, bool] = {}
        lines = []
        for probe in cell.code:
            verdicts, finding = run_probe(probe, root)
            lines.append(finding.line)
            for family, holds in verdicts.items():
                says[family] = says.get(family, False) or holds
        cells[path] = {"yes": [f for f in HARDWARE_FAMILIES if says.get(f) is True],
                       "no": [f for f in HARDWARE_FAMILIES if says.get(f) is False], "lines": lines}
    return cells


def drift(matrix: Matrix, derived: dict) -> list[str]:
    """Where the matrix's cells disagree with what their code said, on the families the runtime
    runs on; and checks that changed since the output was written."""
    problems = []
    runs_on = {f for f, c in matrix.hardware.items() if c.status != "no"}
    checked = dict(matrix.cells())
    for path, cell in checked.items():
        if cell.code and path not in derived:
            problems.append(f"{path}: its code checks were never run (run python -m policies.drift)")
    for path, said in derived.items():
        cell = checked.get(path)
        if cell is None or not cell.code:
            problems.append(f"{path}: derived, but the matrix has no code checks for it")
            continue
        if len(said["lines"]) != len(cell.code):
            problems.append(f"{path}: its code checks changed since the last derivation")
        for family in set(said["yes"]) & runs_on:
            if cell.on(family) not in ("yes", "partial"):
                problems.append(f"{path} on {family}: the code says yes ({', '.join(said['lines'])}), "
                                f"the matrix {cell.on(family)}")
        for family in set(said["no"]) & runs_on:
            if cell.on(family) != "no":
                problems.append(f"{path} on {family}: the code says no ({', '.join(said['lines'])}), "
                                f"the matrix {cell.on(family)}")
    return problems


def fetch(release: Release, into: Path, checkouts: dict[str, Path]) -> None:
    """Lay one release's source under `into`."""
    if release.git:
        checkout = checkouts.get(release.git) or checkouts.get(release.at or "")
        if checkout is None:
            raise ProbeError(f"{release.git} @ {release.ref} is no registry package: pass --source "
                             f"{release.at}=DIR (a checkout of it)")
        (into / release.at).symlink_to(checkout.resolve())
        return
    with tempfile.TemporaryDirectory() as download:
        # Any Linux x86-64 wheel of it: the Python tree is the same in each.
        wheel = ["--only-binary", ":all:", *(arg for tag in ("manylinux_2_34_x86_64", "manylinux_2_28_x86_64",
                                                           "manylinux2014_x86_64", "any")
                                             for arg in ("--platform", tag))]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", download,
                        *([] if release.subdir else wheel), release.pip], check=True)
        (archive,) = Path(download).iterdir()
        if archive.suffix == ".whl":
            with zipfile.ZipFile(archive) as wheel_file:
                wheel_file.extractall(into, [n for n in wheel_file.namelist() if n.endswith(SOURCE_SUFFIXES)])
            return
        with tarfile.open(archive) as sdist:
            sdist.extractall(download, filter="data")
        (top,) = [p for p in Path(download).iterdir() if p.is_dir()]
        (top / release.subdir).rename(into / release.at)


def write(matrix: Matrix, cells: dict) -> Path:
    DERIVED.mkdir(exist_ok=True)
    out = DERIVED / f"{matrix.runtime}.yaml"
    releases = [r.pip or f"{r.git}@{r.ref}" for r in matrix.release]
    header = (f"# Written by `python -m policies.drift` from {', '.join(releases)}: what each checked cell's code\n"
              "# says, family by family, and the lines that said it. Do not edit by hand.\n")
    out.write_text(header + yaml.safe_dump({"runtime": matrix.runtime, "release": releases, "cells": cells},
                                           sort_keys=False, width=120))
    return out


def load_derived(runtime: str) -> dict:
    path = DERIVED / f"{runtime}.yaml"
    return yaml.safe_load(path.read_text())["cells"] if path.exists() else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m policies.drift", description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", action="append", default=[], metavar="NAME=DIR",
                        help="a checkout of a git release (NAME: its owner/name or `at` folder)")
    parser.add_argument("--tree", action="append", default=[], metavar="RUNTIME=DIR",
                        help="a runtime's whole source, laid out as its checks read it, instead of fetching it")
    parser.add_argument("--runtime", action="append", help="only these runtimes (default: every matrix with a release)")
    args = parser.parse_args(argv)
    checkouts, trees = (_folders(parser, flag, given) for flag, given in (("--source", args.source),
                                                                          ("--tree", args.tree)))
    status = 0
    for runtime, matrix in matrices().items():
        if not matrix.release or (args.runtime and runtime not in args.runtime):
            continue
        with tempfile.TemporaryDirectory() as fresh:
            root = trees.get(runtime, Path(fresh))
            try:
                for release in matrix.release if runtime not in trees else ():
                    fetch(release, root, checkouts)
                cells = derive(matrix, root)
            except (ProbeError, subprocess.CalledProcessError) as exc:
                print(f"{runtime}: not derived: {exc}")
                status = 1
                continue
        write(matrix, cells)
        problems = drift(matrix, cells)
        checks = sum(len(c.code) for _, c in matrix.cells())
        print(f"{runtime} ({', '.join(r.pip or f'{r.git}@{r.ref}' for r in matrix.release)}): {len(cells)} cells "
              f"from {checks} checks; " + (f"{len(problems)} drifted" if problems else "no drift"))
        for problem in problems:
            print(f"  {problem}")
        status |= bool(problems)
    return status


def _folders(parser: argparse.ArgumentParser, flag: str, given: list[str]) -> dict[str, Path]:
    folders = {}
    for pair in given:
        name, _, folder = pair.partition("=")
        if not Path(folder).is_dir():
            parser.error(f"{flag} {pair}: {folder!r} is not a folder")
        folders[name] = Path(folder)
    return folders


if __name__ == "__main__":
    raise SystemExit(main())
