"""Work on untrusted input (a tenant's adapter files) in a child process of its own, under a time
and a memory bound: a crash, a hang or a runaway allocation there ends the child, never the caller,
and comes back as a ValueError naming what happened.

Children are forked from multiprocessing's fork server, which imports `PRELOAD` once, so a call
costs a fork rather than a fresh interpreter importing torch.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import resource
import signal
import threading
from collections.abc import Callable

# What the children's work imports, paid once in the fork server rather than per call.
PRELOAD = ["backends.adapter_files", "backends.builtin.worker.lora"]

# Below serving work: a tenant's file is read with the CPU the engine and the gateway leave.
NICENESS = 10

_context_lock = threading.Lock()
_context = None


class TimedOut(ValueError):
    """The work did not finish in time: it may on a less loaded machine."""


def _fork_server():
    global _context
    with _context_lock:
        if _context is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(PRELOAD)
            _context = context
        return _context


def run(work: Callable, args: tuple, *, what: str, timeout_s: float, memory_bytes: int):
    """`work(*args)` in a child, its result (picklable) or ValueError: its own (a ValueError
    `work` raised, e.g. a format error), or that it took too long, ran out of memory or crashed.
    Blocks: call it off the event loop. `memory_bytes` bounds what the child may allocate beyond
    what it started with."""
    context = _fork_server()
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(sender, work, args, memory_bytes), daemon=True,
                            name="servegate-sandbox")
    child.start()
    sender.close()
    try:
        if not receiver.poll(timeout_s):
            raise TimedOut(f"{what} took longer than {timeout_s:g} s and was stopped")
        try:
            kind, value = pickle.loads(receiver.recv_bytes())
        except EOFError:
            child.join(timeout=5)
            raise ValueError(f"{what} crashed ({_exit(child.exitcode)})") from None
    finally:
        if child.is_alive():
            child.kill()
        child.join(timeout=5)
        receiver.close()
    if kind == "error":
        raise ValueError(value[:2000])  # the message may quote a tenant's file: bounded
    return value


def _exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"


def _child(sender, work: Callable, args: tuple, memory_bytes: int) -> None:
    os.nice(NICENESS)
    limit = _address_space() + memory_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        result = ("ok", work(*args))
    except MemoryError:
        result = ("error", f"reading it needs more than the {memory_bytes >> 20} MiB of memory allowed")
    except ValueError as exc:
        result = ("error", str(exc))
    except Exception as exc:  # a malformed file reaching a parser's corner: named, never raised on
        result = ("error", f"{type(exc).__name__}: {exc}")
    # Plain pickling: multiprocessing's own would hand tensors over as shared memory that this child
    # owns, gone when it exits.
    try:
        message = pickle.dumps(result)
    except Exception as exc:
        message = pickle.dumps(("error", f"its result could not be returned: {exc}"))
    sender.send_bytes(message)
    sender.close()


def _address_space() -> int:
    """This process's virtual size now, in bytes (what RLIMIT_AS counts)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
