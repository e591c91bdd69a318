"""`tandem pair`: one cluster token, stored on each machine, and a way to check a pairing.

The token lives in the user's config dir (mode 0600). Nodes and the dashboard read it by
default; `--token-file` and `TANDEM_TOKEN` override it.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shlex
from pathlib import Path

import aiohttp
from tandem.app.paths import config_dir
from tandem.nodes.contract.cluster import Health
from tandem.nodes.contract.http import ContractError
from tandem.nodes.trust.auth import new_token
from tandem.nodes.trust.hello import HelloError, prove


def token_path() -> Path:
    return config_dir() / "token"


def store_token(token: str, path: Path | None = None) -> Path:
    """Write the token with mode 0600 (created that way: never readable by others)."""
    path = path or token_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.chmod(path, 0o600)
    return path


def ensure_token() -> tuple[str, bool]:
    """(token, created): the stored token, made now if there was none."""
    path = token_path()
    if path.exists() and path.read_text().strip():
        return path.read_text().strip(), False
    token = new_token()
    store_token(token, path)
    return token, True


def pair_text(token: str, created: bool) -> str:
    verb = "Created" if created else "Using"
    return (
        f"{verb} the cluster token in {token_path()} (mode 0600).\n\n"
        "On the other machine, store the same token with:\n\n"
        f"    tandem pair --set {shlex.quote(token)}\n\n"
        "Then start a node on each machine; they find each other on the LAN and trust\n"
        "each other once each proves it holds this token. Check a node with:\n\n"
        "    tandem pair --check https://OTHER-MACHINE:8470\n\n"
        "(a node listening beyond loopback serves HTTPS with its own certificate; the check\n"
        "prints the certificate's fingerprint, which peers pin once it proved the token)"
    )


async def _health(s: aiohttp.ClientSession, url: str) -> tuple[str, object]:
    """(url, its /health body). `host:port` with no scheme is tried as https:// first (a
    node beyond loopback serves TLS), then http://. The certificate is not checked here
    (public data); the hello that follows checks it."""

    async def get(u: str) -> object:
        async with s.get(f"{u}/health", ssl=False) as r:
            return await r.json()

    if "://" in url:
        return url, await get(url)
    try:
        return f"https://{url}", await get(f"https://{url}")
    except (aiohttp.ClientError, ValueError):  # a plain-HTTP node refuses the handshake
        return f"http://{url}", await get(f"http://{url}")


async def check(url: str, token: str) -> tuple[bool, str]:
    """Run a hello with a node: does it hold our token, on the channel we see? Returns
    (ok, explanation); the explanation names the certificate pinned for an https:// node."""
    url = url.strip().rstrip("/")
    timeout = aiohttp.ClientTimeout(total=5)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as s:
            url, body = await _health(s, url)
            proven = await prove(s, url, token, "tandem-pair-" + secrets.token_hex(4))
    except HelloError as e:
        if e.reason == "unauthorized":
            return False, (
                f"{url} does NOT hold this token, or is not the node it claims to be ({e}): "
                "run `tandem pair --set TOKEN` there with the token printed by `tandem pair` here"
            )
        return False, f"cannot check {url}: {e}"
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
        return False, f"cannot reach {url}: {type(e).__name__} {e}".strip()
    health = _readable(body)
    name = (health.name if health else "") or proven.id
    model = (health.model_name if health else "") or "?"
    pinned = (
        f"; pinned its TLS certificate sha256:{proven.cert_fingerprint}"
        if proven.cert_fingerprint
        else "; plain HTTP (loopback), no certificate to pin"
    )
    return True, f"{name} at {url} holds this token: trusted (model {model}){pinned}"


def _readable(body: object) -> Health | None:
    """The node's `/health`, or None where it is not one: the hello, not `/health`, says
    whether the node holds the token, so the check goes on without its name."""
    try:
        return Health.from_json(body)
    except ContractError:
        return None


def run_check(url: str, token: str) -> tuple[bool, str]:
    return asyncio.run(check(url, token))
