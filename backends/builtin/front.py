"""The API process's side of the engine: each request's asyncio stream over an engine core that
steps elsewhere, in a process of its own (`EngineProcess`, the default) or on a thread of this
process (`EngineThread`). Both run the core's one loop (`loop.serve`). Requests and aborts go to
it as commands, taking effect at its next step boundary; its messages come back on a thread
other than the event loop's and are handed to the streams' loops.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import signal
import threading
from collections.abc import AsyncIterator, Callable, Iterable

from backends.base import InvalidRequest, UpstreamError
from backends.builtin.config import EngineConfig
from backends.builtin.core import loop
from backends.builtin.core.engine import LLMEngine
from backends.builtin.protocol import (
    Abort,
    AddRequest,
    Command,
    CoreMessage,
    Done,
    Failed,
    LoadAdapter,
    LoadFailed,
    Outputs,
    Ready,
    Refused,
    SamplingParams,
    Stats,
    StepOutput,
    Stop,
    UnloadAdapter,
    decode_message,
    encode,
)


class EngineFront:
    """Each request's asyncio queue, fed by the core's messages."""

    def __init__(self) -> None:
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.stats: Stats = {}  # the engine's figures, refreshed at every step boundary
        self.resident_adapters: tuple[str, ...] = ()  # likewise the LoRA adapters in compute slots
        self.gone: str | None = None  # why the core is gone, set before its streams are failed

    async def stream(self, request_id: str, prompt_ids: list[int], params: SamplingParams, stop: Iterable[str] = (),
                     cache_salt: str | None = None, adapter: str | None = None, embed: bool = False,
                     tenant: str | None = None) -> AsyncIterator[StepOutput | BaseException]:
        """Outputs of one request until every choice finished. Leaving early aborts it."""
        out: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), out)
        self._send(AddRequest(request_id, prompt_ids, params, tuple(stop), cache_salt, adapter, embed, tenant))
        remaining = params.n
        try:
            if self.gone is not None:  # registered after the core's streams were failed: none will come
                raise UpstreamError(self.gone)
            while remaining:
                item = await out.get()
                if isinstance(item, BaseException):
                    raise item
                remaining -= item.finish_reason is not None
                yield item
        finally:
            self._streams.pop(request_id, None)
            if remaining:
                self._send(Abort(request_id))

    async def embed(self, request_id: str, prompt_ids: list[int], cache_salt: str | None = None,
                    tenant: str | None = None) -> list[float]:
        """One prompt's embedding, the one output of an embedding request. Cancelled, it aborts."""
        async for out in self.stream(request_id, prompt_ids, SamplingParams(), cache_salt=cache_salt, embed=True,
                                     tenant=tenant):
            vector = out.embedding
        return vector

    async def command(self, command: LoadAdapter | UnloadAdapter) -> None:
        """Carry out a command at the core's next step boundary; InvalidRequest with its reason
        where the core could not."""
        out: asyncio.Queue = asyncio.Queue()
        self._streams[command.command_id] = (asyncio.get_running_loop(), out)
        self._send(command)
        try:
            if self.gone is not None:
                raise UpstreamError(self.gone)
            done = await out.get()
        finally:
            self._streams.pop(command.command_id, None)
        if isinstance(done, BaseException):
            raise done
        if done.why is not None:
            raise InvalidRequest(done.why, param="model")

    def _on_message(self, message: CoreMessage) -> None:
        match message:
            case Outputs():
                self.stats, self.resident_adapters = message.stats, message.resident_adapters
                for out in message.outputs:
                    self._deliver(out.request_id, out)
            case Refused():
                self._deliver(message.request_id, InvalidRequest(message.why))
            case Done():
                self._deliver(message.command_id, message)
            case Failed():
                self.stats = message.stats
                for request_id in message.request_ids:
                    self._deliver(request_id, UpstreamError(message.why))

    def _deliver(self, request_id: str, item: StepOutput | Done | BaseException) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, out = target
            loop.call_soon_threadsafe(out.put_nowait, item)

    def _send(self, command: Command) -> None:
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    @property
    def exit_reason(self) -> str:
        """Why the core is not alive."""
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError


class _ThreadChannel:
    """The core loop's link in the thread mode: commands through a queue, messages handed to the
    front on the loop's thread, as the process's reader thread hands them."""

    def __init__(self, on_message: Callable[[CoreMessage], None]) -> None:
        self.commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.send = on_message

    def receive(self, timeout: float | None) -> Command | None:
        try:
            return self.commands.get(timeout=timeout)
        except queue.Empty:
            return None


class EngineThread(EngineFront):
    """The core's loop on a thread of this process (`EngineConfig.engine_process` off)."""

    def __init__(self, engine: LLMEngine) -> None:
        super().__init__()
        self.stats = engine.stats()
        self._channel = _ThreadChannel(self._on_message)
        self._thread = threading.Thread(target=loop.serve, args=(engine, self._channel), name="servegate-engine",
                                        daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def exit_reason(self) -> str:
        return "its thread ended"

    def _send(self, command: Command) -> None:
        self._channel.commands.put(command)

    def shutdown(self) -> None:
        self._send(Stop())
        self._thread.join(timeout=10)


class EngineProcess(EngineFront):
    """Starts the core process (blocking until the model is loaded: call it off the event loop),
    sends it commands, and hands what it sends to the streams from a reader thread."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        context = multiprocessing.get_context("spawn")  # never fork a process holding torch's threads
        self._conn, child = context.Pipe()
        self._process = context.Process(target=loop.run, args=(config, child), name="servegate-engine-core",
                                        daemon=True)
        self._process.start()
        child.close()
        try:
            message = decode_message(self._conn.recv_bytes())
        except EOFError:
            message = LoadFailed(f"the engine process exited with code {self._process.exitcode}")
        match message:
            case Ready():
                self.info, self.stats = message.info, message.stats
            case LoadFailed():
                self._process.join(timeout=10)
                raise RuntimeError(message.why)
        self._lock = threading.Lock()  # commands come from the event loop and from shutdown
        self._reader = threading.Thread(target=self._read, name="servegate-engine-reader", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self._process.is_alive() and self._reader.is_alive()

    @property
    def exit_reason(self) -> str:
        code = self._process.exitcode
        return f"killed by signal {signal.Signals(-code).name}" if code is not None and code < 0 else \
            f"exit code {code}"

    def _send(self, command: Command) -> None:
        with self._lock:
            try:
                self._conn.send_bytes(encode(command))
            except (BrokenPipeError, OSError):  # the core is gone; the reader fails the streams
                pass

    def _read(self) -> None:
        while True:
            try:
                message = decode_message(self._conn.recv_bytes())
            except (EOFError, OSError):
                break
            self._on_message(message)
        self._process.join(timeout=5)
        self.gone = f"the engine process exited ({self.exit_reason}); try again"
        for request_id in list(self._streams):
            self._deliver(request_id, UpstreamError(self.gone))

    def shutdown(self) -> None:
        self._send(Stop())
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(timeout=5)
        self._conn.close()
