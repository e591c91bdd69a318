"""nodes/serve/device.py: one device thread for both roles — a call, a stream with its result
and its error, back-pressure, and a cancel that stops the thread at its next item."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
from tandem.nodes.serve.device import DeviceThread


@pytest.fixture
def device() -> Iterator[DeviceThread]:
    d = DeviceThread("test-device")
    yield d
    d.close()


async def test_a_call_runs_on_the_thread_and_returns(device: DeviceThread) -> None:
    name = await device.call(lambda: threading.current_thread().name)
    assert name.startswith("test-device") and name != threading.current_thread().name
    with pytest.raises(ZeroDivisionError):
        await device.call(lambda: 1 / 0)


async def test_a_stream_gives_its_items_then_its_return_value(device: DeviceThread) -> None:
    def counting(n: int) -> Iterator[int]:
        yield from range(n)
        return n * 10

    async with device.stream(counting, 4) as items:
        got = [i async for i in items]
    assert got == [0, 1, 2, 3] and items.result == 40


async def test_a_streams_error_comes_out_of_the_loop(device: DeviceThread) -> None:
    def failing() -> Iterator[int]:
        yield 1
        raise ValueError("bad layer")

    got = []
    with pytest.raises(ValueError, match="bad layer"):
        async with device.stream(failing) as items:
            async for i in items:
                got.append(i)
    assert got == [1]


async def test_a_bounded_stream_waits_for_its_reader(device: DeviceThread) -> None:
    made: list[int] = []

    def eager() -> Iterator[int]:
        for i in range(10):
            made.append(i)
            yield i

    async with device.stream(eager, buffer=2) as items:
        first = await items.__anext__()
        await asyncio.sleep(0.2)  # the thread could run ahead: it must not
        assert first == 0 and len(made) <= 4
        rest = [i async for i in items]
    assert rest == list(range(1, 10))


async def test_leaving_early_stops_the_thread_at_its_next_item(device: DeviceThread) -> None:
    made: list[int] = []
    closed = threading.Event()

    def endless() -> Iterator[int]:
        try:
            i = 0
            while True:
                made.append(i)
                yield i
                i += 1
        finally:
            closed.set()

    async with device.stream(endless, buffer=1) as items:
        async for i in items:
            if i == 3:
                break
    assert closed.is_set()  # the exit waited for the thread to let go
    count = len(made)
    await device.call(lambda: None)
    assert len(made) == count <= 6


async def test_the_work_sees_the_cancel_event(device: DeviceThread) -> None:
    cancel = threading.Event()
    started = threading.Event()

    def slow_item() -> Iterator[int]:
        started.set()
        cancel.wait()  # a long item that checks the event itself
        yield 1

    stream = device.stream(slow_item, cancel=cancel)
    async with stream:
        await asyncio.to_thread(started.wait)
    assert cancel.is_set() and stream.cancel is cancel
