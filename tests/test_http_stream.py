"""The decode node's HTTP/1.1 client for KV streams (nodes/serve/http_stream.py): against a
real aiohttp server for what aiohttp sends, and a raw socket server for what it never would."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from tandem.nodes.serve import http_stream
from tandem.nodes.serve.http_stream import HttpError
from tandem.nodes.serve.kv_link import BUFFER_BYTES, arrival_seconds, tune_receiver, tune_sender
from tandem.nodes.trust.tls import Identity, load_or_create, server_context

BODY = bytes(range(256)) * 1200  # 300 KiB
PIECES = [1, 2, 3, 1000, 1005, 70_000, 170_000, len(BODY)]  # the server's writes, cut at these


async def read_body(resp: http_stream.Response, view_size: int) -> bytes:
    """The whole body, read into views of `view_size` bytes, as the frame reader reads."""
    out = bytearray()
    buffer = memoryview(bytearray(view_size))
    while n := await resp.read_into(buffer):
        out += buffer[:n]
    return bytes(out)


@contextlib.asynccontextmanager
async def serve(identity: Identity | None = None) -> AsyncIterator[str]:
    """An aiohttp server with a route for each case (over TLS with `identity`); yields its
    URL."""

    async def chunked(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        start = 0
        for end in PIECES:
            await resp.write(BODY[start:end])
            await asyncio.sleep(0)
            start = end
        await resp.write_eof()
        return resp

    async def sized(request: web.Request) -> web.Response:
        return web.Response(body=BODY)

    async def echo(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"body": body, "headers": dict(request.headers)})

    async def busy(request: web.Request) -> web.Response:
        return web.json_response({"error": "busy"}, status=503, headers={"Retry-After": "2"})

    async def hang(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b"x")
        await asyncio.sleep(30)
        return resp

    app = web.Application()
    for path, handler in [("/chunked", chunked), ("/sized", sized), ("/echo", echo),
                          ("/busy", busy), ("/hang", hang)]:  # fmt: skip
        app.router.add_post(path, handler)
    srv = TestServer(app, host="127.0.0.1")
    await srv.start_server(ssl=server_context(identity) if identity is not None else None)
    try:
        yield str(srv.make_url("")).rstrip("/")
    finally:
        await srv.close()


@pytest.fixture(scope="module")
def identity(tmp_path_factory: pytest.TempPathFactory) -> Identity:
    return load_or_create(tmp_path_factory.mktemp("tls"), "stream-test")


@pytest.mark.parametrize("view_size", [1, 7, 4096, 1 << 20])
@pytest.mark.parametrize("path", ["/chunked", "/sized"])
async def test_bodies_read_whole(path: str, view_size: int) -> None:
    async with (
        serve() as server,
        http_stream.post(server + path, b"{}", {}, read_timeout_s=10) as resp,
    ):
        assert resp.status == 200
        assert await read_body(resp, view_size) == BODY
        assert await resp.read_into(memoryview(bytearray(10))) == 0  # and stays ended
    assert resp.conn.received >= len(BODY)


async def test_request_carries_body_and_headers() -> None:
    body = json.dumps({"tokens": list(range(1000))}).encode()
    headers = {"Authorization": "Bearer s3cret"}
    async with (
        serve() as server,
        http_stream.post(server + "/echo", body, headers, read_timeout_s=10) as resp,
    ):
        got = json.loads(await resp.read(1 << 20))
    assert got["body"] == {"tokens": list(range(1000))}
    assert got["headers"]["Authorization"] == "Bearer s3cret"
    assert got["headers"]["Content-Type"] == "application/json"
    assert got["headers"]["Host"] == server.removeprefix("http://")


async def test_error_status_and_headers() -> None:
    async with (
        serve() as server,
        http_stream.post(server + "/busy", b"{}", {}, read_timeout_s=10) as resp,
    ):
        assert resp.status == 503
        assert resp.headers["retry-after"] == "2"
        assert json.loads(await resp.read(300)) == {"error": "busy"}


async def test_a_silent_server_times_out() -> None:
    async with (
        serve() as server,
        http_stream.post(server + "/hang", b"{}", {}, read_timeout_s=0.3) as resp,
    ):
        with pytest.raises(TimeoutError):
            await read_body(resp, 4096)


@pytest.mark.parametrize("view_size", [1, 7, 4096, 1 << 20])
@pytest.mark.parametrize("path", ["/chunked", "/sized"])
async def test_tls_bodies_read_whole_into_the_given_buffer(
    identity: Identity, path: str, view_size: int
) -> None:
    async with (
        serve(identity) as server,
        http_stream.post(
            server + path, b"{}", {}, read_timeout_s=10, pin=identity.fingerprint
        ) as resp,
    ):
        assert server.startswith("https://") and resp.status == 200
        assert await read_body(resp, view_size) == BODY
        assert resp.conn.received >= len(BODY)


async def test_tls_echo_and_503(identity: Identity) -> None:
    async with serve(identity) as server:
        headers = {"X-Tandem-Signature": "ab" * 32}
        async with http_stream.post(
            server + "/echo", b'{"a": 1}', headers, read_timeout_s=10, pin=identity.fingerprint
        ) as resp:
            got = json.loads(await resp.read(10_000))
        assert got["body"] == {"a": 1} and got["headers"]["X-Tandem-Signature"] == "ab" * 32
        async with http_stream.post(
            server + "/busy", b"{}", {}, read_timeout_s=10, pin=identity.fingerprint
        ) as resp:
            assert resp.status == 503 and resp.headers["retry-after"] == "2"


async def test_another_certificate_gets_not_one_byte_of_the_request(
    identity: Identity, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A TLS server with another identity at the pinned address: the handshake completes,
    the pin does not match, and the request (its signature headers) is never sent."""
    impostor = load_or_create(tmp_path_factory.mktemp("impostor"), "impostor")
    received = bytearray()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            received.extend(await reader.read())
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_context(impostor))
    port = srv.sockets[0].getsockname()[1]
    try:
        with pytest.raises(HttpError, match="not the pinned"):
            async with http_stream.post(
                f"https://127.0.0.1:{port}/v1/prefill", b'{"tokens": [1]}',
                {"X-Tandem-Signature": "cd" * 32}, read_timeout_s=5, pin=identity.fingerprint,
            ):  # fmt: skip
                pass
        await asyncio.sleep(0.1)
    finally:
        srv.close()
        await srv.wait_closed()
    assert received == b""


async def test_tls_to_a_plain_server_fails_cleanly() -> None:
    async with serve() as server:
        with pytest.raises((HttpError, OSError)):
            url = server.replace("http://", "https://") + "/sized"
            async with http_stream.post(url, b"{}", {}, read_timeout_s=5, pin="ab" * 32):
                pass


async def test_unreachable_and_unsupported_urls() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    with pytest.raises(OSError):
        async with http_stream.post(f"http://127.0.0.1:{port}/", b"", {}, read_timeout_s=5):
            pass
    with pytest.raises(HttpError, match="only http"):
        async with http_stream.post("ftp://example.com/", b"", {}, read_timeout_s=5):
            pass
    with pytest.raises(HttpError, match="pinned certificate"):  # https needs a pin...
        async with http_stream.post("https://example.com/", b"", {}, read_timeout_s=5):
            pass
    with pytest.raises(HttpError, match="pinned certificate"):  # ...and http cannot take one
        async with http_stream.post("http://x/", b"", {}, read_timeout_s=5, pin="ab" * 32):
            pass


# --- what a broken or hostile peer sends -----------------------------------------------------


async def raw_exchange(reply: bytes, read: Callable[[http_stream.Response], Awaitable[object]]):
    """Serve `reply` verbatim (then close) to one POST, and return what `read` makes of it."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(reply)
        await writer.drain()
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        async with http_stream.post(f"http://127.0.0.1:{port}/", b"{}", {},
                                    read_timeout_s=5) as resp:  # fmt: skip
            return await read(resp)
    finally:
        srv.close()
        await srv.wait_closed()


def _whole(resp: http_stream.Response) -> Awaitable[bytes]:
    return read_body(resp, 100)


async def test_a_body_that_runs_to_the_close() -> None:
    assert await raw_exchange(b"HTTP/1.0 200 OK\r\n\r\nhello world", _whole) == b"hello world"


async def test_chunk_extensions_and_trailers() -> None:
    reply = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;x=1\r\nhello\r\n0\r\nT: 1\r\n\r\n"
    )
    assert await raw_exchange(reply, _whole) == b"hello"


CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
BROKEN = {
    "not http": (b"SSH-2.0-OpenSSH\r\n\r\n", "status line"),
    "status not a number": (b"HTTP/1.1 OK fine\r\n\r\n", "status line"),
    "header without colon": (b"HTTP/1.1 200 OK\r\nnonsense\r\n\r\n", "colon"),
    "endless line": (b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70_000, "longer than"),
    "closed in the head": (b"HTTP/1.1 200 OK\r\nX: 1\r\n", "inside the response head"),
    "bad chunk size": (CHUNKED + b"zz\r\nhello\r\n", "chunk size"),
    "huge chunk size": (CHUNKED + b"1" * 17 + b"\r\n", "chunk size"),
    "no crlf after chunk": (CHUNKED + b"5\r\nhelloXX5\r\nhello\r\n", "CRLF"),
    "closed in a chunk": (CHUNKED + b"a\r\nhel", "to come"),
    "closed before the length": (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhel", "to come"),
    "bad length": (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "Content-Length"),
}


@pytest.mark.parametrize("reply,message", BROKEN.values(), ids=BROKEN.keys())
async def test_broken_replies_raise_http_error(reply: bytes, message: str) -> None:
    with pytest.raises(HttpError, match=message):
        await raw_exchange(reply, _whole)


# --- the link's settings and timing (nodes/serve/kv_link.py) ---


def test_socket_settings() -> None:
    with socket.socket() as s:
        before = s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        tune_receiver(s)
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) > before
    with socket.socket() as s:
        tune_sender(s)
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= min(BUFFER_BYTES, 200_000)
        if hasattr(socket, "TCP_CONGESTION"):
            name = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
            assert name.rstrip(b"\0") == b"reno"
    tune_sender(None)  # a transport without a socket: nothing to do


def test_arrival_seconds() -> None:
    # 1 MB arrived in the 0.5 ms after the first read: 2 MB take 1 ms at that rate
    assert arrival_seconds(2_000_000, 0.0005, 1_000_000) == pytest.approx(0.001)
    assert arrival_seconds(2_000_000, 0.0, 0) == 0.0  # all in the first read: no rate seen
