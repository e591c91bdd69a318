"""Reading a whole Server-Sent Events stream at once: what tests do with a finished reply
(nodes and clients read SSE a line at a time, with `sse_record`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from tandem.nodes.contract.http import SSE_END, sse_record


def sse_decode(lines: Iterable[bytes | str]) -> Iterator[Any]:
    """The JSON records of an SSE stream's lines, up to `data: [DONE]`."""
    for line in lines:
        record = sse_record(line)
        if record is SSE_END:
            return
        if record is not None:
            yield record
