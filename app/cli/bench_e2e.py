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
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import aiohttp
from tandem.app.cli.args import add_model_arguments, model_path
from tandem.app.cli.bare_stream import raw_transfer
from tandem.app.cli.demo import DemoCluster, DemoError
from tandem.nodes.contract.events import LinkEvent, event_from_json
from tandem.nodes.contract.http import sse_record
from tandem.nodes.model.index import load_index
from tandem.nodes.model.kv_bytes import kv_bytes
from tandem.nodes.model.spec import ModelSpec


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


def _mlx_reference(model: Path, tokens: int, max_tokens: int, kv_bits: int = 16) -> float:
    root = Path(__file__).resolve().parents[2]  # the checkout: app/cli/bench_e2e.py
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
            spec = load_index(model).spec  # a hybrid's config nests it (text_config)
            vocab = spec.vocab_size
            prompts = [  # a fresh prompt each run: no prompt-cache hits
                [rng.randrange(vocab) for _ in range(tokens)]
                for rng in map(random.Random, range(repeat + 2))
            ]
            runs, mlx_rates = await _runs(
                cluster, model, prompts[: repeat + 1], max_tokens, kv_bits
            )
            sizes = runs[-1][1] if runs else []
            raw = await raw_transfer(
                sizes, net_gbps, lambda: _completion(cluster, prompts[-1], max_tokens=1), tls
            )
        finally:
            cluster.stop()
    return _result(spec, tokens, kv_bits, tls, runs, mlx_rates, raw) | {
        "net_gbps": net_gbps,
        "tls": tls,
        "repeat": repeat,
    }


Run = tuple[dict, list[int], list[float]]  # a request's `tandem` stats, its KV frames' B and s


async def _runs(
    cluster: DemoCluster, model: Path, prompts: list[list[int]], max_tokens: int, kv_bits: int
) -> tuple[list[Run], list[float]]:
    """Each prompt through the cluster, the first only to warm both nodes up; after each of
    the others, mlx-lm alone at the same context (tokens/s)."""
    runs: list[Run] = []
    mlx_rates: list[float] = []
    for i, prompt in enumerate(prompts):
        extra = await _completion(cluster, prompt, max_tokens, kv_bits)
        sizes, seconds = await _net_in(cluster, extra["request_id"])
        if i:
            runs.append((extra, sizes, seconds))
            # mlx-lm alone, right after: both rates sample the machine's same minutes
            mlx = await asyncio.to_thread(_mlx_reference, model, len(prompt), max_tokens, kv_bits)
            mlx_rates.append(mlx)
    return runs, mlx_rates


def _result(
    spec: ModelSpec,
    tokens: int,
    kv_bits: int,
    tls: bool,
    runs: list[Run],
    mlx_rates: list[float],
    raw: dict[str, float],
) -> dict[str, object]:
    """The medians over the runs and their ratios to the bare transfer and to mlx-lm."""
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
    full = _full_kv_bytes(spec, tokens - 1)
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
    }


def _full_kv_bytes(spec: ModelSpec, positions: int) -> int:
    """K and V of `positions` tokens at 16 bits (bf16), were every layer full attention (a
    sliding or linear layer counted as a full one: the ratio shows what the kinds save)."""
    return kv_bytes(replace(spec, layer_kinds=()), itemsize=2).at(positions)


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
    add_model_arguments(p)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--net-gbps", type=float, default=None, help="cap the KV link (Gbit/s)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens decoded per run")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--kv-bits", type=int, choices=[16, 8, 4], default=16)
    p.add_argument("--tls", action="store_true", help="both nodes serve HTTPS (on loopback)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    a.model = model_path(a.model, a.models_dir)
    try:
        result = asyncio.run(
            bench_e2e(a.model, a.tokens, a.net_gbps, a.max_tokens, a.repeat, a.kv_bits, a.tls)
        )
    except (DemoError, RuntimeError, TimeoutError, aiohttp.ClientError) as e:
        print(f"tandem bench e2e: {e}", file=sys.stderr)
        return 2
    if a.json:  # strict JSON: a rate with nothing measured (inf, nan) is null
        clean = {k: v if not isinstance(v, float) or math.isfinite(v) else None
                 for k, v in result.items()}  # fmt: skip
        print(json.dumps(clean, allow_nan=False))
    else:
        print(table(result))
    return 0
