"""The HTTP edge in process (issues 32 and 33): one error type and middleware, the body
reader, the connection limits of `EdgeRunner`, exact Bearer parsing. A tiny app on loopback
and raw sockets; the real nodes' side is in test_bad_input.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import socket
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from tandem.nodes.contract.http import ApiError
from tandem.nodes.serve.connections import EdgeLimits, EdgeRunner
from tandem.nodes.serve.errors import node_middleware, read_json_body
from tandem.nodes.trust.auth import bearer_ok

from tests.nodeproc import NodeProc, remote_pair

SECRET = "edge-secret-token-0123456789"
LIMITS = EdgeLimits(
    head_timeout_s=0.5, body_timeout_s=1.0, idle_timeout_s=0.8, connections_per_address=3
)
NodePair = tuple[NodeProc, NodeProc]  # prefill, decode


async def _ok(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def _refused(request: web.Request) -> web.Response:
    raise ApiError(503, "busy now", "busy", {"Retry-After": "2"})


async def _echo(request: web.Request) -> web.Response:
    return web.json_response(await read_json_body(request))


async def _capped(request: web.Request) -> web.Response:
    return web.json_response(await read_json_body(request, max_bytes=100))


@asynccontextmanager
async def serving(limits: EdgeLimits = LIMITS) -> AsyncIterator[int]:
    """A tiny app behind the node's middleware and runner; its port."""
    app = web.Application(middlewares=[node_middleware()], client_max_size=1000)
    app.router.add_get("/ok", _ok)
    app.router.add_get("/refused", _refused)
    app.router.add_post("/echo", _echo)
    app.router.add_post("/capped", _capped)
    runner = EdgeRunner(app, limits, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield site.port
    finally:
        await runner.cleanup()


async def exchange(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """Send `data` on a new connection and read until the node closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


def split(reply: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def error_of(reply: bytes, status: int) -> dict[str, object]:
    got, headers, body = split(reply)
    assert got == status, reply[:300]
    assert headers["content-type"].startswith("application/json"), headers
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] is None
    return error


def get(path: str, *headers: str) -> bytes:
    lines = [f"GET {path} HTTP/1.1", "Host: x", "Connection: close", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def test_every_refusal_is_the_one_error_body() -> None:
    async with serving() as port:
        error = error_of(await exchange(port, get("/refused")), 503)
        assert error == {"message": "busy now", "type": "busy", "param": None, "code": "busy"}
        _, headers, _ = split(await exchange(port, get("/refused")))
        assert headers["retry-after"] == "2"
        assert error_of(await exchange(port, get("/nowhere")), 404)["code"] == "not_found"
        post = b"POST /ok HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
        reply = await exchange(port, post)
        assert error_of(reply, 405)["code"] == "method_not_allowed"
        assert split(reply)[1]["allow"] == "GET,HEAD"


async def test_the_body_reader_enforces_the_size_limit_and_reads_json() -> None:
    def post(body: bytes) -> bytes:
        head = f"POST /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {len(body)}"
        return head.encode() + b"\r\n\r\n" + body

    async with serving() as port:
        error = error_of(await exchange(port, post(b"[" * 1001)), 413)
        assert error["code"] == "request_too_large" and "1000 bytes" in str(error["message"])
        assert error_of(await exchange(port, post(b"[1")), 400)["code"] == "bad_json"
        assert split(await exchange(port, post(b'{"a": [1]}')))[2] == b'{"a": [1]}'


OVERSIZED = {
    "request line": get(f"/ok?{SECRET}{'a' * 9000}"),
    "header name": get("/ok", f"{SECRET}{'a' * 9000}: x"),
    "header value": get("/ok", f"Authorization: Bearer {SECRET}{' ' * 9000}x"),
    "many headers": get("/ok", *(f"X-{i}: Bearer {SECRET}" for i in range(200))),
}


@pytest.mark.parametrize("case", list(OVERSIZED))
async def test_an_oversized_head_is_a_json_431_that_echoes_nothing(
    case: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG")
    async with serving() as port:
        reply = await exchange(port, OVERSIZED[case])
    error = error_of(reply, 431)
    assert error["code"] == "header_too_large"
    limit = "128 header fields" if case == "many headers" else "8190 bytes"
    assert limit in str(error["message"]), error
    assert SECRET not in reply.decode("latin-1")
    assert caplog.records and SECRET not in caplog.text  # logged, by its limit only


async def test_a_malformed_head_is_a_json_400_that_echoes_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("DEBUG")
    async with serving() as port:
        reply = await exchange(port, f"G\0T /ok HTTP/1.1\r\nX: {SECRET}\r\n\r\n".encode())
    assert error_of(reply, 400)["code"] == "bad_request"
    assert SECRET not in reply.decode("latin-1") and SECRET not in caplog.text


async def _closed_after(port: int, first: bytes, drip: bytes = b"", every_s: float = 0.1) -> float:
    """Seconds until the node closes a connection that sent `first`, then `drip` every
    `every_s` (a slowloris)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start = time.monotonic()
    try:
        writer.write(first)
        while True:
            try:
                if await asyncio.wait_for(reader.read(65536), every_s) == b"":
                    return time.monotonic() - start
            except TimeoutError:
                if drip:
                    writer.write(drip)
            if time.monotonic() - start > 10:
                raise AssertionError("the node kept the connection open")
    except ConnectionError:
        return time.monotonic() - start
    finally:
        writer.close()


async def test_a_slow_head_and_an_idle_connection_are_closed() -> None:
    async with serving() as port:
        silent = await _closed_after(port, b"")
        slow = await _closed_after(port, b"GET /ok HTTP/1.1\r\nX-a: ", b"a")
        kept_alive = await _closed_after(port, b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
    head, idle = LIMITS.head_timeout_s, LIMITS.idle_timeout_s
    assert head - 0.05 <= silent < head + 0.5 and head - 0.05 <= slow < head + 0.5
    assert idle - 0.05 <= kept_alive < idle + 0.5  # the head timer stopped with its request


async def test_past_the_per_address_cap_a_request_is_503() -> None:
    async with serving(EdgeLimits(connections_per_address=2)) as port:
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        try:
            error = error_of(await exchange(port, get("/ok")), 503)
            assert error["code"] == "too_many_connections" and "2 connections" in error["message"]
            held[0][1].close()
            await held[0][1].wait_closed()
            await asyncio.sleep(0.1)  # the node sees it go
            assert split(await exchange(port, get("/ok")))[0] == 200
        finally:
            for _, writer in held:
                writer.close()


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        (f"Bearer {SECRET}", True),
        (f"Bearer  {SECRET}", False),  # two spaces
        (f"Bearer {SECRET} ", False),  # trailing whitespace
        (f"Bearer {SECRET}\t", False),
        (f"Bearer {SECRET}\xa0", False),
        (f" Bearer {SECRET}", False),
        (f"Bearer\t{SECRET}", False),
        (f"bearer {SECRET}", False),
        (f"Bearer {SECRET}x", False),
        (f"Bearer {SECRET[:-1]}", False),
        (f"Basic {SECRET}", False),
        ("Bearer ", False),
        ("", False),
        (None, False),
        (f"Bearer {SECRET}\udcff", False),  # aiohttp's surrogate escape of a non-UTF-8 byte
    ],
)
def test_bearer_is_exact(header: str | None, ok: bool) -> None:
    assert bearer_ok(header, SECRET) is ok


# --- the same through real nodes: a prefill node and a decode node that trusts it ----------


@pytest.fixture(scope="module")
def pair(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodePair]:
    _raise_open_files(2 * FLOOD + 256)  # before the nodes start: they inherit it
    tmp = tmp_path_factory.mktemp("edge")
    with remote_pair(tmp, tiny_model(), "64MiB", SECRET) as nodes:
        yield nodes


def _raise_open_files(want: int) -> None:
    """Raise this process's soft limit on open files to `want` (or the hard limit): a Mac's
    default soft limit is 256."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < top:
        resource.setrlimit(resource.RLIMIT_NOFILE, (top, hard))


def test_nodes_answer_oversized_heads_431_and_log_no_header_value(pair: NodePair) -> None:
    """Issue 33, 1: every kind of oversized head, the token inside, to both nodes."""
    for node in pair:
        for case, data in OVERSIZED.items():
            reply = asyncio.run(exchange(node.port, data.replace(b"/ok", b"/v1/cluster")))
            assert error_of(reply, 431)["code"] == "header_too_large", (case, reply)
            assert SECRET not in reply.decode("latin-1"), (case, reply)
        malformed = f"GET /v1/cluster HTTP/1.1\r\nX: \0{SECRET}\r\n\r\n".encode()
        reply = asyncio.run(exchange(node.port, malformed))
        assert error_of(reply, 400)["code"] == "bad_request" and SECRET.encode() not in reply
    time.sleep(0.2)  # a log line written after the reply
    for node in pair:
        log = node.output()
        assert "refused a request from" in log and SECRET not in log, log[-3000:]


def test_a_node_takes_the_bearer_token_exactly(pair: NodePair) -> None:
    _, decode = pair
    for header, status in [(f"Bearer {SECRET}", 200), (f"Bearer  {SECRET}", 401),
                           (f"Bearer {SECRET}\xa0", 401), (f"bearer {SECRET}", 401)]:  # fmt: skip
        data = get("/v1/models", f"Authorization: {header}")
        reply = asyncio.run(exchange(decode.port, data))  # a non-ASCII value goes as UTF-8
        assert split(reply)[0] == status, (repr(header), reply[:200])


FLOOD = 2000  # slowloris sockets
SLACK_S = 3.0  # the node's accept and loop delays under 2,000 connections, on a busy CPU


async def _slowloris(port: int, opened: list[float], closed: list[float]) -> None:
    """One socket that sends a request head a byte a second and never ends it."""
    start = time.monotonic()  # before the connect: the node's clock starts no earlier
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    opened.append(time.monotonic())
    try:
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        while True:
            try:
                if await asyncio.wait_for(reader.read(1024), 1.0) == b"":
                    break
            except TimeoutError:
                writer.write(b"a")
    except ConnectionError:
        pass
    finally:
        closed.append(time.monotonic() - start)
        writer.close()


async def _timed_get(session: aiohttp.ClientSession, url: str) -> tuple[int, float]:
    start = time.monotonic()
    async with session.get(url, headers={"Authorization": f"Bearer {SECRET}"}) as r:
        await r.read()
        return r.status, time.monotonic() - start


def _other_loopback() -> str | None:
    """A second loopback address to connect from (Linux has all of 127/8; a Mac only
    127.0.0.1 unless aliased)."""
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.2", 0))
        return "127.0.0.2"
    except OSError:
        return None


async def test_2000_slowloris_sockets_are_closed_while_requests_are_answered(
    pair: NodePair,
) -> None:
    """Issue 33, 2: a head that never ends is cut at the head timeout; past the per-address
    cap a request is 503; a client on a connection already open, or from another address,
    is answered at once all along."""
    _raise_open_files(2 * FLOOD + 256)
    _, decode = pair
    url = decode.url + "/v1/models"
    limits = EdgeLimits()
    opened: list[float] = []
    closed: list[float] = []
    async with (
        asyncio.timeout(limits.head_timeout_s + 60),
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as kept,
    ):
        assert (await _timed_get(kept, url))[0] == 200  # its connection is open before the flood
        flood = [asyncio.create_task(_slowloris(decode.port, opened, closed)) for _ in range(FLOOD)]
        try:
            while len(opened) < FLOOD and not any(t.done() for t in flood):
                await asyncio.sleep(0.05)
            assert len(opened) == FLOOD, f"{len(opened)} connected"
            status, seconds = await _timed_get(kept, url)
            assert status == 200 and seconds < 1.0, (status, seconds)
            over = error_of(await exchange(decode.port, get("/v1/models")), 503)
            assert over["code"] == "too_many_connections"
            if (other := _other_loopback()) is not None:
                connector = aiohttp.TCPConnector(local_addr=(other, 0))
                async with aiohttp.ClientSession(connector=connector) as fresh:
                    status, seconds = await _timed_get(fresh, url)
                assert status == 200 and seconds < 1.0, (status, seconds)
            assert len(closed) < FLOOD // 2  # the requests above ran while the flood held
            await asyncio.gather(*flood)
        finally:
            for task in flood:
                task.cancel()
            await asyncio.gather(*flood, return_exceptions=True)
    assert len(closed) == FLOOD
    assert limits.head_timeout_s - 0.1 <= min(closed), min(closed)
    assert max(closed) <= limits.head_timeout_s + SLACK_S, max(closed)


async def test_slow_bodies_are_closed_at_the_body_deadline() -> None:
    """Issue 47 item 4: a request whose body has not all come within `body_timeout_s` of its
    head loses its connection (the head timer stops at the head: 50 slow bodies from other
    addresses were held for as long as their senders liked)."""
    limits = EdgeLimits(body_timeout_s=1.0, connections_per_address=100)
    head = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n[1,"
    async with serving(limits) as port:
        streams = [await asyncio.open_connection("127.0.0.1", port) for _ in range(50)]
        t0 = time.monotonic()
        for _, writer in streams:
            writer.write(head)  # and then nothing more of the 1000 bytes it announced
            await writer.drain()

        async def closed(reader: asyncio.StreamReader) -> float:
            with contextlib.suppress(ConnectionError):
                while await reader.read(4096):
                    pass
            return time.monotonic() - t0

        waited = await asyncio.wait_for(
            asyncio.gather(*(closed(reader) for reader, _ in streams)), 10
        )
        for _, writer in streams:
            writer.close()
    assert max(waited) < limits.body_timeout_s + 1.5, max(waited)
    assert min(waited) >= limits.body_timeout_s - 0.1


async def test_a_capped_route_refuses_a_larger_body_before_reading_it() -> None:
    """A route that needs no token (the hello) takes a few KiB: a larger announced body is a
    413 at once, none of it read."""
    async with serving() as port:
        head = (
            b"POST /capped HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 900\r\n\r\n"
        )
        reply = await exchange(port, head, timeout=3.0)  # no body sent: answered anyway
        assert error_of(reply, 413)["code"] == "request_too_large"
        body = b'{"a": 1}'
        small = head.replace(b"900", str(len(body)).encode()) + body
        assert split(await exchange(port, small))[2] == b'{"a": 1}'
