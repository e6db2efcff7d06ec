"""The peers `servegate bench --compare` measures the built-in engine against, in the same run.

- `hf-static`: the naive service: Hugging Face transformers `generate()` over static batches.
  Requests wait while a batch runs; a batch runs until its longest member ends; nothing is
  cached across requests. Tokens are streamed per step, so TTFT and ITL are its real ones.
- `llama-cpp`: llama-cpp-python's OpenAI server on the same GGUF file, started as its users do.
- `builtin`: `servegate serve` itself, over HTTP like the others that run as servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from backends.base import (
    Backend,
    Capabilities,
    Delta,
    Event,
    Finish,
    GenerateRequest,
    Health,
    InvalidRequest,
    Load,
    Usage,
)
from backends.launch import free_port, supervised


@dataclass
class _Pending:
    request: GenerateRequest
    prompt_ids: list[int]
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class _BatchStreamer:
    """A transformers streamer that hands each step's new tokens to every request of the batch."""

    def __init__(self, batch: list[_Pending]) -> None:
        self.batch, self.prompt_seen = batch, False

    def put(self, value) -> None:
        if not self.prompt_seen:  # generate() first passes the prompt
            self.prompt_seen = True
            return
        for pending, token in zip(self.batch, value.reshape(-1).tolist()):
            pending.loop.call_soon_threadsafe(pending.queue.put_nowait, token)

    def end(self) -> None:
        for pending in self.batch:
            pending.loop.call_soon_threadsafe(pending.queue.put_nowait, None)


class HFStaticBackend(Backend):
    def __init__(self, model_dir: str | Path, max_batch_size: int = 8, name: str = "hf-static") -> None:
        self.name, self.model_dir, self.max_batch_size = name, Path(model_dir), max_batch_size
        self.model = self.tokenizer = None
        self._waiting: list[_Pending] = []
        self._cv = threading.Condition()
        self._stopped = False

    async def start(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = await asyncio.to_thread(
            lambda: AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval())
        threading.Thread(target=self._loop, name="hf-static", daemon=True).start()

    async def close(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._stopped:
                    self._cv.wait()
                if self._stopped:
                    return
                batch, self._waiting = self._waiting[: self.max_batch_size], self._waiting[self.max_batch_size :]
            self._run(batch)

    def _run(self, batch: list[_Pending]) -> None:
        import torch

        width = max(len(p.prompt_ids) for p in batch)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.tensor([[pad] * (width - len(p.prompt_ids)) + p.prompt_ids for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p.prompt_ids)) + [1] * len(p.prompt_ids) for p in batch])
        longest = max(p.request.max_tokens for p in batch)
        ignore_eos = any(p.request.ignore_eos for p in batch)
        with torch.inference_mode():
            self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, do_sample=False,
                                min_new_tokens=longest if ignore_eos else None, pad_token_id=pad,
                                streamer=_BatchStreamer(batch))

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        if request.prompt is None or not request.max_tokens:
            raise InvalidRequest("hf-static takes a text prompt and max_tokens")
        prompt_ids = self.tokenizer.encode(request.prompt)
        pending = _Pending(request, prompt_ids, asyncio.get_running_loop())
        with self._cv:
            self._waiting.append(pending)
            self._cv.notify()
        produced: list[int] = []
        text = ""
        while (token := await pending.queue.get()) is not None:
            if len(produced) == request.max_tokens:
                continue  # the batch runs on for its longest member; this slot idles
            produced.append(token)
            full = self.tokenizer.decode(produced, skip_special_tokens=True)
            yield Delta(0, full[len(text):], (token,))
            text = full
            if not request.ignore_eos and token == self.tokenizer.eos_token_id:
                break
        reason = "length" if len(produced) == request.max_tokens else "stop"
        yield Finish((reason,), Usage(len(prompt_ids), len(produced)))

    async def capabilities(self) -> Capabilities:
        return Capabilities(runtime="hf-static", version="baseline", model=self.model_dir.name, max_context=0,
                            prefix_caching=False)

    async def health(self) -> Health:
        return Health.READY if self.model is not None else Health.LOADING

    async def load(self) -> Load:
        return Load(waiting=len(self._waiting))


@contextlib.contextmanager
def server_process(command: list[str], base_url: str, ready_path: str, timeout: float = 300,
                   env: dict[str, str] | None = None) -> Iterator[str]:
    """Run a server as a subprocess until the block ends; yields its base URL once it answers."""
    with supervised(command, base_url, ready_path, env, timeout):
        yield base_url


def llama_cpp_command(model: Path, port: int, interrupt_requests: bool = False, threads: int | None = None,
                      n_ctx: int = 4096) -> list[str]:
    """llama-cpp-python's server as its users start it. Its default `interrupt_requests=True` ends
    an in-flight stream whenever a new request arrives: a fair comparison turns it off."""
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--n_ctx", str(n_ctx), "--n_threads", str(threads or os.cpu_count() or 1),
            "--interrupt_requests", str(interrupt_requests)]


def servegate_command(port: int, model: str = "") -> list[str]:
    command = [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--log-level", "warning"]
    return command + (["--model", model] if model else [])


@contextlib.contextmanager
def servegate_env() -> Iterator[tuple[dict[str, str], str]]:
    """A throwaway database, spool and admin key for a `servegate serve` subprocess: (env, key)."""
    import secrets
    import tempfile

    key = f"sg-bench-{secrets.token_hex(16)}"
    with tempfile.TemporaryDirectory(prefix="servegate-") as home:
        yield {"SERVEGATE_DATABASE_URL": f"sqlite:///{home}/servegate.db", "SERVEGATE_SPOOL_DIR": f"{home}/spool",
               "SERVEGATE_ADMIN_KEY": key}, key


# llama-cpp-default keeps the server's default interrupt_requests=True, to show what it does; vllm
# is vLLM's CPU build from its own environment (`python -m backends.peers vllm`).
SYSTEMS = ("builtin", "builtin-bf16", "builtin-fp32", "builtin-int8", "builtin-dequantized", "hf-static", "llama-cpp",
           "llama-cpp-default", "llama-server", "vllm", "vllm-fp32")


def system_of(name: str) -> str:
    """The system a `--compare` entry starts: `builtin@small` is `builtin` under a label of its own,
    so that one system runs twice, each time with its own `--system-args`."""
    return name.partition("@")[0]


def system_flags(spec: str) -> tuple[str, list[str]]:
    """`NAME=FLAGS` (`vllm=--block-size 32`) as (NAME, its extra server flags), shell-split; the
    bench checks that NAME is one of the entries it compares."""
    import shlex

    name, sep, flags = spec.partition("=")
    if not sep:
        raise ValueError(f"{spec!r} is not NAME=FLAGS")
    if system_of(name) == "hf-static":
        raise ValueError("hf-static runs in process: it takes no server flags")
    try:
        return name, shlex.split(flags)
    except ValueError as exc:  # an unclosed quote
        raise ValueError(f"{spec!r}: {exc}") from None


@contextlib.contextmanager
def system_target(name: str, model: str | None = None, flags: Sequence[str] = ()):
    """A started peer, as a bench target, all on the same model file (default: the default GGUF);
    `flags` go on its server's command line, after those set here, so they win (e.g. vLLM's
    `--block-size 32`)."""
    from backends.builtin.worker.loader import default_model_path, gguf_to_hf_dir

    from .targets import BackendTarget, OpenAITarget

    gguf = Path(model) if model else default_model_path()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if name in ("builtin", "builtin-bf16", "builtin-fp32", "builtin-int8", "builtin-dequantized"):
        extra = {"builtin-int8": ["--weight-quant", "int8"], "builtin-bf16": ["--dtype", "bfloat16"],
                 "builtin-fp32": ["--dtype", "float32"],
                 "builtin-dequantized": ["--gguf-weights", "dequantized"]}.get(name, [])
        command = servegate_command(port, model or "") + extra + list(flags)
        with servegate_env() as (env, key), supervised(command, url, "/ready", env, 300) as server:
            yield OpenAITarget(url, api_key=key, server_pid=server.pid)
    elif name in ("llama-cpp", "llama-cpp-default"):
        command = llama_cpp_command(gguf, port, interrupt_requests=name == "llama-cpp-default") + list(flags)
        with supervised(command, url, "/v1/models", None, 300) as server:
            yield OpenAITarget(url, server_pid=server.pid)
    elif name == "llama-server":  # llama.cpp's own server (4 slots, as its -np auto default), built by backends.peers
        from backends import peers

        command = peers.llama_server_command(gguf, port, "default", slots=4) + list(flags)
        with supervised(command, url, "/health", None, 300) as server:
            yield OpenAITarget(url, server_pid=server.pid)
    elif name in ("vllm", "vllm-fp32"):
        from backends import peers

        command = peers.vllm_command(gguf_to_hf_dir(gguf) if gguf.suffix == ".gguf" else gguf, port, "vllm",
                                     extra=flags, dtype="float32" if name == "vllm-fp32" else "bfloat16")
        with supervised(command, url, "/health", peers.vllm_env(), 900) as server:
            yield OpenAITarget(url, server_pid=server.pid)
    elif name == "hf-static":
        yield BackendTarget(HFStaticBackend(gguf_to_hf_dir(gguf) if gguf.suffix == ".gguf" else gguf))
    else:
        raise ValueError(f"unknown system {name!r} (choose from {', '.join(SYSTEMS)})")
