"""The engine core in a process of its own, as vLLM v1 runs its `EngineCore`: the API process
does HTTP, chat templates and tokenization; the core process only schedules, runs the model,
samples and detokenizes, so a step's Python never waits for the HTTP process's GIL.

Commands (`add`, `abort`, `stop`) and the core's messages (`ready`, `outputs`, `failed`, `refused`) are
pickled tuples over one pipe; outputs carry the engine's figures of that step boundary.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from dataclasses import dataclass

from ..base import InvalidRequest, UpstreamError
from .config import EngineConfig
from .engine import EngineFront, LLMEngine, arrival_deadline, arrival_wait, run_command, step_or_fail


@dataclass(frozen=True)
class CoreInfo:
    """What the API process needs to know of the engine it cannot see."""
    max_model_len: int
    num_blocks: int
    block_size: int
    dtype: str
    dtype_reason: str
    vocab_size: int

    @classmethod
    def of(cls, engine: LLMEngine) -> CoreInfo:
        return cls(engine.max_model_len, engine.kv.num_blocks, engine.kv.block_size,
                   str(engine.runner.dtype).removeprefix("torch."), engine.runner.dtype_reason,
                   engine.loaded.config.vocab_size)


def run(config: EngineConfig, conn) -> None:
    """The core process: load the model, say so, then step while there is work."""
    logging.basicConfig(level=logging.WARNING)
    try:
        engine = LLMEngine(config)
    except BaseException as exc:
        conn.send(("failed_to_load", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", CoreInfo.of(engine), engine.stats()))
    while True:
        if not engine.has_work:
            conn.poll(None)
        added, deadline = False, arrival_deadline()
        while conn.poll(arrival_wait(added, deadline)):
            command = conn.recv()
            if command[0] == "stop":
                return
            added |= command[0] == "add"
            if refused := run_command(engine, command):
                conn.send(("refused", *refused))
        if engine.has_work:
            outputs, failed, why = step_or_fail(engine)
            conn.send(("failed", failed, why, engine.stats()) if failed else ("outputs", outputs, engine.stats()))
        else:  # idle after an abort: the front's figures must say so too
            conn.send(("outputs", [], engine.stats()))


class EngineProcess(EngineFront):
    """The API process's side: starts the core (blocking until the model is loaded: call it off
    the event loop), sends commands, and delivers what the core sends on a reader thread."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        context = multiprocessing.get_context("spawn")  # never fork a process holding torch's threads
        self._conn, child = context.Pipe()
        self._process = context.Process(target=run, args=(config, child), name="servegate-engine-core",
                                        daemon=True)
        self._process.start()
        child.close()
        try:
            message = self._conn.recv()
        except EOFError:
            message = ("failed_to_load", f"the engine process exited with code {self._process.exitcode}")
        if message[0] != "ready":
            self._process.join(timeout=10)
            raise RuntimeError(message[1])
        _, self.info, self.stats = message
        self._lock = threading.Lock()  # commands come from the event loop and from shutdown
        self._reader = threading.Thread(target=self._read, name="servegate-engine-reader", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self._process.is_alive() and self._reader.is_alive()

    def _send(self, command: tuple) -> None:
        with self._lock:
            try:
                self._conn.send(command)
            except (BrokenPipeError, OSError):  # the core is gone; the reader fails the streams
                pass

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "outputs":
                _, outputs, self.stats = message
                for out in outputs:
                    self._deliver(out.request_id, out)
            elif message[0] == "refused":
                _, request_id, why = message
                self._deliver(request_id, InvalidRequest(why))
            else:  # failed
                _, failed, why, self.stats = message
                for request_id in failed:
                    self._deliver(request_id, UpstreamError(why))
        for request_id in list(self._streams):
            self._deliver(request_id, UpstreamError(f"the engine process exited (code {self._process.exitcode})"))

    def shutdown(self) -> None:
        self._send(("stop",))
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(timeout=5)
        self._conn.close()
