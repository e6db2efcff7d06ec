"""The engine core's command loop (`serve`), the one both modes run: in a process of its own, as
vLLM v1 runs its `EngineCore` (`run`, the default), or on a thread of the API process (the thread
mode, `front.EngineThread`). The API process does HTTP, chat templates and tokenization; the
core process only schedules, runs the model, samples and detokenizes, so a step's Python never
waits for the HTTP process's GIL.

Commands take effect at a step boundary; after each step, or on falling idle, the core sends its
outputs with the engine's figures of that boundary.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from backends.builtin.config import EngineConfig
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
    Stop,
    UnloadAdapter,
    decode_command,
    encode,
)

log = logging.getLogger("servegate.engine")

# A burst's requests reach the engine over a few milliseconds (each is templated and tokenized
# first). Stepping at the first of them would run it alone and keep the rest a whole step behind
# it, a prefill step where the first is a cold prompt; so after a request arrives the loop keeps
# taking arrivals until none has come for ARRIVAL_GAP_S, for at most ARRIVAL_WAIT_S.
ARRIVAL_GAP_S = 0.003
ARRIVAL_WAIT_S = 0.02


def arrival_deadline() -> float:
    return time.monotonic() + ARRIVAL_WAIT_S


def arrival_wait(added: bool, deadline: float) -> float:
    """Seconds the loop waits for another command: none before a request has arrived, then the
    gap, up to the deadline."""
    return max(0.0, min(ARRIVAL_GAP_S, deadline - time.monotonic())) if added else 0.0


class Channel(Protocol):
    """The core's side of its link to the API process."""

    def receive(self, timeout: float | None) -> Command | None:
        """The next command, waiting up to `timeout` seconds for it (None: until one comes)."""

    def send(self, message: CoreMessage) -> None: ...


def serve(engine: LLMEngine, channel: Channel) -> None:
    """Take the commands that came (waiting for one while idle, and for the rest of a burst after
    a request), then step; until `Stop`."""
    while True:
        command = channel.receive(0.0 if engine.has_work else None)
        added, deadline = False, arrival_deadline()
        while command is not None:
            match command:
                case Stop():
                    return
                case AddRequest():
                    added = True
                    try:
                        engine.add_request(command.request_id, command.prompt_ids, command.params, command.stop,
                                           command.cache_salt, command.adapter, command.embed, command.tenant)
                    except ValueError as exc:
                        channel.send(Refused(command.request_id, str(exc)))
                    except Exception as exc:  # one request's fault, never the loop's end
                        log.exception("request %s refused", command.request_id)
                        channel.send(Refused(command.request_id, f"{type(exc).__name__}: {exc}"))
                case LoadAdapter() | UnloadAdapter():
                    channel.send(adapter_command(engine, command))
                case Abort():
                    engine.abort(command.request_id)
            command = channel.receive(arrival_wait(added, deadline))
        if engine.has_work:
            channel.send(step_or_fail(engine))
        else:  # idle after an abort: the front's figures must say so too
            channel.send(Outputs([], engine.stats(), engine.resident_adapters()))


def adapter_command(engine: LLMEngine, command: LoadAdapter | UnloadAdapter) -> Done:
    """An adapter loaded or unloaded at a step boundary, or why not. What it loads is a factors
    file the API process wrote after reading the adapter in a sandbox; whatever still fails here
    fails the command, never the loop."""
    try:
        if isinstance(command, LoadAdapter):
            engine.add_adapter(command.name, command.path)
        else:
            engine.remove_adapter(command.name)
    except Exception as exc:
        return Done(command.command_id, str(exc) if isinstance(exc, (OSError, ValueError)) else
                    f"{type(exc).__name__}: {exc}")
    return Done(command.command_id)


def step_or_fail(engine: LLMEngine) -> Outputs | Failed:
    """One step's outputs, or, when it raises, the requests it failed (aborted) and why."""
    try:
        outputs = engine.step()
    except Exception as exc:  # a broken step fails the requests in it, not the engine
        log.exception("engine step failed")
        failed = engine.request_ids
        for request_id in failed:
            engine.abort(request_id)
        return Failed(failed, f"the engine step failed: {exc}", engine.stats())
    return Outputs(outputs, engine.stats(), engine.resident_adapters())


class Pipe:
    """The core process's end of its pipe: each command and message one MessagePack frame."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def receive(self, timeout: float | None) -> Command | None:
        return decode_command(self.conn.recv_bytes()) if self.conn.poll(timeout) else None

    def send(self, message: CoreMessage) -> None:
        self.conn.send_bytes(encode(message))


def run(config: EngineConfig, conn) -> None:
    """The core process: load the model, say so, then serve."""
    logging.basicConfig(level=logging.WARNING)
    pipe = Pipe(conn)
    try:
        engine = LLMEngine(config)
    except BaseException as exc:
        pipe.send(LoadFailed(f"{type(exc).__name__}: {exc}"))
        return
    pipe.send(Ready(engine.core_info(), engine.stats()))
    serve(engine, pipe)
