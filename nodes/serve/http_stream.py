"""One HTTP/1.1 POST over a bare socket, its response body read in place (`read_into`).

aiohttp's client hands a body out as a new bytes object per read, 256 KiB at most. A KV stream
is hundreds of MB of frames, parsed where they land, so the decode node reads it with
`recv_into` straight into the frames' own buffers (`FrameReader.get_buffer`): no allocation
and no copy per read, and the same warm pages frame after frame. This speaks just what that
needs: one request per connection (`Connection: close`; before it, optionally, the JSON
requests of a hello on the same connection), `http://` or `https://`, and a
response body that is chunked, sized by Content-Length, or runs to the close.

`https://` is a non-blocking `ssl.SSLSocket` driven by the event loop's reader and writer
callbacks: OpenSSL decrypts each record straight into the caller's buffer, as a plain socket's
`recv_into` fills it. The peer's certificate must be the pinned one (`tls.check_peer`), checked
after the handshake and before one byte of the request is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from tandem.nodes.serve.kv_link import receiver_socket
from tandem.nodes.trust.hello import Post, channel_address
from tandem.nodes.trust.tls import TLSError, check_peer, client_context

READ_AHEAD = 64 * 1024  # bytes buffered for the status line, headers and chunk sizes
MAX_JSON = 64 * 1024  # bytes of a JSON reply (`call_json`)
MAX_LINE = 8 * 1024  # bytes in one status, header or chunk-size line
MAX_HEADERS = 100
# bytes one TLS read may decrypt (OpenSSL goes on through every record that has arrived):
# the event loop stays responsive, and a frame's reads stay many enough to time it by
TLS_READ_MAX = 2**20
# a non-blocking socket that has nothing to give (or take) yet; for TLS, also what it needs
_WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


# run on a request's own connection before it is sent: (post on it, the peer's ip:port)
Prove = Callable[[Post, str], Awaitable[None]]


class HttpError(Exception):
    """The peer broke HTTP/1.1 or hung up early, or is not the pinned peer; the message says
    how."""


class Connection:
    """A connected non-blocking socket, plain or TLS. Lines come through a small read-ahead
    buffer; bulk bytes go straight from the socket into the caller's buffer."""

    def __init__(self, sock: socket.socket, read_timeout_s: float) -> None:
        self.sock = sock
        self._tls = isinstance(sock, ssl.SSLSocket)
        self.read_timeout_s = read_timeout_s  # the longest wait for the next byte
        self._loop = asyncio.get_running_loop()
        self._ahead = bytearray(READ_AHEAD)
        self._lo = self._hi = 0  # the unread bytes of `_ahead`
        self.received = 0  # bytes taken from the socket so far (after decryption)

    @classmethod
    async def open(
        cls, host: str, port: int, read_timeout_s: float, pin: str | None = None
    ) -> Connection:
        """Connect to the first address of `host` that answers within `read_timeout_s`; with
        `pin`, over TLS to a peer whose certificate has that fingerprint (else HttpError)."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        error: OSError = OSError(f"{host}:{port} has no address")
        for info in infos:
            sock, address = receiver_socket(info), info[4]
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                async with asyncio.timeout(read_timeout_s):
                    await loop.sock_connect(sock, address)
            except OSError as e:  # TimeoutError too: try the next address
                sock.close()
                error = e
                continue
            except BaseException:
                sock.close()
                raise
            if pin is None:
                return cls(sock, read_timeout_s)
            return await cls._secure(sock, pin, read_timeout_s)
        raise error

    @classmethod
    async def _secure(cls, sock: socket.socket, pin: str, read_timeout_s: float) -> Connection:
        """The TLS handshake on a connected socket, then the pin check; the socket is closed
        on any failure."""
        try:
            tls = client_context().wrap_socket(sock, do_handshake_on_connect=False)
        except BaseException:
            sock.close()
            raise
        conn = cls(tls, read_timeout_s)
        try:
            async with asyncio.timeout(read_timeout_s):
                while True:
                    try:
                        tls.do_handshake()
                        break
                    except _WOULD_BLOCK as e:
                        await conn._ready(not isinstance(e, ssl.SSLWantWriteError))
            check_peer(tls, pin)
        except TLSError as e:
            conn.close()
            raise HttpError(str(e)) from None
        except BaseException:
            conn.close()
            raise
        return conn

    def close(self) -> None:
        self.sock.close()

    async def _ready(self, readable: bool) -> None:
        """Until the socket is readable (or writable)."""
        done = self._loop.create_future()
        fd = self.sock.fileno()

        def wake() -> None:
            if not done.done():
                done.set_result(None)

        if readable:
            self._loop.add_reader(fd, wake)
        else:
            self._loop.add_writer(fd, wake)
        try:
            await done
        finally:
            if readable:
                self._loop.remove_reader(fd)
            else:
                self._loop.remove_writer(fd)

    async def send(self, data: bytes) -> None:
        view = memoryview(data)
        async with asyncio.timeout(self.read_timeout_s):
            while view:
                try:
                    view = view[self.sock.send(view) :]
                except _WOULD_BLOCK as e:  # TLS may need to read before it can write
                    await self._ready(isinstance(e, ssl.SSLWantReadError))

    async def recv_into(self, view: memoryview) -> int:
        """Up to len(view) bytes into `view`; 0 at the end of the stream."""
        if self._lo == self._hi:
            return await self._recv(view)
        n = min(len(view), self._hi - self._lo)
        view[:n] = memoryview(self._ahead)[self._lo : self._lo + n]
        self._lo += n
        if n < len(view):  # and what has arrived since, in the same call
            n += self._more(view[n:])
        return n

    async def _recv(self, view: memoryview) -> int:
        if self._tls:
            view = view[:TLS_READ_MAX]
        try:  # bytes already waiting cost no trip through the event loop
            n = self._count(self.sock.recv_into(view))
        except _WOULD_BLOCK as e:
            n = await self._wait_recv(view, not isinstance(e, ssl.SSLWantWriteError))
        if self._tls and 0 < n < len(view):  # records that came in while these were read
            n += self._more(view[n:])
        return n

    async def _wait_recv(self, view: memoryview, readable: bool) -> int:
        async with asyncio.timeout(self.read_timeout_s):
            while True:
                await self._ready(readable)
                try:
                    return self._count(self.sock.recv_into(view))
                except _WOULD_BLOCK as e:  # TLS: a record not yet whole, or a write due
                    readable = not isinstance(e, ssl.SSLWantWriteError)

    def _more(self, view: memoryview) -> int:
        """What the socket holds now, into `view`, without waiting (TLS: up to
        TLS_READ_MAX, for as long as records keep coming)."""
        if self._tls:
            view = view[:TLS_READ_MAX]
        got = 0
        with contextlib.suppress(*_WOULD_BLOCK):
            while got < len(view) and (n := self._count(self.sock.recv_into(view[got:]))):
                got += n
                if not self._tls:
                    break  # a plain socket's recv_into took all it had
        return got

    def _count(self, n: int) -> int:
        self.received += n
        return n

    async def read_line(self) -> bytes:
        """The next line without its CRLF. HttpError past MAX_LINE bytes or at end of stream."""
        while (end := self._ahead.find(b"\r\n", self._lo, self._hi)) < 0:
            if self._hi - self._lo >= MAX_LINE:
                raise HttpError(f"a line longer than {MAX_LINE} bytes")
            if self._hi == len(self._ahead):  # make room: the unread bytes to the front
                self._ahead[: self._hi - self._lo] = self._ahead[self._lo : self._hi]
                self._lo, self._hi = 0, self._hi - self._lo
            n = await self._recv(memoryview(self._ahead)[self._hi :])
            if n == 0:
                raise HttpError("the connection closed inside the response head")
            self._hi += n
        line = bytes(self._ahead[self._lo : end])
        self._lo = end + 2
        return line


class Response:
    """A response's status and headers, and its body, de-chunked, through `read_into`."""

    def __init__(self, conn: Connection, status: int, headers: dict[str, str]) -> None:
        self.conn = conn
        self.status = status
        self.headers = headers  # lower-case names
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        if not self._chunked and length is not None and not length.isdigit():
            raise HttpError(f"Content-Length {length[:40]!r}")
        # bytes left: of this chunk (chunked), of the body (Content-Length), None: to the close
        self._left: int | None = 0 if self._chunked else (int(length) if length else None)
        self._crlf_due = False  # a chunk's data ended; its CRLF is next
        self._done = False

    async def read_into(self, view: memoryview) -> int:
        """Up to len(view) body bytes into `view`; 0 at the end of the body."""
        if self._done:
            return 0
        if self._chunked and self._left == 0 and not await self._next_chunk():
            return 0
        if self._left == 0:
            self._done = True
            return 0
        want = len(view) if self._left is None else min(len(view), self._left)
        n = await self.conn.recv_into(view[:want])
        if n == 0 and self._left is not None:
            raise HttpError(f"the connection closed with {self._left} body bytes to come")
        if self._left is not None:
            self._left -= n
            self._crlf_due = self._chunked and self._left == 0
        self._done = n == 0
        return n

    async def _next_chunk(self) -> bool:
        """Read the next chunk's size line; False after the last chunk (and its trailers)."""
        if self._crlf_due:
            if await self.conn.read_line():
                raise HttpError("no CRLF after a chunk's data")
            self._crlf_due = False
        line = await self.conn.read_line()
        size = line.split(b";")[0].strip()
        if not size or len(size) > 16 or size.strip(b"0123456789abcdefABCDEF"):
            raise HttpError(f"bad chunk size line {line[:40]!r}")
        self._left = int(size, 16)
        if self._left == 0:
            while await self.conn.read_line():  # trailers, up to the blank line
                pass
            self._done = True
        return not self._done

    async def read(self, limit: int) -> bytes:
        """The body's first `limit` bytes at most (an error's text)."""
        out = bytearray(limit)
        got = 0
        while got < limit and (n := await self.read_into(memoryview(out)[got:])):
            got += n
        return bytes(out[:got])


async def call_json(conn: Connection, netloc: str, path: str, obj: object) -> tuple[int, Any]:
    """One JSON POST on `conn`, which stays open for the next request: (status, the parsed
    reply of a 200, else None). ValueError for a 200 that is not JSON."""
    await _send_post(conn, netloc, path, json.dumps(obj).encode(), {})
    resp = await _read_head(conn)
    if resp.headers.get("connection", "").lower() == "close" or not (
        resp._chunked or "content-length" in resp.headers
    ):
        raise HttpError(f"{path}: the reply ends the connection the request must go on")
    data = await resp.read(MAX_JSON + 1)
    if len(data) > MAX_JSON:
        raise HttpError(f"{path}: a reply longer than {MAX_JSON} bytes")
    return resp.status, json.loads(data) if resp.status == 200 else None


async def _send_post(
    conn: Connection, netloc: str, path: str, body: bytes, headers: Mapping[str, str],
    close: bool = False,
) -> None:  # fmt: skip
    """A JSON POST's head and body; `close`: the last request on the connection."""
    head = [
        f"POST {path} HTTP/1.1",
        f"Host: {netloc}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        *(["Connection: close"] if close else []),
        *(f"{name}: {value}" for name, value in headers.items()),
    ]
    await conn.send("\r\n".join(head).encode("latin-1") + b"\r\n\r\n" + body)


async def _read_head(conn: Connection) -> Response:
    status_line = await conn.read_line()
    parts = status_line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise HttpError(f"not an HTTP/1.x status line: {status_line[:60]!r}")
    headers: dict[str, str] = {}
    while line := await conn.read_line():
        if len(headers) >= MAX_HEADERS:
            raise HttpError(f"more than {MAX_HEADERS} headers")
        name, sep, value = line.decode("latin-1").partition(":")
        if not sep:
            raise HttpError(f"a header line without a colon: {line[:60]!r}")
        headers[name.strip().lower()] = value.strip()
    return Response(conn, int(parts[1]), headers)


@contextlib.asynccontextmanager
async def post(
    url: str,
    body: bytes,
    headers: Mapping[str, str],
    *,
    read_timeout_s: float,
    pin: str | None = None,
    prove: Prove | None = None,
) -> AsyncIterator[Response]:
    """POST `body` (JSON) to `url`; yields the response once its head is in. An `https://`
    URL needs `pin`, the fingerprint its certificate must have. `prove(post, address)` runs
    first on the same connection (`post` sends JSON requests on it; `address` is the peer's
    `ip:port` it is connected to): the request goes only to the process that answered it."""
    where = urlsplit(url)
    if where.scheme not in ("http", "https") or not where.hostname:
        raise HttpError(f"{url}: only http:// and https://host[:port]/path URLs are spoken here")
    if (where.scheme == "https") != (pin is not None):
        raise HttpError(f"{url}: https:// needs a pinned certificate, and http:// cannot have one")
    port = where.port or (443 if where.scheme == "https" else 80)
    conn = await Connection.open(where.hostname, port, read_timeout_s, pin)
    try:
        if prove is not None:
            peer = conn.sock.getpeername()
            await prove(
                lambda path, obj: call_json(conn, where.netloc, path, obj),
                channel_address(str(peer[0]), int(peer[1])),
            )
        await _send_post(conn, where.netloc, where.path or "/", body, headers, close=True)
        yield await _read_head(conn)
    finally:
        conn.close()
