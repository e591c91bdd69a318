"""What nodes, the dashboard, benches and clients agree on (DESIGN.md "Contracts"), in one place:
the protocol version, the mDNS service type, the defaults, the error body, Server-Sent Events,
and how a request body is read. Stdlib only: every side imports it (a boundary test checks).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

# `/health`, `/v1/prefill` and KV frame headers; 2: quantized KV; 3: layer kinds, windows;
# 4: linear layers' state frames; 5: latent layers (multi-head latent attention)
PROTO: Final = 5
SERVICE_TYPE: Final = "_tandem._tcp.local."  # mDNS

DEFAULT_PORT: Final = 8470
DEFAULT_CHUNK_TOKENS: Final = 512  # prefill activations are bounded by chunks of this
DEFAULT_PREFILL_QUEUE: Final = 32  # prefills waiting on a prefill node before 503
DEFAULT_REMOTE_TIMEOUT_S: Final = 300.0  # a remote prefill, before the local fallback
# a prefill whose reader takes none of a frame's bytes for this long loses its stream (s)
DEFAULT_STALL_TIMEOUT_S: Final = 30.0
DEFAULT_MAX_CONCURRENT: Final = 8  # generations a decode node runs at once
DEFAULT_MAX_QUEUE: Final = 128  # generations waiting for a slot before 503
MAX_BODY_BYTES: Final = 2**20  # a request body: a 128k-token prompt is ~1 MB of ids
MAX_JSON_DEPTH: Final = 32  # nesting of a request body; no route needs more than 4

# why a peer is not trusted (`Peer.reason`, the dashboard's cluster panel)
Reason = Literal["unauthorized", "model_mismatch", "unreachable", "protocol_mismatch", "bad_reply"]

SSE_DONE: Final = b"data: [DONE]\n\n"

KV_BITS: Final = (8, 4)  # quantized KV on the wire (mlx affine, as QuantizedKVCache holds it)
KV_GROUP_SIZES: Final = (32, 64, 128)
DEFAULT_KV_GROUP_SIZE: Final = 64
KVKernel = Literal["cpu", "gpu"]  # whose mx.quantize rounding to match: mlx's CPU or Metal


@dataclass(frozen=True)
class KVFormat:
    """How K and V cross the wire: quantized to `bits` in groups of `group_size` values, with
    the rounding of the decode node's mlx device (`kernel`)."""

    bits: int
    group_size: int = DEFAULT_KV_GROUP_SIZE
    kernel: KVKernel = "cpu"

    def __post_init__(self) -> None:
        if type(self.bits) is not int or self.bits not in KV_BITS:
            raise ValueError(f"kv_bits must be one of {KV_BITS}")
        if type(self.group_size) is not int or self.group_size not in KV_GROUP_SIZES:
            raise ValueError(f"kv_group_size must be one of {KV_GROUP_SIZES}")
        if self.kernel not in ("cpu", "gpu"):
            raise ValueError("kv_kernel must be 'cpu' or 'gpu'")

    def bytes_per_token(self, layers: int, n_kv_heads: int, head_dim: int, itemsize: int) -> int:
        """K and V of one token over all layers: packed words plus scales and biases."""
        words = head_dim * self.bits // 8
        groups = 2 * (head_dim // self.group_size) * itemsize
        return 2 * layers * n_kv_heads * (words + groups)


def check_group_size(group_size: int, head_dim: int) -> None:
    """ValueError unless `group_size` divides `head_dim` (mx.quantize's rule on the last axis)."""
    if head_dim % group_size:
        fits = [g for g in KV_GROUP_SIZES if head_dim % g == 0]
        raise ValueError(
            f"kv_group_size {group_size} does not divide this model's head_dim {head_dim}"
            f" (group sizes that do: {', '.join(map(str, fits)) or 'none'})"
        )


def kv_format_of(obj: Any) -> KVFormat | None:
    """The KV format a request asks for: `{"kv_bits", "kv_group_size", "kv_kernel"}` (absent
    or 0/None/16 bits: full precision). ValueError for anything else."""
    if not isinstance(obj, dict):
        raise ValueError("expected an object")
    bits = obj.get("kv_bits")
    if bits is None or (type(bits) is int and bits in (0, 16)):
        if obj.get("kv_group_size") is not None:
            raise ValueError("kv_group_size needs kv_bits")
        return None
    group = obj.get("kv_group_size")
    return KVFormat(
        bits,
        DEFAULT_KV_GROUP_SIZE if group is None else group,
        obj.get("kv_kernel") or "cpu",
    )


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


class ApiError(Exception):
    """A request refused: its HTTP status, message, error code and extra headers (such as
    `Retry-After`). The one error type of the HTTP boundary, on both roles; the node's
    middleware answers it with `error_body`."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str = "invalid_request_error",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.code = status, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(str(self), self.code)


class ContractError(ApiError, ValueError):
    """A body that is not the contract's record it should be; the message says why.

    The error of every `from_json` in `nodes/contract/` and of the body reader: an `ApiError`
    (a node answers it with its `code` and `status`) and a `ValueError` (a client reading a
    node's reply takes it as a bad reply)."""

    def __init__(self, message: str, code: str = "bad_request", status: int = 400) -> None:
        super().__init__(status, message, code)


class BadBody(ContractError):
    """A request body that is not JSON the node can read; the message says why."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "bad_json")


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
