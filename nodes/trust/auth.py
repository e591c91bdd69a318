"""The cluster token: where it comes from, which binds need it, how requests prove it.

A client's request carries `Authorization: Bearer TOKEN` (compared in constant time): the
token is the user's to give to the OpenAI API, the dashboard and tests. A node never sends
it: its requests to a peer are signed for that peer (`signing.py`), and peers prove the
token to each other in a hello (`hello.py`). Every `/v1/*` route but the hello, and
`/metrics`, accepts either, once a token is configured (`guarded`).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import secrets
import socket
import time
from pathlib import Path

from aiohttp import web
from tandem.nodes.contract.http import ApiError
from tandem.nodes.trust.signing import SIGNED_HEADERS, SignatureError, Verifier

log = logging.getLogger(__name__)
HELLO_PATH = "/v1/hello"
CONFIRM_PATH = "/v1/hello/confirm"
OPEN_PATHS = frozenset({"/health", HELLO_PATH, CONFIRM_PATH})
METRICS_PATH = "/metrics"  # Prometheus's usual path, outside /v1/: guarded all the same


class AuthError(Exception):
    """A token that cannot be used, or a configuration that would expose a node without one."""


def load_token(
    token_file: str | Path | None = None, default_file: Path | None = None
) -> str | None:
    """The token from `--token-file`, else `TANDEM_TOKEN`, else the stored default file."""
    if token_file is not None:
        path = Path(token_file)
        try:
            token = path.read_text().strip()
        except OSError as e:
            raise AuthError(f"{path}: cannot read the token file ({e.strerror})") from None
        if not token:
            raise AuthError(f"{path}: the token file is empty")
        return token
    env = os.environ.get("TANDEM_TOKEN", "").strip()
    if env:
        return env
    if default_file is not None and default_file.exists():
        return default_file.read_text().strip() or None
    return None


def new_token() -> str:
    return secrets.token_urlsafe(32)


def is_loopback(host: str) -> bool:
    """Whether a node bound to `host` is reachable from this machine only.

    True for 127.0.0.0/8 and ::1 (bare or in brackets, or IPv4-mapped `::ffff:127.x.x.x`,
    which is 127.x.x.x), and for a name, `localhost` included, whose every address is one of
    those. False for the wildcards (`""`, `0.0.0.0`, `::`, `0`), any other address, and a
    name that does not resolve. Names are resolved as the bind would (`getaddrinfo`), so
    `127.1` counts and `0` does not; resolving may block on DNS.
    """

    def loopback_ip(text: str) -> bool:  # ValueError when `text` is no IP literal
        ip = ipaddress.ip_address(text)
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            return ip.ipv4_mapped.is_loopback
        return ip.is_loopback

    literal = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        return loopback_ip(literal)
    except ValueError:
        pass
    if not host or literal != host:  # "" binds every interface; "[name]" is no address
        return False
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):  # socket.gaierror is an OSError; idna rejects some names
        return False
    try:
        return bool(infos) and all(loopback_ip(str(info[4][0])) for info in infos)
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    """A node without a token serves loopback only (`is_loopback`)."""
    if not token and not is_loopback(host):
        shown = host or '"" (every interface)'
        raise AuthError(
            f"refusing to listen on {shown} without a token: only 127.0.0.0/8, ::1 and "
            "localhost are loopback. Run `tandem pair` to create a token, or pass "
            "--token-file / TANDEM_TOKEN (or bind to 127.0.0.1)"
        )


def bearer_ok(header: str | None, token: str) -> bool:
    """`Authorization: Bearer TOKEN`, exactly (RFC 6750): the scheme, one space, the token,
    nothing before or after (no second space, no trailing whitespace), in constant time."""
    if header is None:
        return False
    want = f"Bearer {token}".encode("utf-8", "surrogatepass")
    return hmac.compare_digest(header.encode("utf-8", "surrogatepass"), want)


def guarded(path: str) -> bool:
    """Whether a request to `path` needs the token: `/metrics` and every `/v1/*` route but
    the hello (`/health` reveals no secret)."""
    return path == METRICS_PATH or (path.startswith("/v1/") and path not in OPEN_PATHS)


def auth_headers(token: str | None) -> dict[str, str]:
    """A client's header; a node calling a peer signs instead (`PeerTable.signed`)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


class Gate:
    """Who may call a route: every `guarded` one needs, once a token is configured, the bearer
    token (a client) or a request signed for `own_id` (a peer: fresh, and never seen before).
    Without a token the node serves loopback only (`check_bind`) and lets every request in."""

    def __init__(self, token: str | None, own_id: str) -> None:
        self.token = token
        self.verifier = Verifier(token, own_id) if token else None
        if self.verifier is not None:
            # this process remembers no nonce from before it started: refuse what was signed then
            self.verifier.floor = int(time.time()) - 1

    async def admit(self, request: web.Request) -> None:
        """Nothing for a request that may pass (a signed one's caller goes into
        `request[CALLER_KEY]`); ApiError 401 otherwise. A signed request's body is read here
        (aiohttp keeps the bytes for the handler; past the size limit, aiohttp's 413)."""
        if not self.token or self.verifier is None:  # no token: a loopback-only node
            return
        if not guarded(request.path):
            return
        if bearer_ok(request.headers.get("Authorization"), self.token):
            return
        if not any(h in request.headers for h in SIGNED_HEADERS):
            raise ApiError(401, "missing or wrong bearer token", "unauthorized")
        try:  # the headers first: a stranger's signature gets no body read
            self.verifier.check_head(request.headers)
        except SignatureError as e:
            log.info("refused a signed %s %s: %s", request.method, request.path, e)
            raise ApiError(401, f"signed request refused: {e}", "unauthorized") from None
        body = await request.read()
        try:
            caller = self.verifier.verify(
                request.method, request.path, request.query, body, request.headers
            )
        except SignatureError as e:
            log.info("refused a signed %s %s: %s", request.method, request.path, e)
            raise ApiError(401, f"signed request refused: {e}", "unauthorized") from None
        request[CALLER_KEY] = caller


CALLER_KEY = "tandem_caller"  # request key: the peer id a signed request came from
