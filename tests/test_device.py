"""nodes/serve/device.py: one device thread for both roles — a call, a stream with its result
and its error, back-pressure, a cancel that stops the thread at its next item, and a close
that waits for the thread's native exit."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
from tandem.nodes.serve.device import DeviceThread

from tests.conftest import MakeTiny


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


_GENERATE_THEN_EXIT = """
import sys
from mlx_lm.generate import stream_generate
from tandem.nodes.decode import lm
from tandem.nodes.serve.device import DeviceThread

def work():
    model, tokenizer = lm.load(sys.argv[1])
    for _ in stream_generate(model, tokenizer, [1, 2, 3], max_tokens=2):
        pass

thread = DeviceThread("tandem-mlx")
thread.submit(work).result()
thread.close()
"""


def test_a_process_that_closes_its_mlx_thread_then_exits_does_not_abort(
    tiny_model: MakeTiny,
) -> None:
    """Issue 47 item 8: a decode node stopped just after it started aborted ("terminate called
    without an active exception"): its mlx thread's thread-local destructors, which take the
    GIL, ran after `close` returned, and the interpreter was finalizing by then. Every run of
    this aborted before `close` waited for the thread's native exit."""
    model = tiny_model(arch="llama", layers=2)
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", _GENERATE_THEN_EXIT, str(model)],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        assert out.returncode == 0 and "terminate called" not in out.stderr, out.stderr[-2000:]
