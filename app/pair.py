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

from app.paths import config_dir
from nodes.auth import new_token, verify_proof


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
        "    tandem pair --check http://OTHER-MACHINE:8470"
    )


async def check(url: str, token: str) -> tuple[bool, str]:
    """Run `/v1/hello` against a node: does it hold our token? Returns (ok, explanation)."""
    url = url.rstrip("/")
    nonce, me = secrets.token_hex(16), "tandem-pair"
    timeout = aiohttp.ClientTimeout(total=5)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as s:
            async with s.get(f"{url}/health") as r:
                health = await r.json()
            async with s.post(f"{url}/v1/hello", json={"nonce": nonce, "id": me}) as r:
                if r.status != 200:
                    return False, f"{url} answered /v1/hello with HTTP {r.status}"
                answer = await r.json()
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
        return False, f"cannot reach {url}: {type(e).__name__} {e}".strip()
    name = health.get("name") or answer.get("id")
    model = (health.get("model") or {}).get("name", "?")
    ok = verify_proof(
        token, nonce, me, str(answer.get("id")), str(answer.get("fingerprint")),
        str(answer.get("proof")),
    )  # fmt: skip
    if not ok:
        return False, (
            f"{name} at {url} does NOT hold this token (its proof does not verify): "
            "run `tandem pair --set TOKEN` there with the token printed by `tandem pair` here"
        )
    return True, f"{name} at {url} holds this token: trusted (model {model})"


def run_check(url: str, token: str) -> tuple[bool, str]:
    return asyncio.run(check(url, token))
