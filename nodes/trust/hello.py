"""Hello v2 (issue 19): two nodes prove the cluster token to each other, bound to the channel.

    caller → callee  POST /v1/hello          {"nonce": caller_nonce, "id": caller_id}
    callee → caller  200 {"id", "fingerprint", "cert_fingerprint", "nonce": callee_nonce,
                          "proof": hello_proof(role="callee", ...)}
    caller → callee  POST /v1/hello/confirm  {"nonce": callee_nonce, "id": caller_id,
                          "proof": hello_proof(role="caller", ...)}
    callee → caller  200 {"id", "caller", "proven": true} | 401

Both proofs cover both nonces, both ids, the model fingerprint and the channel: over TLS the
certificate the caller's own handshake saw (it learns it first, then makes the hello over a
connection pinned to it); on plain-HTTP loopback the callee's socket address, as the callee's
socket and the caller's resolver name it. A relay presents its own certificate or sits at its
own address, so the real node's proof does not verify for it. The caller proves only after
the callee did, over the callee's nonce: no node signs anything for someone who has not
proved the token, and a callee's proof names its own nonce, id and channel, so it helps
nobody to impersonate anyone.

A node with no token (loopback only, `check_bind`) proves with a fixed public key instead:
nodes without tokens recognise each other, and one with a token never trusts them.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import ipaddress
import logging
import re
import secrets
import socket
import ssl
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from tandem.nodes.contract.http import Reason
from tandem.nodes.trust.auth import CONFIRM_PATH, HELLO_PATH
from tandem.nodes.trust.signing import (
    MAX_ID_CHARS,
    fields,
    hello_proof,
    new_nonce,
    utf8,
    verify_hello_proof,
)
from tandem.nodes.trust.tls import TLSError, aiohttp_pin, client_context, peer_fingerprint

log = logging.getLogger(__name__)
NO_TOKEN_KEY = "tandem-no-token"  # public: proves nothing but "no token here either"
PENDING_S = 30.0  # how long a callee nonce stays good for the caller's confirm
MAX_USED = 4096  # confirms remembered (each within its PENDING_S): beyond, a floor rises
_COOKIE_MAC = re.compile(r"[0-9a-f]{64}")
MAX_PROVEN = 1024
HELLO_TIMEOUT_S = 3.0
MIN_NONCE, MAX_NONCE = 8, 256  # characters


class HelloError(Exception):
    """A hello that did not prove the peer; `reason` as `/v1/cluster` shows it."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class HelloRefused(Exception):
    """A confirm this node does not accept (401); the message says why, never the token."""


@dataclass(frozen=True)
class Proven:
    """A peer that proved the token in a hello, and the channel it proved it on."""

    id: str
    fingerprint: str  # its model's
    cert_fingerprint: str  # the TLS certificate to pin from now on; "" on plain HTTP


def channel_address(host: str, port: int) -> str:
    """`ip:port` (`[ip]:port` for IPv6), an IPv4-mapped address as IPv4, any zone dropped:
    one spelling for what the callee's socket and the caller's resolver say."""
    ip = ipaddress.ip_address(host.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def _key(token: str | None) -> str:
    return token or NO_TOKEN_KEY


class HelloResponder:
    """The callee's side: answers hellos and checks the confirms that follow them.

    It signs only inside a hello it is part of: its proof covers its own fresh nonce, id and
    channel. A hello leaves no state here: the callee nonce it hands out is a cookie that
    carries the hello (its caller nonce and expiry) under a MAC of this process's own secret
    over that, the caller's id and the channel, so no flood of hellos (from any address, on
    loopback every caller's) can push another caller's hello out. A confirm is checked
    against its cookie, valid `PENDING_S`, and remembered once its proof verifies, so it is
    used once: only a token holder adds to what is remembered."""

    def __init__(
        self,
        token: str | None,
        own_id: str,
        fingerprint: str,
        cert_fingerprint: str,
        max_used: int = MAX_USED,
    ) -> None:
        self._key = _key(token)
        self._secret = secrets.token_bytes(32)  # this process's: never leaves it
        self.own_id = own_id
        self.fingerprint = fingerprint
        self.cert_fingerprint = cert_fingerprint  # "" when serving plain HTTP
        self.max_used = max_used
        self._used: OrderedDict[str, int] = OrderedDict()  # confirmed cookie → its expiry
        self._floor_ms = -1  # cookies expiring at or before this are refused (forgotten)
        self.proven: OrderedDict[str, float] = OrderedDict()  # caller id → when (epoch s)

    def __repr__(self) -> str:  # never the token
        return f"HelloResponder(own_id={self.own_id!r}, used={len(self._used)})"

    def _address(self, sockname: Any) -> str:
        """The channel's address part: this socket's address on plain HTTP, "" over TLS."""
        if self.cert_fingerprint:
            return ""
        if not isinstance(sockname, tuple) or len(sockname) < 2:
            raise ValueError("cannot tell which address the hello came in on")
        return channel_address(str(sockname[0]), int(sockname[1]))

    def _mac(self, head: str, caller: str, address: str) -> str:
        return hmac.new(self._secret, fields(head, caller, address), hashlib.sha256).hexdigest()

    def answer(self, body: object, sockname: Any) -> dict[str, str]:
        """The answer to `POST /v1/hello` that came in on `sockname`; ValueError on a
        malformed body."""
        if not isinstance(body, dict):
            raise ValueError("hello needs {nonce, id}")
        nonce, caller = body.get("nonce"), body.get("id", "")
        if not isinstance(nonce, str) or not MIN_NONCE <= len(nonce) <= MAX_NONCE:
            raise ValueError(f"nonce must be a string of {MIN_NONCE} to {MAX_NONCE} characters")
        if not isinstance(caller, str) or len(caller) > MAX_ID_CHARS:
            raise ValueError(f"id must be a string of at most {MAX_ID_CHARS} characters")
        address = self._address(sockname)
        expires_ms = _now_ms() + int(PENDING_S * 1000)
        carried = base64.urlsafe_b64encode(utf8(nonce)).decode("ascii")
        head = f"{new_nonce()}.{expires_ms}.{carried}"
        own_nonce = f"{head}.{self._mac(head, caller, address)}"
        proof = hello_proof(
            self._key, "callee", nonce, own_nonce, caller, self.own_id, self.fingerprint,
            self.cert_fingerprint, address,
        )  # fmt: skip
        return {
            "id": self.own_id,
            "fingerprint": self.fingerprint,
            "cert_fingerprint": self.cert_fingerprint,
            "nonce": own_nonce,
            "proof": proof,
        }

    def confirm(self, body: object, sockname: Any) -> str:
        """Check `POST /v1/hello/confirm`, which came in on `sockname`; the caller's id once
        it proved the token. ValueError on a malformed body, HelloRefused on a nonce this
        node did not hand out for this caller and channel (or one expired or used), or a
        proof that does not verify."""
        if not isinstance(body, dict):
            raise ValueError("confirm needs {nonce, id, proof}")
        nonce, caller, proof = body.get("nonce"), body.get("id"), body.get("proof")
        if not all(isinstance(v, str) for v in (nonce, caller, proof)):
            raise ValueError("confirm needs {nonce, id, proof}, all strings")
        assert isinstance(nonce, str) and isinstance(caller, str) and isinstance(proof, str)
        address = self._address(sockname)
        caller_nonce, expires_ms = self._open(nonce, caller, address)
        now = _now_ms()
        if expires_ms <= max(now, self._floor_ms) or nonce in self._used:
            raise HelloRefused("no hello of this node's is waiting for that nonce")
        if not verify_hello_proof(
            self._key, "caller", proof=proof, caller_nonce=caller_nonce, callee_nonce=nonce,
            caller_id=caller, callee_id=self.own_id, model_fingerprint=self.fingerprint,
            cert_fingerprint=self.cert_fingerprint, address=address,
        ):  # fmt: skip
            raise HelloRefused("the caller's proof does not verify")
        self._used[nonce] = expires_ms
        self._forget(now)  # an expired one left here is refused as expired anyway
        self.proven[caller] = time.time()
        self.proven.move_to_end(caller)
        while len(self.proven) > MAX_PROVEN:
            self.proven.popitem(last=False)
        log.debug("peer %s proved the token", caller)
        return caller

    def _open(self, nonce: str, caller: str, address: str) -> tuple[str, int]:
        """The caller nonce and expiry a cookie of this node's carries, for this caller and
        channel; HelloRefused for anything else."""
        parts = nonce.split(".")
        if len(parts) == 4 and _COOKIE_MAC.fullmatch(parts[3]):
            head = ".".join(parts[:3])
            if hmac.compare_digest(parts[3], self._mac(head, caller, address)):
                # made here, so well formed: a fresh nonce, digits, base64 of UTF-8
                return base64.urlsafe_b64decode(parts[2]).decode("utf-8"), int(parts[1])
        raise HelloRefused("no hello of this node's is waiting for that nonce")

    def _forget(self, now_ms: int) -> None:
        """Drop remembered confirms once expired (then refused as such), and the oldest
        beyond `max_used`, raising the floor past it: forgetting never reopens a replay."""
        while self._used:
            expires_ms = next(iter(self._used.values()))
            full = len(self._used) > self.max_used
            if not full and expires_ms > now_ms:
                return
            self._used.popitem(last=False)
            if full:
                self._floor_ms = max(self._floor_ms, expires_ms)


def _now_ms() -> int:
    return int(time.monotonic() * 1000)


async def learn_certificate(host: str, port: int, timeout_s: float = HELLO_TIMEOUT_S) -> str:
    """The fingerprint of the certificate `host:port` presents (a handshake, then close)."""
    async with asyncio.timeout(timeout_s):
        _, writer = await asyncio.open_connection(host, port, ssl=client_context())
    try:
        return peer_fingerprint(writer.get_extra_info("ssl_object"))
    finally:
        writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await writer.wait_closed()


async def _addresses(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(channel_address(str(i[4][0]), port) for i in infos))


# one JSON request on the caller's channel: (path, body) → (HTTP status, the parsed reply);
# ValueError for a reply that is not JSON
Post = Callable[[str, dict[str, str]], Awaitable[tuple[int, Any]]]


@dataclass(frozen=True)
class Channel:
    """Where a hello goes and what identifies the callee there: `cert`, the fingerprint of
    the certificate this side's handshake saw (TLS), or `address`, the callee's one `ip:port`
    (plain HTTP); `pin`, aiohttp's `ssl=` that holds the requests to that certificate."""

    url: str
    cert: str
    address: str
    pin: aiohttp.Fingerprint | bool


@dataclass(frozen=True)
class SessionPost:
    """`Post` through an aiohttp session, each request held to the channel's pin."""

    session: aiohttp.ClientSession
    channel: Channel
    timeout: aiohttp.ClientTimeout

    async def __call__(self, path: str, body: dict[str, str]) -> tuple[int, Any]:
        url = self.channel.url.rstrip("/") + path
        async with self.session.post(
            url, json=body, ssl=self.channel.pin, timeout=self.timeout
        ) as r:
            return r.status, await r.json(content_type=None) if r.status == 200 else None


async def open_channel(url: str, timeout_s: float = HELLO_TIMEOUT_S) -> Channel:
    """The channel to the node at `url` (http:// or https://): over TLS the certificate it
    presents, over plain HTTP the one address its name resolves to; HelloError for a URL
    that is neither, or a name with several addresses (the proof binds one, the requests
    may go to another)."""
    where = urlsplit(url)
    if where.scheme not in ("http", "https") or not where.hostname:
        raise HelloError("unreachable", f"{url}: not an http:// or https:// URL")
    host, port = where.hostname, where.port or (443 if where.scheme == "https" else 80)
    if where.scheme == "https":
        cert = await learn_certificate(host, port, timeout_s)
        return Channel(url, cert, "", aiohttp_pin(cert))
    addresses = await _addresses(host, port)
    if len(addresses) > 1:
        raise HelloError(
            "unauthorized",
            f"{host} resolves to {', '.join(addresses)}: over plain HTTP a node is known"
            f" by its one address (a relay could answer at another); use"
            f" http://{addresses[0]}",
        )
    return Channel(url, "", addresses[0], True)


async def prove(
    session: aiohttp.ClientSession,
    url: str,
    token: str | None,
    own_id: str,
    timeout_s: float = HELLO_TIMEOUT_S,
) -> Proven:
    """Run a hello with the node at `url` (http:// or https://); HelloError unless it proves
    the token on the channel this side sees, and accepts this side's proof in turn."""
    try:
        channel = await open_channel(url, timeout_s)
        post = SessionPost(session, channel, aiohttp.ClientTimeout(total=timeout_s))
        return await hello_over(post, token, own_id, channel.cert, channel.address)
    except aiohttp.ServerFingerprintMismatch:
        raise HelloError("unauthorized", "its certificate changed during the hello") from None
    except TLSError as e:
        raise HelloError("bad_reply", str(e)) from None
    except (aiohttp.ClientError, TimeoutError, OSError, ssl.SSLError) as e:
        raise HelloError("unreachable", f"{type(e).__name__}: {e}".rstrip(": ")) from None


async def hello_over(post: Post, token: str | None, own_id: str, cert: str, address: str) -> Proven:
    """The hello's two requests through `post`, on a channel whose identity is `cert` (TLS:
    the certificate this side's handshake saw) or `address` (plain HTTP: the callee's
    `ip:port` this side is connected to); HelloError unless both proofs verify."""
    key, nonce = _key(token), new_nonce()
    try:
        status, answer = await post(HELLO_PATH, {"nonce": nonce, "id": own_id})
    except ValueError:  # a body that is not JSON
        raise HelloError("bad_reply", f"{HELLO_PATH} did not answer JSON") from None
    if status != 200:
        raise HelloError("unauthorized", f"{HELLO_PATH} answered HTTP {status}")
    if not isinstance(answer, dict) or not all(
        isinstance(answer.get(k), str) for k in ("id", "fingerprint", "nonce", "proof")
    ):
        raise HelloError("bad_reply", f"{HELLO_PATH} did not answer a hello v2 object")
    peer_id, fp, peer_nonce = answer["id"], answer["fingerprint"], answer["nonce"]
    if not verify_hello_proof(
        key, "callee", proof=answer["proof"], caller_nonce=nonce, callee_nonce=peer_nonce,
        caller_id=own_id, callee_id=peer_id, model_fingerprint=fp, cert_fingerprint=cert,
        address=address,
    ):  # fmt: skip
        raise HelloError(
            "unauthorized",
            "its hello proof does not verify: it does not hold this token, or it is not "
            "the node at this address (a relay)",
        )
    proof = hello_proof(key, "caller", nonce, peer_nonce, own_id, peer_id, fp, cert, address)
    try:
        status, _ = await post(CONFIRM_PATH, {"nonce": peer_nonce, "id": own_id, "proof": proof})
    except ValueError:
        status = 0
    if status != 200:
        raise HelloError("unauthorized", f"it refused this node's proof (HTTP {status})")
    return Proven(peer_id, fp, cert)
