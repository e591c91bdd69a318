"""A trusted prefill node that misbehaves on purpose, run as its own process:

    python -m tests.bad_prefill --model DIR --token-file F --port N

It answers `/health` and the hello as a real prefill node does (it proves the token), and
`/v1/prefill` with frames crafted to disagree with the model, 503s with a useless
`Retry-After`, or a freeze. The test sets the mode with `POST /control {"mode": M}` and reads
back what reached `/v1/prefill` with `GET /control`. The router's calibration probes
(`probe-…` ids) always get a well-formed stream, so the decode node keeps trusting it.

A freeze is a real one: the process stops itself (SIGSTOP), so its `/health` stops answering
too, until the test sends SIGCONT.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from aiohttp import web
from tandem.nodes.contract.frames import PROTO, FrameWriter, Header
from tandem.nodes.model import fingerprint, load_index
from tandem.nodes.model.spec import ModelSpec
from tandem.nodes.trust.hello import HelloResponder

from tests.trust_support import add_hello_routes

log = logging.getLogger(__name__)
FRAME_MODES = ("good", "count_more", "count_less", "heads", "head_dim", "f16", "nan", "inf",
               "quantized_cut", "nan_then_slow")  # fmt: skip
SLOW_S = 10.0  # "nan_then_slow": layer 0 has NaN K, the next comes after this long
RETRY_MODES = {"503_zero": "0", "503_nan": "nan"}  # mode → Retry-After
FREEZE_MODES = ("freeze", "stall")  # stop before sending anything / after header and layer 0
MODES = (*FRAME_MODES, *RETRY_MODES, *FREEZE_MODES)
NODE_ID = "bad-prefill"


@dataclass
class Control:
    spec: ModelSpec
    fingerprint: str
    token: str
    mode: str = "good"
    prefills: list[dict[str, object]] = field(default_factory=list)  # {request_id, t, tokens}


CONTROL = web.AppKey("control", Control)


def frame_header(mode: str, control: Control, request_id: str, start: int, n: int) -> Header:
    """The header a stream in `mode` claims, for positions start..start+n-1 asked for."""
    spec = control.spec
    h = Header(PROTO, control.fingerprint, request_id, "F32", spec.num_layers, start, n,
               spec.num_kv_heads, spec.head_dim)  # fmt: skip
    if mode == "count_more":
        return dataclasses.replace(h, count=n + 5)
    if mode == "count_less":
        return dataclasses.replace(h, count=max(n // 2, 1) if n > 1 else 0)
    if mode == "heads":
        return dataclasses.replace(h, n_kv_heads=spec.num_kv_heads + 1)
    if mode == "head_dim":
        return dataclasses.replace(h, head_dim=spec.head_dim * 2)
    if mode == "f16":
        return dataclasses.replace(h, dtype="F16")
    return h


def layer_values(mode: str, h: Header, rng: np.random.Generator) -> bytes:
    """K or V bytes of one layer: random values (a wrong cache shows in the text), or
    non-finite ones."""
    dtype = np.float16 if h.dtype == "F16" else np.float32
    values = rng.standard_normal(h.shape(0)).astype(dtype)
    if mode in ("nan", "inf"):
        values.flat[:: max(values.size // 7, 1)] = np.nan if mode == "nan" else np.inf
    return values.tobytes()


async def health(request: web.Request) -> web.Response:
    c = request.app[CONTROL]
    model = {"name": c.spec.name, "fingerprint": c.fingerprint, "layers": c.spec.num_layers}
    return web.json_response(
        {"status": "ok", "id": NODE_ID, "name": NODE_ID, "roles": ["prefill"], "proto": PROTO,
         "version": "0", "device": "cpu", "mem_bytes": 0, "budget_bytes": 0, "model": model}
    )  # fmt: skip


async def control(request: web.Request) -> web.Response:
    c = request.app[CONTROL]
    if request.method == "POST":
        mode = (await request.json())["mode"]
        if mode not in MODES:
            return web.json_response({"error": f"mode must be one of {MODES}"}, status=400)
        c.mode, c.prefills = mode, []
    return web.json_response({"mode": c.mode, "prefills": c.prefills})


async def prefill(request: web.Request) -> web.StreamResponse:
    c = request.app[CONTROL]
    body = await request.json()
    rid, start, tokens = body["request_id"], body["start"], body["tokens"]
    mode = "good" if rid.startswith("probe-") else c.mode
    if not rid.startswith("probe-"):
        c.prefills.append({"request_id": rid, "t": time.time(), "tokens": len(tokens)})
    if mode in RETRY_MODES:
        headers = {"Retry-After": RETRY_MODES[mode]}
        error = {"error": {"message": "busy", "type": "busy", "code": "busy"}}
        return web.json_response(error, status=503, headers=headers)
    resp = web.StreamResponse(headers={"Content-Type": "application/x-tandem-kv"})
    if mode == "freeze":  # the connection is accepted, not one byte comes back
        _freeze()
        request.transport.close()  # type: ignore[union-attr]  # after SIGCONT: hang up
        return resp
    await resp.prepare(request)
    h = frame_header(mode, c, rid, start, len(tokens) - start)
    if mode == "quantized_cut":  # two well-formed quantized layers, then the line drops
        await _quantized_cut(request, resp, h, body)
        return resp
    writer = FrameWriter(h)
    rng = np.random.default_rng(len(tokens))
    await resp.write(writer.start())
    for layer in range(h.layers):
        own = "nan" if mode == "nan_then_slow" and layer == 0 else mode
        await resp.write(writer.layer(layer, layer_values(own, h, rng), layer_values(mode, h, rng)))
        if mode == "nan_then_slow":  # a real node computing a long prompt's next layers
            await asyncio.sleep(SLOW_S)
        if mode == "stall":
            _freeze()
            request.transport.close()  # type: ignore[union-attr]
            return resp
    await resp.write(writer.done())
    return resp


async def _quantized_cut(
    request: web.Request, resp: web.StreamResponse, h: Header, body: dict
) -> None:
    """Layers 0 and 1 in the asked-for quantized format (random K and V, quantized as a
    prefill node does), then a hang-up: the decode node holds two layers it must let go."""
    import torch
    from tandem.nodes.contract.http import KVFormat
    from tandem.nodes.prefill.handover import quantized_parts

    h = dataclasses.replace(h, kv_bits=body["kv_bits"], kv_group_size=body["kv_group_size"])
    writer = FrameWriter(h)
    await resp.write(writer.start())
    g = torch.Generator().manual_seed(h.count)
    for layer in range(2):
        k, v = torch.randn(h.shape(0), generator=g), torch.randn(h.shape(0), generator=g)
        parts = quantized_parts(k, v, KVFormat(h.kv_bits, h.kv_group_size))
        named = {n: t.contiguous().numpy().tobytes() for n, t in parts.items()}
        await resp.write(writer.layer(layer, named.pop("k"), named.pop("v"), named))
    request.transport.close()  # type: ignore[union-attr]


def _freeze() -> None:
    """Stop this whole process (as a hung machine would) until someone sends SIGCONT."""
    log.info("freezing")
    os.kill(os.getpid(), signal.SIGSTOP)


def create_app(model: Path, token: str) -> web.Application:
    index = load_index(model)
    app = web.Application()
    fp = fingerprint(index)
    app[CONTROL] = Control(index.spec, fp, token)
    app.router.add_get("/health", health)
    add_hello_routes(app, HelloResponder(token, NODE_ID, fp, ""))  # proves as a node does
    app.router.add_post("/v1/prefill", prefill)
    app.router.add_route("*", "/control", control)
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--token-file", type=Path, required=True)
    p.add_argument("--port", type=int, required=True)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    app = create_app(a.model, a.token_file.read_text().strip())
    web.run_app(app, host="127.0.0.1", port=a.port, access_log=None, shutdown_timeout=0.5)


if __name__ == "__main__":
    main()
