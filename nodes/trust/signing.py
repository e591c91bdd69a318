"""Node-to-node authentication that never sends the cluster token: signed requests and hello v2.

A signed request carries `X-Tandem-Caller`, `X-Tandem-Callee`, `X-Tandem-Time` (unix
seconds), `X-Tandem-Nonce` (32 hex) and `X-Tandem-Signature` (64 hex):

    signature = hex(hmac_sha256(token, fields("tandem-request-v1", METHOD, path,
                    canonical_query, time, nonce, hex(sha256(body)), caller, callee)))

where `fields` length-prefixes every field (u64 big-endian byte count, then UTF-8), so no
choice of values can make two different requests sign the same bytes. The callee checks the
signature for its *own* id, the time against a window, and refuses a nonce it has seen: a
relay may forward a request once, to the node it was meant for, and learns nothing it can
sign with.

The hello proof covers both nonces, both ids, the model fingerprint, the channel (the
callee's TLS certificate fingerprint over TLS; on plain-HTTP loopback, the callee's socket
address the hello reached) and the prover's role, so a proof made for one direction, peer,
channel or challenge verifies for no other.
"""

from __future__ import annotations

import hmac
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from hashlib import sha256
from typing import Literal
from urllib.parse import parse_qsl, quote

CALLER = "X-Tandem-Caller"
CALLEE = "X-Tandem-Callee"
TIME = "X-Tandem-Time"
NONCE = "X-Tandem-Nonce"
SIGNATURE = "X-Tandem-Signature"
SIGNED_HEADERS = (CALLER, CALLEE, TIME, NONCE, SIGNATURE)

WINDOW_S = 30  # how far a request's time may be from the callee's clock, either way
# Nonces one verifier remembers: ~1.6 MiB when full. A nonce is held until its request's time
# is a window old (30-60 s), so this fails closed only past ~270-550 signed requests/s,
# far above what peers send (a few per chat request).
MAX_NONCES = 16384
MAX_ID_CHARS = 256
REQUEST_DOMAIN = "tandem-request-v1"
HELLO_DOMAIN = "tandem-hello-v2"

Query = Mapping[str, object] | Iterable[tuple[str, object]] | str | None
Role = Literal["caller", "callee"]

_NONCE = re.compile(r"[0-9a-f]{32}")
_SIGNATURE = re.compile(r"[0-9a-f]{64}")
_TIME = re.compile(r"[0-9]{1,16}")


class SignatureError(Exception):
    """A node-to-node request whose signature headers are missing, stale, replayed or wrong.

    Messages name the header or the check that failed; they never contain the token.
    """


def new_nonce() -> str:
    """A fresh 128-bit nonce, as 32 lower-case hex digits."""
    return secrets.token_hex(16)


def canonical_query(query: Query) -> str:
    """`k=v&...` with every key and value percent-encoded (UTF-8, nothing left unescaped
    but `A-Za-z0-9_.-~`) and the pairs sorted; repeated keys are kept.

    Takes a raw query string, a mapping (an aiohttp `request.query` multidict gives every
    pair) or `(key, value)` pairs; values are signed as `str(value)`.
    """
    if query is None:
        pairs: Iterable[tuple[str, object]] = ()
    elif isinstance(query, str):
        pairs = parse_qsl(query, keep_blank_values=True)
    elif isinstance(query, Mapping):
        pairs = query.items()
    else:
        pairs = query
    encoded = sorted((quote(str(k), safe=""), quote(str(v), safe="")) for k, v in pairs)
    return "&".join(f"{k}={v}" for k, v in encoded)


def sign(
    token: str,
    method: str,
    path: str,
    query: Query,
    body: bytes,
    caller: str,
    callee: str,
    now: float | None = None,
) -> dict[str, str]:
    """The headers that authenticate one request from `caller` to `callee`.

    `path` is the decoded path (as aiohttp's `request.path` sees it), `body` the exact bytes
    sent (b"" for none). The token itself is not among the headers.
    """
    _check_token(token)
    stamp = str(int(time.time() if now is None else now))
    nonce = new_nonce()
    mac = _request_mac(token, method, path, query, body, stamp, nonce, caller, callee)
    return {CALLER: caller, CALLEE: callee, TIME: stamp, NONCE: nonce, SIGNATURE: mac}


class Verifier:
    """Checks signed requests meant for `own_id`, remembering nonces to refuse replays.

    Nonces are kept in insertion order with their request's time and forgotten once that
    time is outside the window (a replay is then refused as stale) or when more than
    `max_nonces` are held. Either way `floor` rises to the forgotten request's time, and
    requests at or before `floor` are refused, so forgetting never reopens a replay: it
    fails closed (only a flood of valid requests, or a clock stepped back, gets there).
    One verifier per node, used from its event loop.
    """

    def __init__(
        self, token: str, own_id: str, window_s: int = WINDOW_S, max_nonces: int = MAX_NONCES
    ) -> None:
        _check_token(token)
        if window_s < 0 or max_nonces < 1:
            raise ValueError("window_s must be >= 0 and max_nonces >= 1")
        self._token = token
        self.own_id = own_id
        self.window_s = window_s
        self.max_nonces = max_nonces
        self.floor = -1  # requests at or before this unix second are refused
        self._seen: OrderedDict[str, int] = OrderedDict()  # nonce → request time

    def __repr__(self) -> str:  # never the token
        return f"Verifier(own_id={self.own_id!r}, window_s={self.window_s}, held={len(self)})"

    def __len__(self) -> int:
        return len(self._seen)

    def check_head(
        self, headers: Mapping[str, str], now: float | None = None
    ) -> tuple[str, str, str, str]:
        """What can be checked of a signed request before its body is read: the headers'
        format, that it is signed for this node, and that it is fresh; (caller, time, nonce,
        signature), else SignatureError. A request that fails here has its body never read."""
        now = time.time() if now is None else now
        got = _signed_headers(headers)
        caller, callee, stamp, nonce, mac = (got[h.lower()] for h in SIGNED_HEADERS)
        if not caller or len(caller) > MAX_ID_CHARS:
            raise SignatureError(f"{CALLER} must be a node id of 1 to {MAX_ID_CHARS} characters")
        if not _TIME.fullmatch(stamp):
            raise SignatureError(f"{TIME} must be unix seconds (decimal digits)")
        if not _NONCE.fullmatch(nonce):
            raise SignatureError(f"{NONCE} must be 32 lower-case hex digits")
        if not _SIGNATURE.fullmatch(mac):
            raise SignatureError(f"{SIGNATURE} must be 64 lower-case hex digits")
        if not hmac.compare_digest(utf8(callee), utf8(self.own_id)):
            raise SignatureError(
                # the header is not quoted back: no header value reaches a reply or a log
                f"the request is signed for node {CALLEE}, not for this one ({self.own_id!r})"
            )
        t = int(stamp)
        if abs(now - t) > self.window_s:
            raise SignatureError(
                f"{TIME} is {now - t:+.0f} s from this node's clock, outside ±{self.window_s} s "
                "(are both clocks set?)"
            )
        return caller, stamp, nonce, mac

    def verify(
        self,
        method: str,
        path: str,
        query: Query,
        body: bytes,
        headers: Mapping[str, str],
        now: float | None = None,
    ) -> str:
        """The caller's id if the request is signed for this node, fresh and new; else
        SignatureError. `headers` may be any mapping (case-insensitive lookup)."""
        now = time.time() if now is None else now
        caller, stamp, nonce, mac = self.check_head(headers, now)
        t = int(stamp)
        # the callee is own_id here, not the header: a rewritten header cannot verify
        want = _request_mac(
            self._token, method, path, query, body, stamp, nonce, caller, self.own_id
        )
        if not hmac.compare_digest(want.encode(), mac.encode()):
            raise SignatureError(
                "the signature does not verify: a different token, or the method, path, "
                "query, body, time, nonce or caller changed on the way"
            )
        # only signed requests reach the nonce memory, so nobody without the token can fill it
        self._forget(now)
        if t <= self.floor:
            raise SignatureError(
                f"{TIME} is no later than a request this node has already forgotten, so a "
                "replay cannot be ruled out: send it again with a fresh signature"
            )
        if nonce in self._seen:
            raise SignatureError(f"{NONCE} was already used: a replayed request")
        self._seen[nonce] = t
        if len(self._seen) > self.max_nonces:
            _, oldest = self._seen.popitem(last=False)
            self.floor = max(self.floor, oldest)
        return caller

    def _forget(self, now: float) -> None:
        # from the oldest insertion on; an expired entry behind a fresh one waits its turn
        while self._seen:
            nonce, t = next(iter(self._seen.items()))
            if now - t <= self.window_s:
                return
            del self._seen[nonce]
            self.floor = max(self.floor, t)


def hello_proof(
    token: str,
    role: Role,
    caller_nonce: str,
    callee_nonce: str,
    caller_id: str,
    callee_id: str,
    model_fingerprint: str,
    cert_fingerprint: str,
    address: str = "",
) -> str:
    """Hex HMAC proving the token in a hello between `caller_id` and `callee_id`.

    `role` is who proves: the callee answers the caller's challenge with role "callee", the
    caller then proves with role "caller"; each proof covers both nonces, so neither side's
    proof can be replayed as the other's. `cert_fingerprint` is the callee's TLS
    certificate fingerprint ("" on plain-HTTP loopback); `address` is, on plain HTTP only,
    the callee's socket address as `hello.channel_address` writes it ("" over TLS,
    where the certificate names the channel and addresses may be translated on the way).
    """
    _check_token(token)
    if role not in ("caller", "callee"):
        raise ValueError(f"role must be 'caller' or 'callee', not {role!r}")
    msg = fields(
        HELLO_DOMAIN,
        role,
        caller_nonce,
        callee_nonce,
        caller_id,
        callee_id,
        model_fingerprint,
        cert_fingerprint,
        address,
    )
    return hmac.new(token.encode(), msg, sha256).hexdigest()


def verify_hello_proof(token: str, role: Role, *, proof: object, **hello: str) -> bool:
    """Whether `proof` is `hello_proof(token, role, **hello)` (constant time); `hello` names
    `hello_proof`'s fields (caller_nonce, callee_nonce, caller_id, callee_id,
    model_fingerprint, cert_fingerprint, and address where there is one)."""
    if not isinstance(proof, str):
        return False
    want = hello_proof(token, role, **hello)
    return hmac.compare_digest(want.encode(), utf8(proof))


def _request_mac(
    token: str,
    method: str,
    path: str,
    query: Query,
    body: bytes,
    stamp: str,
    nonce: str,
    caller: str,
    callee: str,
) -> str:
    msg = fields(
        REQUEST_DOMAIN,
        method.upper(),
        path,
        canonical_query(query),
        stamp,
        nonce,
        sha256(body).hexdigest(),
        caller,
        callee,
    )
    return hmac.new(token.encode(), msg, sha256).hexdigest()


def fields(*parts: str) -> bytes:
    """Each part as its UTF-8 byte count (u64, big-endian) then the bytes: unambiguous."""
    out = bytearray()
    for part in parts:
        b = utf8(part)
        out += len(b).to_bytes(8, "big")
        out += b
    return bytes(out)


def utf8(s: str) -> bytes:
    # surrogatepass: a header decoded oddly still encodes (injectively) instead of raising
    return s.encode("utf-8", "surrogatepass")


def _signed_headers(headers: Mapping[str, str]) -> dict[str, str]:
    wanted = {h.lower() for h in SIGNED_HEADERS}
    got: dict[str, str] = {}
    for k, v in headers.items():
        key = k.lower()
        if key in wanted:
            if key in got:  # a proxy may read the first copy and us the last: refuse both
                raise SignatureError(f"header {k} is given more than once")
            got[key] = v
    missing = [h for h in SIGNED_HEADERS if h.lower() not in got]
    if missing:
        raise SignatureError(
            f"missing header{'s' if len(missing) > 1 else ''} {', '.join(missing)}"
        )
    return got


def _check_token(token: str) -> None:
    if not token:
        raise ValueError("signing needs a cluster token")
