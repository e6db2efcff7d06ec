"""Drives a workload against a target: open-loop arrivals or fixed concurrency, timing every piece."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from .datasets import Conversation
from .metrics import RequestResult
from .targets import Counts, TargetError


async def measure(target, prompt: str, max_tokens: int, run_start: float,
                  model: str | None = None) -> tuple[RequestResult, str]:
    """One request (to `model`, else the target's): time to first text, gaps between later texts,
    end to end; never raises."""
    sent = time.perf_counter()
    result = RequestResult(prompt_tokens=0, start=sent - run_start)
    pieces: list[str] = []
    counts = Counts()
    last = sent
    try:
        async for piece in target.generate(prompt, max_tokens, model):
            if isinstance(piece, Counts):
                counts = piece
                continue
            if not piece:
                continue
            now = time.perf_counter()
            if result.ttft is None:
                result.ttft = now - sent
            else:
                result.itl.append(now - last)
            last = now
            pieces.append(piece)
        result.e2el = time.perf_counter() - sent
        if not pieces:
            raise TargetError("the response had no output text")
    except (TargetError, OSError, ValueError) as exc:
        result.error = str(exc) or type(exc).__name__
    except Exception as exc:  # httpx transport errors and anything else a target raises
        result.error = f"{type(exc).__name__}: {exc}"
    result.prompt_tokens = counts.prompt_tokens or 0
    result.output_tokens = counts.output_tokens if counts.output_tokens is not None else len(pieces)
    result.cached_tokens = counts.cached_tokens
    return result, "".join(pieces)


SAMPLE_INTERVAL = 0.25  # seconds between samples of the target's engine figures


@contextlib.asynccontextmanager
async def polled(sample: Callable[[], Awaitable[bool]], interval: float):
    """Awaits `sample()` every `interval` seconds while the block runs, until it returns False
    (nothing to sample), and once more at the end where it ever returned True."""
    sampled = False

    async def poll() -> None:
        nonlocal sampled
        while await sample():
            sampled = True
            await asyncio.sleep(interval)

    task = asyncio.create_task(poll())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if sampled:
            await sample()


@contextlib.asynccontextmanager
async def sample_engine(target):
    """Collects the target's engine figures (KV blocks, preemptions...) while the block runs,
    if it reports them; one last sample is taken at the end."""
    samples: list[dict[str, float]] = []

    async def sample() -> bool:
        try:
            figures = await target.engine_figures()
        except Exception:  # figures are a bonus: a target without them is still measured
            return False
        if figures:
            samples.append(figures)
        return bool(figures)

    async with polled(sample, SAMPLE_INTERVAL):
        yield samples


def process_tree(pid: int) -> list:
    """The process and every descendant (vLLM's engine core, servegate's engine process); empty
    once it is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def reset_peaks(processes: list) -> bool:
    """Starts each process's peak resident set (the kernel's VmHWM) afresh from what it holds now
    (Linux's `clear_refs` 5: a counter reset, no walk over the process's memory). False where the
    system refuses it (no `/proc` outside Linux, another user's process): a peak would then run
    from the process's start, its model loading included."""
    for process in processes:
        try:
            with open(f"/proc/{process.pid}/clear_refs", "w") as clear:
                clear.write("5")
        except OSError:
            if process.is_running():
                return False
    return True


def tree_peak_mib(processes: list) -> float | None:
    """What a server held at most since `reset_peaks`, in MiB: the peak resident sets (VmHWM) of
    its processes summed (each its own peak: a bound where they peak at different moments), less
    the pages they share with one another or with other processes, as their proportional set size
    (PSS) counts them, from the gap between resident and proportional size now. So a page the
    processes share, such as torch's libraries, counts once in all. None where no process is left
    to read."""
    import psutil

    total, read = 0.0, False
    for process in processes:
        with contextlib.suppress(psutil.Error, OSError):  # a process that ended meanwhile
            with open(f"/proc/{process.pid}/status") as status:
                peak = next((int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:")), None)
            if peak is None:  # a zombie holds no memory
                continue
            info = process.memory_full_info()
            total += peak - (info.rss - getattr(info, "pss", info.rss))
            read = True
    return total / 2**20 if read else None


@contextlib.asynccontextmanager
async def peak_memory(pid: int | None):
    """The peak of a server's memory (`tree_peak_mib`) while the block runs, as
    {"peak_memory_mib": value} once it ends; empty where the bench did not start the server (pid
    None) or its peaks could not be reset. Nothing is read while the block runs: a PSS sample walks
    the server's page tables under its memory-map lock, which stalls the server's own allocations
    for tens of milliseconds, a first token's worth; the kernel keeps the peaks itself."""
    peak: dict[str, float] = {}
    if pid is None:
        yield peak
        return
    processes = process_tree(pid)
    reset = reset_peaks(processes)
    yield peak
    if reset:  # children started during the block count too: their own peak runs from their start
        tree = {p.pid: p for p in [*processes, *process_tree(pid)]}
        if (value := await asyncio.to_thread(tree_peak_mib, list(tree.values()))) is not None:
            peak["peak_memory_mib"] = value


async def run_workload(target, conversations: list[Conversation], arrivals: list[float] | None = None,
                       max_concurrency: int | None = None,
                       on_result: Callable[[RequestResult], None] | None = None) -> tuple[list[RequestResult], float]:
    """Send every turn of every conversation; a conversation starts at its arrival offset and its
    turns follow one another. Returns the results and the run's duration in seconds."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results: list[RequestResult] = []
    start = time.perf_counter()

    async def converse(conversation: Conversation, offset: float) -> None:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        conversation.replies = []
        for index, turn in enumerate(conversation.turns):
            async with limit or contextlib.nullcontext():
                result, reply = await measure(target, conversation.prompt(index), turn.max_tokens, start,
                                              conversation.model)
            conversation.replies.append(reply)
            results.append(result)
            if on_result:
                on_result(result)
            if not result.ok:
                return  # later turns would build on a missing reply

    offsets = arrivals or [c.arrival or 0.0 for c in conversations]
    await asyncio.gather(*(converse(c, t) for c, t in zip(conversations, offsets)))
    return results, time.perf_counter() - start
