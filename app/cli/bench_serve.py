"""`tandem bench serve --model M --concurrency N`: many chats at once on a decode node (local
prefill), beside `mlx_lm.server` on the same model, measured side by side in one run.

Each repeat sends, to each server in turn: one chat alone, then N chats at once (streamed,
fresh prompts each time so that no prompt cache helps, the eos token biased away so that
every reply runs to `--max-tokens`). Reported, medians over `--repeat`:
- `first_tokens_s`: when each of the N replies' first token came, from the moment they were
  sent, in order; `last_first_token_s` the latest, against mlx_lm.server's
  (`last_first_token_ratio`) and against `wave_bound_s`: the N prompts' lone prefills plus one
  decode step (no reply waits for another's generation), each prompt's lone prefill the lone
  chat's time to first token scaled by its prompt tokens (the passages differ in length:
  N times the lone chat's was low by the wave's longer prompts);
- `aggregate_tok_s`: every reply's tokens over the time from sending to the last reply's end,
  against mlx_lm.server's (`aggregate_ratio`);
- `lone_ttft_s`, `lone_tok_s` (decode rate after the first token): one chat alone, against
  mlx_lm.server's (`lone_ttft_ratio`, `lone_rate_ratio`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from tandem.app.cli.args import add_model_arguments, model_path
from tandem.app.cli.demo import free_port

ROOT = Path(__file__).resolve().parents[2]  # the checkout: app/cli/bench_serve.py
READY_S = 300.0  # a server loads its model within this


@dataclass(frozen=True)
class Timing:
    """One streamed chat: seconds from sending to its first token and to its end, the
    tokens it generated and its prompt's."""

    first_s: float
    end_s: float
    tokens: int
    prompt_tokens: int = 0


@dataclass(frozen=True)
class Server:
    name: str
    url: str
    token: str | None


async def _chat(session: aiohttp.ClientSession, server: Server, prompt: str, body: dict) -> Timing:
    headers = {"Authorization": f"Bearer {server.token}"} if server.token else {}
    request = {**body, "messages": [{"role": "user", "content": prompt}], "stream": True,
               "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    first, tokens, prompt_tokens = None, 0, 0
    url = f"{server.url}/v1/chat/completions"
    async with session.post(url, json=request, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"{server.name} answered HTTP {r.status}: {await r.text()}")
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            choices = chunk.get("choices") or []
            if first is None and choices and (choices[0].get("delta") or {}).get("content"):
                first = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
                prompt_tokens = int(chunk["usage"].get("prompt_tokens") or 0)
    end = time.perf_counter() - t0
    return Timing(first if first is not None else end, end, tokens, prompt_tokens)


async def _round(
    server: Server, prompts: list[str], body: dict
) -> tuple[Timing, list[Timing], float]:
    """One chat alone, then the rest at once: (the lone one, the wave's, the wave's wall)."""
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        lone = await _chat(session, server, prompts[0], body)
        t0 = time.perf_counter()
        wave = await asyncio.gather(*(_chat(session, server, p, body) for p in prompts[1:]))
        return lone, list(wave), time.perf_counter() - t0


async def _ready(server: Server, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + READY_S
    headers = {"Authorization": f"Bearer {server.token}"} if server.token else {}
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{server.name} exited with {proc.returncode}")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with session.get(f"{server.url}/v1/models", headers=headers) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.5)
    raise TimeoutError(f"{server.name} did not answer within {READY_S:.0f} s")


@contextlib.contextmanager
def _servers(
    model: Path, concurrency: int, tmp: Path
) -> Iterator[list[tuple[Server, subprocess.Popen[bytes]]]]:
    """A tandem decode node (local prefill) and mlx_lm.server, each on its own port."""
    token = secrets.token_urlsafe(24)
    (tmp / "token").write_text(token)
    (tmp / "token").chmod(0o600)
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp / "config")}
    env.pop("TANDEM_TOKEN", None)
    t_port, m_port = free_port(), free_port()
    commands = {
        "tandem": [sys.executable, "-m", "tandem.app", "node", "--role", "decode", "--model",
                   str(model), "--port", str(t_port), "--no-mdns", "--remote-prefill", "never",
                   "--token-file", str(tmp / "token"), "--max-concurrent", str(concurrency)],
        "mlx_lm.server": [sys.executable, "-m", "mlx_lm", "server", "--model", str(model),
                          "--port", str(m_port), "--decode-concurrency", str(concurrency),
                          "--prompt-concurrency", str(concurrency)],
    }  # fmt: skip
    procs = {}
    try:
        for name, cmd in commands.items():
            log = (tmp / f"{name}.log").open("wb")
            with log:
                procs[name] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log,
                                               stderr=subprocess.STDOUT)  # fmt: skip
        yield [
            (Server("tandem", f"http://127.0.0.1:{t_port}", token), procs["tandem"]),
            (Server("mlx_lm.server", f"http://127.0.0.1:{m_port}", None), procs["mlx_lm.server"]),
        ]
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def _prompts(corpus: str, count: int, offset: int) -> list[str]:
    """`count` different questions about different passages (no prompt cache helps)."""
    words = corpus.split()
    return [
        "In one paragraph, what does this passage say?\n\n"
        + " ".join(words[(offset + i) * 37 % max(1, len(words) - 120) :][:120])
        for i in range(count)
    ]


async def bench_serve(
    model: Path, concurrency: int, max_tokens: int, repeat: int, eos: Sequence[int]
) -> dict[str, object]:
    corpus = (ROOT / "assets" / "corpus.txt").read_text()
    body = {"max_tokens": max_tokens, "temperature": 0,
            "logit_bias": {str(t): -100 for t in eos}}  # fmt: skip
    rounds: dict[str, list[tuple[Timing, list[Timing], float]]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="tandem-serve-") as tmp,
        _servers(model, concurrency, Path(tmp)) as servers,
    ):
        for server, proc in servers:
            await _ready(server, proc)
            await _round(server, _prompts(corpus, 2, 1000), {**body, "max_tokens": 2})  # warm
        for r in range(repeat):
            prompts = _prompts(corpus, concurrency + 1, r * (concurrency + 1))
            for server, _ in servers:  # the same prompts, one server after the other
                rounds.setdefault(server.name, []).append(await _round(server, prompts, body))
    return _result(rounds, concurrency, max_tokens, repeat)


def _summary(runs: list[tuple[Timing, list[Timing], float]]) -> dict[str, object]:
    med = statistics.median
    firsts = [sorted(t.first_s for t in wave) for _, wave, _ in runs]
    lone_rates = [
        (lone.tokens - 1) / (lone.end_s - lone.first_s) for lone, _, _ in runs if lone.tokens > 1
    ]
    return {
        "first_tokens_s": [med(f[i] for f in firsts) for i in range(len(firsts[0]))],
        "last_first_token_s": med(f[-1] for f in firsts),
        "aggregate_tok_s": med(sum(t.tokens for t in wave) / wall for _, wave, wall in runs),
        "lone_ttft_s": med(lone.first_s for lone, _, _ in runs),
        "lone_tok_s": med(lone_rates) if lone_rates else 0.0,
    }


def _lone_prefills(lone: Timing, wave: list[Timing]) -> float:
    """The wave's prompts prefilled one after another, as long as the lone chat's took per
    prompt token (N times the lone chat's where a server gives no token counts)."""
    if not lone.prompt_tokens or not all(t.prompt_tokens for t in wave):
        return len(wave) * lone.first_s
    return lone.first_s * sum(t.prompt_tokens for t in wave) / lone.prompt_tokens


def _result(
    rounds: dict[str, list[tuple[Timing, list[Timing], float]]],
    concurrency: int,
    max_tokens: int,
    repeat: int,
) -> dict[str, object]:
    ours, theirs = _summary(rounds["tandem"]), _summary(rounds["mlx_lm.server"])
    step = 1 / ours["lone_tok_s"] if ours["lone_tok_s"] else 0.0  # type: ignore[operator]
    bound = statistics.median(_lone_prefills(lone, wave) for lone, wave, _ in rounds["tandem"])
    bound += step

    def ratio(key: str) -> float:
        return ours[key] / theirs[key] if theirs[key] else float("inf")  # type: ignore[operator]

    return {
        "concurrency": concurrency, "max_tokens": max_tokens, "repeat": repeat,
        "tandem": ours, "mlx_lm_server": theirs, "wave_bound_s": bound,
        "within_wave_bound": ours["last_first_token_s"] <= bound,  # type: ignore[operator]
        "last_first_token_ratio": ratio("last_first_token_s"),
        "aggregate_ratio": ratio("aggregate_tok_s"),
        "lone_ttft_ratio": ratio("lone_ttft_s"), "lone_rate_ratio": ratio("lone_tok_s"),
    }  # fmt: skip


def table(r: dict[str, object]) -> str:
    rows = [f"{r['concurrency']} chats at once, {r['max_tokens']} tokens each, "
            f"medians of {r['repeat']}"]  # fmt: skip
    for name in ("tandem", "mlx_lm_server"):
        s: dict = r[name]  # type: ignore[assignment]
        firsts = ", ".join(f"{x:.2f}" for x in s["first_tokens_s"])
        rows.append(
            f"{name:>14}: first tokens {firsts} s; {s['aggregate_tok_s']:.1f} tok/s in all; "
            f"alone: first token {s['lone_ttft_s']:.2f} s, {s['lone_tok_s']:.1f} tok/s"
        )
    rows.append(
        f"ratios (tandem / mlx_lm.server): last first token {r['last_first_token_ratio']:.2f}, "
        f"aggregate {r['aggregate_ratio']:.2f}, lone ttft {r['lone_ttft_ratio']:.2f}, lone rate "
        f"{r['lone_rate_ratio']:.2f}; last first token within the prompts' lone prefills + a step "
        f"({r['wave_bound_s']:.2f} s): {r['within_wave_bound']}"
    )
    return "\n".join(rows)


def _eos(model: Path) -> list[int]:
    """The model's eos ids from its config files (app/ does not import mlx or transformers)."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        with contextlib.suppress(OSError, ValueError):
            value = json.loads((model / name).read_text()).get("eos_token_id")
            ids += value if isinstance(value, list) else [value] if value is not None else []
    return sorted({int(i) for i in ids})


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tandem bench serve", description=__doc__.split("\n")[0])
    add_model_arguments(p)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.concurrency < 1 or a.repeat < 1 or a.max_tokens < 2:
        p.error("--concurrency and --repeat must be at least 1, --max-tokens at least 2")
    a.model = model_path(a.model, a.models_dir)
    try:
        result = asyncio.run(
            bench_serve(a.model, a.concurrency, a.max_tokens, a.repeat, _eos(a.model))
        )
    except (RuntimeError, TimeoutError, aiohttp.ClientError) as e:
        print(f"tandem bench serve: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result) if a.json else table(result))
    return 0
