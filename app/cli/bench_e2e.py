"""`tandem bench e2e`: the whole handoff on loopback, measured side by side in one run.

Starts a prefill node and a decode node (`--remote-prefill always`), sends one prompt of
exactly N tokens, and reports:
- `ttft_remote_s` (request to first token) vs `prefill_s` (the remote prefill alone):
  `ttft_ratio` — how much the handoff adds on top of the prefill itself;
- `kv_Bps`, the KV frames' receive rate, vs `raw_Bps`, a bare transfer of the same frames
  (an aiohttp server's stream, read as the decode node reads one, `http_stream`) measured the
  same way: `kv_ratio`. Both are medians of per-frame rates, each the rate at which a frame's
  bytes arrived after its first read (`kv_link.arrival_seconds`); both go over sockets set up
  alike (`kv_link`), and both are taken under the same load: here both nodes share one
  machine, and KV frames cross loopback while the prefill's compute threads hold every core,
  so the bare transfer runs while the cluster serves one more remote prefill. `raw_idle_Bps`
  is the bare transfer on idle cores, for reference. With `--tls` the KV goes over TLS, and so
  does a second bare transfer, `raw_tls_Bps`: `kv_ratio` compares the KV with it (the same
  encryption), and `tls_floor_ratio` = `raw_tls_Bps` / `raw_Bps` is what TLS itself leaves of
  the plain rate on this machine (one core's decryption against a loopback memory copy);
- `decode_tok_s` after the handoff vs `mlx_decode_tok_s`, mlx-lm's own generation at the same
  context (in a separate process: app/ never imports mlx): `decode_ratio`. Both are steady-state
  rates taken the same way (tokens after the second over the second-to-last token's time), and
  both are medians of `--repeat` runs, interleaved: mlx-lm runs right after each request, while
  the cluster idles, so a busy spell on the machine weighs on both.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import queue
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import aiohttp
from aiohttp import web
from tandem.app.cli.demo import DemoCluster, DemoError
from tandem.nodes.contract.events import LinkEvent, event_from_json
from tandem.nodes.contract.http import sse_record
from tandem.nodes.serve import http_stream
from tandem.nodes.serve.kv_link import arrival_seconds, tune_sender
from tandem.nodes.serve.throttle import PacedSender
from tandem.nodes.trust import tls as tls_files


async def _completion(
    cluster: DemoCluster, tokens: list[int], max_tokens: int, kv_bits: int = 16
) -> dict:
    """Stream one completion; returns the last chunk's `tandem` object."""
    body = {"prompt": tokens, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "tandem": {"kv_bits": kv_bits}}  # fmt: skip
    headers = {"Authorization": f"Bearer {cluster.token}"}
    extra: dict = {}
    timeout = aiohttp.ClientTimeout(total=600)
    url = cluster.decode_url + "/v1/completions"
    async with (
        aiohttp.ClientSession(timeout=timeout) as s,
        s.post(url, json=body, headers=headers, ssl=cluster.ssl_for(url)) as r,
    ):
        r.raise_for_status()
        async for line in r.content:
            chunk = sse_record(line)
            if isinstance(chunk, dict):
                extra = chunk.get("tandem") or extra
    return extra


async def _net_in(cluster: DemoCluster, request_id: str) -> tuple[list[int], list[float]]:
    """Bytes and receive seconds of each KV frame of one request (the decode node's events)."""
    sizes: list[int] = []
    seconds: list[float] = []
    headers = {"Authorization": f"Bearer {cluster.token}"}

    async def read() -> None:
        url = f"{cluster.decode_url}/v1/events?since=0"
        ssl = cluster.ssl_for(url)
        async with aiohttp.ClientSession() as s, s.get(url, headers=headers, ssl=ssl) as r:
            async for line in r.content:
                event = event_from_json(sse_record(line))
                if isinstance(event, LinkEvent) and event.request_id == request_id:
                    sizes.append(event.bytes)
                    seconds.append(event.seconds)

    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(read(), 1.0)
    return sizes, seconds


@contextlib.contextmanager
def paced_server(
    bodies: Sequence[bytes],
    net_gbps: float | None,
    gap_s: float = 0.0,
    identity: tls_files.Identity | None = None,
) -> Iterator[str]:
    """An aiohttp server that streams `bodies` through the paced sender, `gap_s` apart (as KV
    frames come a layer's compute apart, each into an idle connection), to a GET or a POST;
    over TLS with `identity`'s certificate; yields its URL.

    It runs on a thread with its own event loop, as the prefill node is a process of its own:
    the sender's precise waits then hold up the sender, not the client timing it."""
    ready: queue.Queue[tuple[asyncio.AbstractEventLoop, asyncio.Event, int] | BaseException]
    ready = queue.Queue()

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        if request.transport is not None:
            tune_sender(request.transport.get_extra_info("socket"))  # as the prefill node's
        await resp.prepare(request)
        sender = PacedSender(net_gbps)  # the same emulated link as the prefill node's
        for i, body in enumerate(bodies):
            if i and gap_s:
                await asyncio.sleep(gap_s)
            await sender.send(resp, body)
        return resp

    async def serve() -> None:
        app = web.Application()
        app.router.add_get("/", handler)
        app.router.add_post("/", handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        ssl = tls_files.server_context(identity) if identity else None
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl)
            await site.start()
            stop = asyncio.Event()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            ready.put((asyncio.get_running_loop(), stop, port))
            await stop.wait()
        finally:
            await runner.cleanup()

    def run() -> None:
        try:
            asyncio.run(serve())
        except BaseException as e:  # surfaced to the caller below
            ready.put(e)

    thread = threading.Thread(target=run, name="paced-server", daemon=True)
    thread.start()
    got = ready.get(timeout=30)
    if isinstance(got, BaseException):
        raise RuntimeError(f"paced server failed: {got}") from got
    loop, stop, port = got
    try:
        yield f"{'https' if identity else 'http'}://127.0.0.1:{port}/"
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=30)


FRAME_GAP_S = 0.02  # between the plain transfer's frames: each starts on an idle connection


async def _frame_rates(url: str, sizes: list[int], pin: str | None = None) -> list[float]:
    """One bare transfer of frames of `sizes` bytes: bytes/s of each, read as the decode node
    reads its KV stream (`http_stream`, each frame into a buffer of its own size) and timed as
    KV frames are (`arrival_seconds`: from the read with a frame's first bytes to the one with
    its last)."""
    rates: list[float] = []
    buf = memoryview(bytearray(max(sizes, default=0)))
    async with http_stream.post(url, b"{}", {}, read_timeout_s=60, pin=pin) as r:
        for size in sizes:
            got, start, early, now = 0, 0.0, 0, 0.0
            while got < size:
                n = await r.read_into(buf[got:size])
                if not n:
                    raise RuntimeError(f"the bare transfer ended {size - got} bytes early")
                now = time.perf_counter()
                if not got:  # a frame's first bytes
                    start, early = now, n
                got += n
            seconds = arrival_seconds(size, now - start, size - early)
            if seconds > 0:
                rates.append(size / seconds)
    return rates


async def _raw_transfer(
    cluster: DemoCluster,
    sizes: list[int],
    net_gbps: float | None,
    load_prompt: list[int],
    tls: bool,
) -> dict[str, float]:
    """Bare streams of the same frames: bytes/s while the cluster serves one more remote
    prefill (the load the KV frames were sent under), plain (`raw_Bps`) and with `tls` also
    over TLS (`raw_tls_Bps`), taken in turns under that load; and plain with idle cores
    (`raw_idle_Bps`)."""
    frames = [bytes(n) for n in sizes]
    with contextlib.ExitStack() as stack:
        plain = stack.enter_context(paced_server(frames, net_gbps, FRAME_GAP_S))
        urls: dict[str, tuple[str, str | None]] = {"raw_Bps": (plain, None)}  # (url, pin)
        if tls:
            certs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tandem-e2e-")))
            identity = tls_files.load_or_create(certs, "bench")
            url = stack.enter_context(paced_server(frames, net_gbps, FRAME_GAP_S, identity))
            urls["raw_tls_Bps"] = (url, identity.fingerprint)
        idle = await _frame_rates(plain, sizes)
        load = asyncio.create_task(_completion(cluster, load_prompt, max_tokens=1))
        loaded: dict[str, list[float]] = {name: [] for name in urls}
        try:
            while not load.done() or not all(loaded.values()):
                for name, (url, pin) in urls.items():
                    loaded[name] += await _frame_rates(url, sizes, pin)
            await load
        finally:
            load.cancel()
            await asyncio.gather(load, return_exceptions=True)
    out = {name: statistics.median(rates or [math.inf]) for name, rates in loaded.items()}
    return out | {"raw_idle_Bps": statistics.median(idle or [math.inf])}


def _mlx_reference(model: Path, tokens: int, max_tokens: int, kv_bits: int = 16) -> float:
    root = Path(__file__).resolve().parents[1]
    args = [str(model), str(tokens), str(max_tokens)] + ([str(kv_bits)] if kv_bits < 16 else [])
    done = subprocess.run(
        [sys.executable, "-m", "tandem.nodes.decode.reference", *args],
        cwd=root, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"mlx reference failed: {done.stderr.strip()[-500:]}")
    return float(json.loads(done.stdout.strip().splitlines()[-1])["decode_tok_s"])


async def bench_e2e(
    model: Path,
    tokens: int,
    net_gbps: float | None,
    max_tokens: int,
    repeat: int,
    kv_bits: int = 16,
    tls: bool = False,
) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="tandem-e2e-") as tmp:
        cluster = DemoCluster(Path(tmp), secrets.token_urlsafe(24))
        try:
            net = ["--net-gbps", str(net_gbps)] if net_gbps else []
            cluster.start(model, link_gbps=None, budget=None, prefill_args=net, tls=tls)
            await cluster.wait_ready()
            vocab = json.loads((model / "config.json").read_text())["vocab_size"]
            prompts = [  # a fresh prompt each run: no prompt-cache hits
                [rng.randrange(vocab) for _ in range(tokens)]
                for rng in map(random.Random, range(repeat + 2))
            ]
            runs, mlx_rates = [], []
            for i in range(repeat + 1):  # the first run warms both nodes up
                extra = await _completion(cluster, prompts[i], max_tokens, kv_bits)
                sizes, seconds = await _net_in(cluster, extra["request_id"])
                if i:
                    runs.append((extra, sizes, seconds))
                    # mlx-lm alone, right after: both rates sample the machine's same minutes
                    mlx = await asyncio.to_thread(
                        _mlx_reference, model, tokens, max_tokens, kv_bits
                    )
                    mlx_rates.append(mlx)
            raw = await _raw_transfer(cluster, sizes, net_gbps, prompts[-1], tls)
        finally:
            cluster.stop()
    ttft = statistics.median(e["ttft_s"] for e, _, _ in runs)
    prefill_s = statistics.median(e["prefill_s"] for e, _, _ in runs)
    rates = [e["decode_tok_s"] for e, _, _ in runs if e.get("decode_tok_s")]
    if not rates:
        raise RuntimeError("no run decoded 3 tokens (an early end of sequence?): no decode rate")
    decode_tok_s = statistics.median(rates)
    kv_Bps = statistics.median(
        statistics.median(n / t for n, t in zip(z, s, strict=True) if t > 0) for _, z, s in runs
    )
    mlx_tok_s = statistics.median(mlx_rates)
    full = _full_kv_bytes(model, tokens - 1)
    return {
        "tokens": tokens,
        "kv_bits": kv_bits,
        "kv_dtype": runs[-1][0].get("kv_dtype"),
        "kv_wire_ratio": runs[-1][0]["kv_bytes"] / full,  # frames / K and V at 16 bits
        "ttft_remote_s": ttft,
        "prefill_s": prefill_s,
        "ttft_ratio": ttft / prefill_s,
        "kv_bytes": runs[-1][0]["kv_bytes"],
        "kv_Bps": kv_Bps,
        **raw,
        "kv_ratio": kv_Bps / raw["raw_tls_Bps" if tls else "raw_Bps"],
        **({"tls_floor_ratio": raw["raw_tls_Bps"] / raw["raw_Bps"]} if tls else {}),
        "decode_tok_s": decode_tok_s,
        "mlx_decode_tok_s": mlx_tok_s,
        "decode_ratio": decode_tok_s / mlx_tok_s,
        "net_gbps": net_gbps,
        "tls": tls,
        "repeat": repeat,
    }


def _full_kv_bytes(model: Path, positions: int) -> int:
    """K and V of `positions` tokens at 16 bits (bf16), from the model's config."""
    config = json.loads((model / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * 2 * positions


def table(r: dict[str, object]) -> str:
    mb = 1e6
    if r["tls"]:
        bare = f"bare TLS stream {r['raw_tls_Bps'] / mb:.0f} MB/s under the same load"
    else:
        bare = (
            f"bare stream {r['raw_Bps'] / mb:.0f} MB/s under the same load, "
            f"{r['raw_idle_Bps'] / mb:.0f} MB/s on idle cores"
        )
    lines = [
        f"tandem bench e2e — {r['tokens']} tokens, network "
        f"{r['net_gbps'] or 'unthrottled'} Gbit/s{' over TLS' if r['tls'] else ''}, "
        f"medians of {r['repeat']}",
        f"  time to first token  {r['ttft_remote_s']:.3f} s  (remote prefill "
        f"{r['prefill_s']:.3f} s; ratio {r['ttft_ratio']:.2f})",
        f"  KV handoff           {r['kv_bytes'] / mb:.1f} MB ({r['kv_dtype']}; "
        f"{r['kv_wire_ratio']:.3f} of bf16) at {r['kv_Bps'] / mb:.0f} MB/s  "
        f"({bare}; ratio {r['kv_ratio']:.2f})",
    ]
    if r["tls"]:
        lines.append(
            f"  TLS itself           bare TLS / bare plain {r['tls_floor_ratio']:.2f} "
            f"(plain {r['raw_Bps'] / mb:.0f} MB/s, on idle cores {r['raw_idle_Bps'] / mb:.0f} MB/s)"
        )
    lines.append(
        f"  decode               {r['decode_tok_s']:.1f} tok/s  (mlx-lm alone "
        f"{r['mlx_decode_tok_s']:.1f} tok/s; ratio {r['decode_ratio']:.2f})"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tandem bench e2e", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--net-gbps", type=float, default=None, help="cap the KV link (Gbit/s)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens decoded per run")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--kv-bits", type=int, choices=[16, 8, 4], default=16)
    p.add_argument("--tls", action="store_true", help="both nodes serve HTTPS (on loopback)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    try:
        result = asyncio.run(
            bench_e2e(a.model, a.tokens, a.net_gbps, a.max_tokens, a.repeat, a.kv_bits, a.tls)
        )
    except (DemoError, RuntimeError, TimeoutError, aiohttp.ClientError) as e:
        print(f"tandem bench e2e: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result) if a.json else table(result))
    return 0
