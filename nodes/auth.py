"""The cluster token: where it comes from, how requests prove it, how peers prove it.

Requests carry `Authorization: Bearer TOKEN` (compared in constant time). Peers prove they
hold the token without sending it: `POST /v1/hello {"nonce", "id"}` is answered with
`proof = hex(hmac_sha256(token, nonce ‖ caller ‖ own id ‖ fingerprint))` (DESIGN.md).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
from hashlib import sha256
from pathlib import Path

from aiohttp import web

OPEN_PATHS = frozenset({"/health", "/v1/hello"})


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
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    """A node without a token serves loopback only."""
    if token is None and not is_loopback(host):
        raise AuthError(
            f"refusing to listen on {host} without a token: run `tandem pair` to create one, "
            "or pass --token-file / TANDEM_TOKEN (or bind to 127.0.0.1)"
        )


def proof(token: str, nonce: str, caller: str, own_id: str, fingerprint: str) -> str:
    msg = "\n".join((nonce, caller, own_id, fingerprint)).encode()
    return hmac.new(token.encode(), msg, sha256).hexdigest()


def verify_proof(
    token: str, nonce: str, caller: str, peer_id: str, fingerprint: str, got: str
) -> bool:
    return hmac.compare_digest(proof(token, nonce, caller, peer_id, fingerprint), str(got))


def bearer_ok(header: str | None, token: str) -> bool:
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer ") :].strip().encode(), token.encode())


def auth_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def auth_middleware(token: str | None) -> web.middleware:
    """Every `/v1/*` route but `/v1/hello` needs the bearer token once one is configured."""

    @web.middleware
    async def middleware(request: web.Request, handler: web.Handler) -> web.StreamResponse:
        if token is None or request.path in OPEN_PATHS or not request.path.startswith("/v1/"):
            return await handler(request)
        if not bearer_ok(request.headers.get("Authorization"), token):
            return web.json_response(
                {"error": {"message": "missing or wrong bearer token", "type": "unauthorized",
                           "code": "unauthorized"}},
                status=401,
            )  # fmt: skip
        return await handler(request)

    return middleware
