"""What the two request routes carry between nodes and clients: the `POST /v1/prefill`
request body, and the `tandem` object of a completion's reply (its last chunk when streamed).

Each record has one parser, `from_json`, which raises `ContractError` (with the error code
and status a node answers it with), and `to_json`, the exact wire shape. Stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from tandem.nodes.contract.http import PROTO, ContractError, KVFormat, kv_format_of

MAX_REQUEST_ID = 128  # characters of a prefill's request id kept (events and logs name it)


@dataclass(frozen=True)
class PrefillBody:
    """`POST /v1/prefill`: compute positions `start..len(tokens)-1` of `tokens` (the caller
    holds 0..start-1) for the model `fingerprint`, K and V on the wire in `kv_format` (None:
    the model's dtype). The proto is always `PROTO`: a body of another one does not parse."""

    fingerprint: str
    request_id: str
    tokens: list[int]
    start: int = 0
    kv_format: KVFormat | None = None

    @property
    def count(self) -> int:
        return len(self.tokens) - self.start

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "proto": PROTO,
            "fingerprint": self.fingerprint,
            "request_id": self.request_id,
            "tokens": self.tokens,
            "start": self.start,
        }
        if self.kv_format is not None:
            body |= {
                "kv_bits": self.kv_format.bits,
                "kv_group_size": self.kv_format.group_size,
                "kv_kernel": self.kv_format.kernel,
            }
        return body

    @classmethod
    def from_json(cls, obj: Any) -> PrefillBody:
        """A `/v1/prefill` body, checked in the order a node answers: the proto first (an
        old-proto peer learns that), then the fingerprint, the tokens and the KV format.
        What needs the model (the vocabulary, the context, `head_dim`) the node checks."""
        if not isinstance(obj, dict):
            raise ContractError("body must be a JSON object", "bad_request")
        proto = obj.get("proto")
        if type(proto) is not int or proto != PROTO:
            raise ContractError(f"proto must be {PROTO}", "protocol_mismatch")
        fingerprint = obj.get("fingerprint")
        if not isinstance(fingerprint, str):
            raise ContractError("model fingerprint does not match", "model_mismatch", 409)
        tokens, start = obj.get("tokens"), obj.get("start", 0)
        if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
            raise ContractError("tokens must be a list of ids in the vocabulary", "bad_tokens")
        if type(start) is not int or not 0 <= start < len(tokens):
            raise ContractError("start must satisfy 0 <= start < len(tokens)", "bad_tokens")
        try:
            kv_format = kv_format_of(obj)
        except ValueError as e:
            raise ContractError(str(e), "bad_kv_format") from None
        rid = obj.get("request_id")
        rid = rid if isinstance(rid, str) and rid else "prefill"
        return cls(fingerprint, rid[:MAX_REQUEST_ID], tokens, start, kv_format)


@dataclass(frozen=True)
class ReplyStats:
    """The `tandem` object of a completion's reply (DESIGN.md "HTTP"; CONTRACTS.md): where
    the prompt was prefilled, how long each part took, how the KV was held."""

    request_id: str = ""
    prefill: str = "local"  # "local" | "remote"
    prefill_node: str | None = None  # the prefill node's address when remote
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    kv_bytes: int = 0
    ttft_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    kv_dtype: str = ""  # how the KV was held: the model's dtype or e.g. "q8/g64"
    steady_tok_s: float | None = None  # wire `decode_tok_s`: the steady rate; None under 3
    cached_tokens: int = 0  # prompt positions the decode node's prompt cache held
    cache_fallback: bool = False  # its windows could not be cut back: an earlier exact point

    def to_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "prefill": self.prefill,
            "prefill_node": self.prefill_node,
            "prefill_tokens": self.prefill_tokens,
            "prefill_s": self.prefill_s,
            "kv_bytes": self.kv_bytes,
            "kv_dtype": self.kv_dtype,
            "ttft_s": self.ttft_s,
            "decode_tokens": self.decode_tokens,
            "decode_s": self.decode_s,
            "decode_tok_s": self.steady_tok_s,
            "cached_tokens": self.cached_tokens,
            "cache_fallback": self.cache_fallback,
        }

    @classmethod
    def from_json(cls, obj: Any) -> ReplyStats:
        """A reply's `tandem` object; ContractError when it is not one. Keys not known here
        are ignored; a key that is absent or null keeps its default."""
        if not isinstance(obj, dict):
            raise ContractError("the reply's tandem object is not a JSON object")
        values: dict[str, Any] = {}
        for f in fields(cls):
            value = obj.get("decode_tok_s" if f.name == "steady_tok_s" else f.name)
            if value is not None:
                values[f.name] = _typed(f.name, f.type, value)
        return cls(**values)

    @property
    def prefill_tok_s(self) -> float | None:
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else None

    @property
    def decode_tok_s(self) -> float | None:
        """Generated tokens over the whole decode time (the client's own measure; the node's
        steady rate is `steady_tok_s`)."""
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else None


def _typed(name: str, kind: object, value: Any) -> Any:
    """`value` as the field's type (`kind`, its annotation as a string); ContractError."""
    number = not isinstance(value, bool) and isinstance(value, int | float)
    if kind == "int" and type(value) is int:
        return value
    if kind in ("float", "float | None") and number:
        return float(value)
    if kind in ("str", "str | None") and isinstance(value, str):
        return value
    if kind == "bool" and isinstance(value, bool):
        return value
    raise ContractError(f"the reply's tandem {name} is not a {kind}")
