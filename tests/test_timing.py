"""StreamTimer: one timer per stream bounds each wait, never the consumer's own work."""

from __future__ import annotations

import asyncio

import pytest

from backends.timing import StreamTimer


async def ticks(gap: float, count: int = 5):
    for i in range(count):
        await asyncio.sleep(gap)
        yield i


async def drain(timer: StreamTimer, items, work: float = 0.0) -> list[int]:
    got = []
    try:
        while True:
            got.append(await timer.next(items))
            await asyncio.sleep(work)  # the consumer's own work between items is never cut
    except StopAsyncIteration:
        return got
    finally:
        timer.cancel()


async def test_a_silent_stream_times_out_and_a_slow_consumer_does_not():
    with pytest.raises(TimeoutError):
        await drain(StreamTimer(0.05), ticks(0.2))
    assert await drain(StreamTimer(0.05), ticks(0.01), work=0.12) == [0, 1, 2, 3, 4]


async def test_the_deadline_bounds_the_whole_stream():
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeoutError):
        await drain(StreamTimer(1.0, deadline=started + 0.15), ticks(0.04, count=100))
    assert loop.time() - started < 0.5


async def test_other_cancellations_pass_through():
    timer = StreamTimer(5.0)
    task = asyncio.ensure_future(drain(timer, ticks(1.0)))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
