"""One HTTP/1.1 POST over a bare socket, its response body read in place (`read_into`).

aiohttp's client hands a body out as a new bytes object per read, 256 KiB at most. A KV stream
is hundreds of MB of frames, parsed where they land, so the decode node reads it with
`recv_into` straight into the frames' own buffers (`FrameReader.get_buffer`): no allocation
and no copy per read, and the same warm pages frame after frame. This speaks just what that
needs: one request per connection (`Connection: close`), plain `http://`, and a response body
that is chunked, sized by Content-Length, or runs to the close.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Mapping
from urllib.parse import urlsplit

from nodes.kv_link import receiver_socket

READ_AHEAD = 64 * 1024  # bytes buffered for the status line, headers and chunk sizes
MAX_LINE = 8 * 1024  # bytes in one status, header or chunk-size line
MAX_HEADERS = 100


class HttpError(Exception):
    """The peer broke HTTP/1.1 or hung up early; the message says how."""


class Connection:
    """A connected non-blocking socket. Lines come through a small read-ahead buffer; bulk
    bytes go straight from the socket into the caller's buffer."""

    def __init__(self, sock: socket.socket, read_timeout_s: float) -> None:
        self.sock = sock
        self.read_timeout_s = read_timeout_s  # the longest wait for the next byte
        self._loop = asyncio.get_running_loop()
        self._ahead = bytearray(READ_AHEAD)
        self._lo = self._hi = 0  # the unread bytes of `_ahead`
        self.received = 0  # bytes taken from the socket so far

    @classmethod
    async def open(cls, host: str, port: int, read_timeout_s: float) -> Connection:
        """Connect to the first address of `host` that answers within `read_timeout_s`."""
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
                return cls(sock, read_timeout_s)
            except OSError as e:  # TimeoutError too: try the next address
                sock.close()
                error = e
            except BaseException:
                sock.close()
                raise
        raise error

    def close(self) -> None:
        self.sock.close()

    async def send(self, data: bytes) -> None:
        async with asyncio.timeout(self.read_timeout_s):
            await self._loop.sock_sendall(self.sock, data)

    async def recv_into(self, view: memoryview) -> int:
        """Up to len(view) bytes into `view`; 0 at the end of the stream."""
        if self._lo == self._hi:
            return await self._recv(view)
        n = min(len(view), self._hi - self._lo)
        view[:n] = memoryview(self._ahead)[self._lo : self._lo + n]
        self._lo += n
        if n < len(view):  # and what has arrived since, in the same call
            with contextlib.suppress(BlockingIOError, InterruptedError):
                n += self._count(self.sock.recv_into(view[n:]))
        return n

    async def _recv(self, view: memoryview) -> int:
        try:  # bytes already waiting cost no trip through the event loop
            return self._count(self.sock.recv_into(view))
        except (BlockingIOError, InterruptedError):
            pass
        async with asyncio.timeout(self.read_timeout_s):
            return self._count(await self._loop.sock_recv_into(self.sock, view))

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
    url: str, body: bytes, headers: Mapping[str, str], *, read_timeout_s: float
) -> AsyncIterator[Response]:
    """POST `body` (JSON) to `url`; yields the response once its head is in."""
    where = urlsplit(url)
    if where.scheme != "http" or not where.hostname:
        raise HttpError(f"{url}: only http://host[:port]/path URLs are spoken here")
    conn = await Connection.open(where.hostname, where.port or 80, read_timeout_s)
    try:
        head = [
            f"POST {where.path or '/'} HTTP/1.1",
            f"Host: {where.netloc}",
            "Content-Type: application/json",
            f"Content-Length: {len(body)}",
            "Connection: close",
            *(f"{name}: {value}" for name, value in headers.items()),
        ]
        await conn.send("\r\n".join(head).encode("latin-1") + b"\r\n\r\n" + body)
        yield await _read_head(conn)
    finally:
        conn.close()
