"""The safetensors container: parse a header without reading data, and write one byte-exactly.

Layout: u64 little-endian header length, a JSON header, then the tensors' raw bytes.
Header entries are `name: {"dtype", "shape", "data_offsets": [begin, end]}` (offsets relative
to the end of the header) plus an optional `"__metadata__": {str: str}`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

ITEMSIZE: dict[str, int] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U32": 4,  # MLX quantized weights: packed words
    "U8": 1,
    "BOOL": 1,
}
MAX_HEADER_BYTES = 100 * 1024 * 1024


class SafetensorsError(ValueError):
    """A header that does not describe a valid safetensors file."""


@dataclass(frozen=True)
class RawTensor:
    """One tensor to write: dtype name (safetensors spelling), shape, row-major bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes | memoryview


@dataclass(frozen=True)
class HeaderEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offset from the start of the data section
    end: int


def float_bytes(a: np.ndarray, dtype: str) -> tuple[str, bytes]:
    """Float values as (safetensors dtype, bytes) in `dtype`: "float32", "float16" or
    "bfloat16" (round to nearest even on the upper 16 bits of the float32 pattern)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    if dtype == "float32":
        return "F32", a.tobytes()
    if dtype == "float16":
        return "F16", a.astype(np.float16).tobytes()
    if dtype != "bfloat16":
        raise ValueError(f"unsupported float dtype {dtype!r}")
    u = a.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return "BF16", u.astype(np.uint16).tobytes()


def nbytes_of(dtype: str, shape: tuple[int, ...]) -> int:
    n = ITEMSIZE[dtype]
    for d in shape:
        n *= d
    return n


def parse_header(buf: bytes) -> tuple[dict[str, HeaderEntry], dict[str, str], int]:
    """Parse the header at the start of `buf`.

    Returns (entries, metadata, data_start) where data_start is the absolute offset of the
    data section. Raises SafetensorsError on anything malformed.
    """
    if len(buf) < 8:
        raise SafetensorsError("file shorter than the 8-byte header length")
    (n,) = struct.unpack_from("<Q", buf, 0)
    if n > MAX_HEADER_BYTES or 8 + n > len(buf):
        raise SafetensorsError(f"header length {n} runs past the end of the file")
    try:
        header = json.loads(bytes(buf[8 : 8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError("header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    entries: dict[str, HeaderEntry] = {}
    for name, info in header.items():
        try:
            dtype = str(info["dtype"])
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"tensor {name!r} has a malformed entry") from None
        if dtype not in ITEMSIZE:
            raise SafetensorsError(f"tensor {name!r} has unsupported dtype {dtype}")
        if begin < 0 or end - begin != nbytes_of(dtype, shape):
            raise SafetensorsError(f"tensor {name!r}: data_offsets do not match dtype and shape")
        entries[name] = HeaderEntry(name, dtype, shape, begin, end)
    return entries, {str(k): str(v) for k, v in metadata.items()}, 8 + n


def read_header(f: BinaryIO) -> tuple[dict[str, HeaderEntry], dict[str, str], int]:
    """Read and parse the header of an open file (reads only the header bytes)."""
    head = f.read(8)
    if len(head) < 8:
        raise SafetensorsError("file shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_BYTES:
        raise SafetensorsError(f"header length {n} is implausible")
    body = f.read(n)
    if len(body) < n:
        raise SafetensorsError(f"header length {n} runs past the end of the file")
    return parse_header(head + body)


def encode(tensors: Mapping[str, RawTensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """Serialize tensors in the given order. Same input, same bytes."""
    return b"".join(encode_parts(tensors, metadata))


def encode_parts(
    tensors: Mapping[str, RawTensor], metadata: Mapping[str, str] | None = None
) -> list[bytes | memoryview]:
    """`encode`'s bytes as its parts, without copying: the header, then each tensor's data."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, t in tensors.items():
        n = nbytes_of(t.dtype, t.shape)
        if len(t.data) != n:
            raise SafetensorsError(f"tensor {name!r}: {len(t.data)} bytes for {t.dtype}{t.shape}")
        header[name] = {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data section 8-byte aligned
    parts: list[bytes | memoryview] = [struct.pack("<Q", len(raw)) + raw]
    parts.extend(memoryview(t.data) for t in tensors.values())
    return parts
