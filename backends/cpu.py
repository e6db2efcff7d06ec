"""What this CPU can really run, for native code that trusts its feature flags.

A CPU may report AMX (`amx_tile` in /proc/cpuinfo) that a program cannot use: a hypervisor may
not grant the tile state, and llama.cpp's AMX path may fail even where the tile instructions run.
Trusting the flag there kills the process on its first tile instruction (SIGILL or SIGSEGV), so
each consumer has the flag confirmed by a child process first: PyTorch's bf16 GEMMs (oneDNN) by
a child that asks for the tile-data permission and runs the tile instructions (`bf16_native`),
llama.cpp by a child that loads the default model with its AMX buffer type and evaluates a
prompt (`llama_cpp_amx_fails`). Where llama.cpp's child dies, llama.cpp skips its extra
(repacking) buffer types, AMX among them (`llama_cpp_safe`; `for_this_cpu` for a server's command
line).

`python -m backends.cpu MODULE ARGS...` runs a module (llama-cpp-python's server) under the
same guard.
"""

from __future__ import annotations

import functools
import runpy
import subprocess
import sys
from pathlib import Path

from .default_model import default_model_path

# Asks Linux for the AMX tile-data permission (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)),
# then runs one tile instruction of each kind on a 16x64-byte tile; exit 0 only if all of it ran.
_AMX_PROBE = """
import ctypes, mmap, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.syscall(158, 0x1023, 18):
    sys.exit(3)
code = bytes.fromhex("c4e2784907" "c4e27b49c0" "c4e27849c0" "c3")  # ldtilecfg [rdi]; tilezero tmm0; tilerelease; ret
page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(code)
config = (ctypes.c_ubyte * 64)()
config[0], config[16], config[48] = 1, 64, 16  # palette 1; tile 0: 64 bytes a row, 16 rows
ctypes.CFUNCTYPE(None, ctypes.c_void_p)(ctypes.addressof(ctypes.c_char.from_buffer(page)))(ctypes.addressof(config))
"""


def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def amx_probe() -> int:
    """The probe child's exit status: 0 ran, 3 the kernel refused the permission, -4 SIGILL."""
    return subprocess.run([sys.executable, "-c", _AMX_PROBE], capture_output=True, timeout=30).returncode


@functools.cache
def amx_reported_but_unusable() -> bool:
    """True where the CPU says it has AMX but a program cannot run its tile instructions."""
    return "amx_tile" in cpu_flags() and amx_probe() != 0


# Loads a GGUF with llama.cpp's default (extra) buffer types, AMX among them, and evaluates a prompt.
_LLAMA_AMX_PROBE = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=64, n_threads=1, verbose=False)
llm.eval(llm.tokenize(b"The three primary colors are"))
"""


def llama_amx_probe() -> int:
    """The llama.cpp child's exit status: 0 ran, negative a signal (-11 SIGSEGV, -4 SIGILL), 1 an
    error (llama-cpp-python missing)."""
    return subprocess.run([sys.executable, "-c", _LLAMA_AMX_PROBE, str(default_model_path())], capture_output=True,
                          timeout=120).returncode


@functools.cache
def llama_cpp_amx_fails() -> bool:
    """True where the CPU says it has AMX and llama.cpp's AMX path does not run (or cannot be tried)."""
    return "amx_tile" in cpu_flags() and (amx_reported_but_unusable() or llama_amx_probe() != 0)


def bf16_native() -> str | None:
    """The instructions this CPU multiplies bfloat16 with (oneDNN uses them through PyTorch), or
    None where bf16 would be emulated and slower than float32."""
    flags = cpu_flags()
    if "amx_bf16" in flags and not amx_reported_but_unusable():
        return "AMX-BF16"
    return "AVX512-BF16" if "avx512_bf16" in flags else None


def llama_cpp_safe() -> None:
    """Make llama-cpp-python's `Llama` skip llama.cpp's extra buffer types where its AMX path fails
    (its constructor takes the model parameters from `llama_model_default_params` and has no
    argument for `use_extra_bufts`). Elsewhere nothing changes: the repacked AVX2 / AVX-512
    layouts, and working AMX, stay on."""
    if not llama_cpp_amx_fails():
        return
    import llama_cpp.llama_cpp as native

    defaults = native.llama_model_default_params
    if getattr(defaults, "servegate_no_extra_bufts", False):
        return

    def without_extra_bufts():
        params = defaults()
        params.use_extra_bufts = False
        return params

    without_extra_bufts.servegate_no_extra_bufts = True
    native.llama_model_default_params = without_extra_bufts


def for_this_cpu(argv: list[str]) -> list[str]:
    """A llama.cpp server's command line as it must run here: where llama.cpp's AMX path fails,
    llama-cpp-python's server under this module's guard and `llama-server` with `--no-repack`
    (its switch for the extra buffer types). Elsewhere, and for other programs, `argv` itself."""
    if not llama_cpp_amx_fails():
        return argv
    if argv[1:3] == ["-m", "llama_cpp.server"]:
        return [argv[0], "-m", "backends.cpu", *argv[2:]]
    if Path(argv[0]).name == "llama-server":
        return [*argv, "--no-repack"]
    return argv


if __name__ == "__main__":
    llama_cpp_safe()
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
