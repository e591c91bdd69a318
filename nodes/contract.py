"""What nodes, the dashboard, benches and clients agree on (DESIGN.md "Contracts"), in one place:
the protocol version, the mDNS service type, the defaults, the error body, Server-Sent Events,
and how a request body is read. Stdlib only: every side imports it (a boundary test checks).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Final, Literal

PROTO: Final = 1  # `/health` "proto", `/v1/prefill` "proto", KV frame headers
SERVICE_TYPE: Final = "_tandem._tcp.local."  # mDNS

DEFAULT_PORT: Final = 8470
DEFAULT_CHUNK_TOKENS: Final = 512  # prefill activations are bounded by chunks of this
DEFAULT_PREFILL_QUEUE: Final = 32  # prefills waiting on a prefill node before 503
DEFAULT_REMOTE_TIMEOUT_S: Final = 300.0  # a remote prefill, before the local fallback
DEFAULT_MAX_CONCURRENT: Final = 8  # generations a decode node runs at once
DEFAULT_MAX_QUEUE: Final = 128  # generations waiting for a slot before 503
MAX_BODY_BYTES: Final = 2**20  # a request body: a 128k-token prompt is ~1 MB of ids
MAX_JSON_DEPTH: Final = 32  # nesting of a request body; no route needs more than 4

# why a peer is not trusted (`Peer.reason`, the dashboard's cluster panel)
Reason = Literal["unauthorized", "model_mismatch", "unreachable", "protocol_mismatch", "bad_reply"]

SSE_DONE: Final = b"data: [DONE]\n\n"


class BadBody(ValueError):
    """A request body that is not JSON the node can read; the message says why."""


def read_json(raw: bytes) -> Any:
    """A request body as JSON: strict UTF-8, at most `MAX_JSON_DEPTH` deep, and no lone
    surrogate escape in any string (Python takes "\\ud800" but cannot encode it back)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadBody("body is not UTF-8") from None
    if _depth_of(text) > MAX_JSON_DEPTH:
        raise BadBody(f"body nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        raise BadBody("body is not valid JSON") from None
    for s in _strings(value):
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise BadBody("body holds a string with a lone surrogate") from None
    return value


def _depth_of(text: str) -> int:
    """The deepest bracket nesting outside strings (a scan: no recursion, no parse)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > MAX_JSON_DEPTH:
                    return deepest
        elif ch in "]}":
            depth -= 1
    return deepest


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON value, keys included (iteratively)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            yield v
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())


def error_body(message: str, code: str, kind: str | None = None) -> dict[str, Any]:
    """The one error body every route answers with (OpenAI's shape)."""
    return {"error": {"message": message, "type": kind or code, "param": None, "code": code}}


def sse_encode(obj: Any) -> bytes:
    """One Server-Sent Events record: `data: <json>` and a blank line."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_END: Final = object()  # what `sse_record` gives for `data: [DONE]`


def sse_record(line: bytes | str) -> Any:
    """The JSON of one SSE `data:` line; None for any other line (blank separators, `:`
    keep-alives) and for data that is not JSON; `SSE_END` for `data: [DONE]`."""
    text = (line.decode("utf-8", "replace") if isinstance(line, bytes) else line).strip()
    if not text.startswith("data:"):
        return None
    data = text[5:].strip()
    if data == "[DONE]":
        return SSE_END
    try:
        return json.loads(data)
    except ValueError:
        return None


def sse_decode(lines: Iterable[bytes | str]) -> Iterator[Any]:
    """The JSON records of an SSE stream's lines, up to `data: [DONE]`."""
    for line in lines:
        record = sse_record(line)
        if record is SSE_END:
            return
        if record is not None:
            yield record


@dataclass(frozen=True)
class Health:
    """`GET /health` (no auth, no secret): who a node is and what it runs."""

    id: str
    name: str
    roles: tuple[str, ...]
    proto: int
    version: str
    device: str
    mem_bytes: int
    budget_bytes: int
    model_name: str
    fingerprint: str
    layers: int

    def to_json(self) -> dict[str, Any]:
        return {
            "status": "ok", "id": self.id, "name": self.name, "roles": list(self.roles),
            "proto": self.proto, "version": self.version, "device": self.device,
            "mem_bytes": self.mem_bytes, "budget_bytes": self.budget_bytes,
            "model": {"name": self.model_name, "fingerprint": self.fingerprint,
                      "layers": self.layers},
        }  # fmt: skip

    @classmethod
    def from_json(cls, obj: Any) -> Health:
        """A peer's `/health` body; ValueError when it is not one."""
        if not isinstance(obj, dict) or not isinstance(obj.get("model", {}), dict):
            raise ValueError("/health is not a JSON object with a model object")
        model = obj.get("model") or {}
        roles = obj.get("roles") or ()
        if not isinstance(roles, list | tuple) or not all(isinstance(r, str) for r in roles):
            raise ValueError("/health roles is not a list of strings")
        try:
            return cls(
                id=str(obj.get("id", "")), name=str(obj.get("name", "")), roles=tuple(roles),
                proto=int(obj.get("proto") or 0), version=str(obj.get("version", "")),
                device=str(obj.get("device", "")), mem_bytes=int(obj.get("mem_bytes") or 0),
                budget_bytes=int(obj.get("budget_bytes") or 0),
                model_name=str(model.get("name", "")),
                fingerprint=str(model.get("fingerprint", "")),
                layers=int(model.get("layers") or 0),
            )  # fmt: skip
        except (TypeError, ValueError, OverflowError) as e:
            raise ValueError(f"/health holds a bad value ({e})") from None
