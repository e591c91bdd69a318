"""Issue 19 with real node processes on loopback: a relay and a takeover get nothing from a
decode node (neither the token nor a signature they could use), signed requests are refused
when replayed or tampered with, a restarted peer proves itself again before any request goes
to it, and `--host ""` is refused without a token."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from tandem.app.cli.pair import check, run_check
from tandem.nodes.contract.bodies import PrefillBody, ReplyStats
from tandem.nodes.contract.cluster import Peer
from tandem.nodes.trust.auth import CONFIRM_PATH, HELLO_PATH
from tandem.nodes.trust.hello import HelloResponder
from tandem.nodes.trust.signing import SIGNATURE, sign
from tandem.nodes.trust.tls import load_or_create

from tests.discovery_support import poll
from tests.nodeproc import NodeProc, start_node, unverified_tls, wait_healthy, wait_trusted
from tests.records import peer_at, stats_of
from tests.trust_support import Log, add_hello_routes, relay, serving

TOKEN = "trust-test-token-0123456789abcdef"
WATCH_S = 12.0  # how long an attacker is watched after it took a node's place


@pytest.fixture(scope="module")
def model(tiny_model: Any) -> Path:
    return tiny_model()


def impostor(health: dict[str, Any], log: Log) -> web.Application:
    """Takes a node's port after it died: serves a copy of its /health and answers hellos
    with the proof it can make (it holds no token)."""
    responder = HelloResponder(
        "impostor-has-no-token-000",
        health["id"],
        health["model"]["fingerprint"],
        health["cert_fingerprint"],
    )

    async def copy(request: web.Request) -> web.Response:
        return web.json_response(health)

    async def keep(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"error": {"message": "impostor"}}, status=500)

    app = web.Application(middlewares=[log.middleware()])
    app.router.add_get("/health", copy)
    add_hello_routes(app, responder)
    app.router.add_route("*", "/{tail:.*}", keep)
    return app


def chat(node: NodeProc, content: str = "who is there?") -> ReplyStats:
    """One chat completion's `tandem` stats (each new `content` needs a fresh prefill)."""
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 3}
    req = urllib.request.Request(node.url + "/v1/chat/completions", data=json.dumps(body).encode())
    req.add_header("Authorization", f"Bearer {TOKEN}")
    req.add_header("Content-Type", "application/json")
    context = unverified_tls() if node.tls else None
    with urllib.request.urlopen(req, timeout=60, context=context) as r:
        return stats_of(json.loads(r.read()))


def entry(node: NodeProc, address: str) -> Peer | None:
    return peer_at(node.cluster(), address)


Seen = list[tuple[float, Peer | None]]


async def watch(node: NodeProc, address: str, seconds: float) -> Seen:
    """`node`'s entry for `address` and when (seconds from now), every 0.2 s for `seconds`
    (off the event loop, which serves the test's attackers)."""

    def run() -> Seen:
        seen: Seen = []
        start = time.monotonic()
        while (now := time.monotonic()) < start + seconds:
            seen.append((now - start, entry(node, address)))
            time.sleep(0.2)
        return seen

    return await asyncio.to_thread(run)


# -- the relay ------------------------------------------------------------------------------


async def test_a_relay_to_the_real_prefill_node_is_never_trusted(
    tmp_path: Path, model: Path
) -> None:
    """Relays (plain, and TLS with their own certificate) forward /health and the hello to
    real prefill nodes; the decode node, told of the relays and of one real node directly,
    trusts only the real one, and the relays get neither the token nor a signature."""
    plain = start_node(tmp_path, model, "prefill", token=TOKEN, wait=False)
    tls = start_node(tmp_path, model, "prefill", "--tls", token=TOKEN)
    nodes = [plain, tls]
    wait_healthy(plain)
    tls_cert = tls.health().cert_fingerprint
    logs = {"plain": Log(), "tls": Log()}
    relay_cert = load_or_create(tmp_path / "relay-tls", "relay")
    try:
        async with (
            serving(relay(plain.url, logs["plain"]), None) as plain_relay,
            serving(relay(tls.url, logs["tls"]), relay_cert) as tls_relay,
        ):
            peers = ("--peer", plain_relay, "--peer", tls_relay, "--peer", tls.url)
            decode = start_node(
                tmp_path, model, "decode", "--remote-prefill", "always", *peers, token=TOKEN
            )
            nodes.append(decode)
            await asyncio.to_thread(wait_trusted, decode)  # the real one, told of directly
            seen = await watch(decode, plain_relay, 4.0)
            seen_tls = await watch(decode, tls_relay, 2.0)
            reply = await asyncio.to_thread(chat, decode)
            cluster = decode.cluster()
    finally:
        for node in nodes:
            node.stop()
    for entries in (seen, seen_tls):
        assert entries and all(e is not None and not e.trusted for _, e in entries)
        assert entries[-1][1].reason == "unauthorized"  # type: ignore[union-attr]
    real = next(p for p in cluster.peers if p.address == tls.url)
    assert real.trusted and real.cert_fingerprint == tls_cert
    assert reply.prefill == "remote" and reply.prefill_node == tls.url
    for name, log in logs.items():
        assert "/v1/hello" in log.paths, name  # it was asked, and its relayed proof failed
        log.assert_nothing_usable(TOKEN)
    assert TOKEN not in decode.output()


# -- signed requests at a real node ---------------------------------------------------------


def _post(url: str, path: str, body: bytes, headers: dict[str, str]) -> int:
    req = urllib.request.Request(url + path, data=body, headers=headers, method="POST")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=30, context=unverified_tls()) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        text = e.read().decode()
        assert TOKEN not in text
        return e.code


def test_replayed_and_tampered_signed_requests_are_refused_and_pair_pins(
    tmp_path: Path, model: Path
) -> None:
    node = start_node(tmp_path, model, "prefill", "--tls", token=TOKEN)
    try:
        health = node.health()
        body = json.dumps(PrefillBody(health.fingerprint, "signed-1", [1, 2, 3, 4]).to_json())
        body = body.encode()
        headers = sign(TOKEN, "POST", "/v1/prefill", None, body, "test-caller", health.id)
        assert _post(node.url, "/v1/prefill", body, headers) == 200
        assert _post(node.url, "/v1/prefill", body, headers) == 401  # replayed
        fresh = sign(TOKEN, "POST", "/v1/prefill", None, body, "test-caller", health.id)
        assert _post(node.url, "/v1/prefill", body.replace(b"[1, 2", b"[9, 2"), fresh) == 401
        other = sign(TOKEN, "POST", "/v1/prefill", None, body, "test-caller", "another-node")
        assert _post(node.url, "/v1/prefill", body, other) == 401  # meant for someone else
        wrong = sign("x" * 40, "POST", "/v1/prefill", None, body, "test-caller", health.id)
        assert _post(node.url, "/v1/prefill", body, wrong) == 401
        moved = sign(TOKEN, "POST", "/v1/cluster", None, body, "test-caller", health.id)
        assert _post(node.url, "/v1/prefill", body, moved) == 401  # signed for another path
        # and `tandem pair --check` says which certificate it pinned
        ok, text = run_check(node.url, TOKEN)
        assert ok and f"sha256:{health.cert_fingerprint}" in text
        ok, text = run_check(node.url.removeprefix("https://"), TOKEN)  # host:port alone
        assert ok and f"sha256:{health.cert_fingerprint}" in text
        ok, text = run_check(node.url, "not-the-token-0123456789abcdef")
        assert not ok and "does NOT hold" in text
    finally:
        node.stop()
    assert "refused a signed POST /v1/prefill" in node.output()
    assert TOKEN not in node.output()


# -- the takeover ---------------------------------------------------------------------------


async def test_an_impostor_in_a_dead_nodes_place_gets_nothing(tmp_path: Path, model: Path) -> None:
    """Kill a trusted prefill node (plain, and TLS) and serve a copy of its /health on its
    port at once: the decode node stops trusting the address within a health check and
    never trusts it again; the impostor gets neither the token nor a signature."""
    nodes: list[NodeProc] = []
    try:
        targets = {}
        for mode in ("plain", "tls"):
            prefill = start_node(
                tmp_path, model, "prefill", *(["--tls"] * (mode == "tls")), token=TOKEN,
                wait=False,
            )  # fmt: skip
            decode = start_node(
                tmp_path, model, "decode", "--remote-prefill", "always", "--peer", prefill.url,
                token=TOKEN, wait=False,
            )  # fmt: skip
            nodes += [prefill, decode]
            targets[mode] = (prefill, decode)
        for node in nodes:  # all four start at once
            wait_healthy(node)
        for prefill, decode in targets.values():  # trusted, and its probe done
            await asyncio.to_thread(
                poll,
                lambda d=decode, p=prefill: (e := entry(d, p.url)) and e.prefill_floor_s,
                20.0,
            )
        health = {m: p.get("/health", auth=False) for m, (p, _) in targets.items()}
        logs = {m: Log() for m in targets}
        own_cert = load_or_create(tmp_path / "impostor-tls", "impostor")
        for prefill, _ in targets.values():
            prefill.stop(signal.SIGKILL)
        async with (
            serving(impostor(health["plain"], logs["plain"]), None, targets["plain"][0].port),
            serving(impostor(health["tls"], logs["tls"]), own_cert, targets["tls"][0].port),
        ):
            t0 = time.monotonic()
            seen = await asyncio.gather(*(watch(d, p.url, WATCH_S) for p, d in targets.values()))
            replies = [await asyncio.to_thread(chat, d) for _, d in targets.values()]
            took = time.monotonic() - t0
    finally:
        for node in nodes:
            node.stop()
    assert took >= WATCH_S
    for (mode, log), entries in zip(logs.items(), seen, strict=True):
        first = next(i for i, (_, e) in enumerate(entries) if e and not e.trusted)
        assert entries[first][0] <= 2.5, mode  # within a health check (every 2 s)
        assert not any(e and e.trusted for _, e in entries[first:]), mode
        assert "/health" in log.paths, mode
        log.assert_nothing_usable(TOKEN)
    assert all(r.prefill == "local" for r in replies)
    tls_entry = seen[1][-1][1]
    assert tls_entry is not None and tls_entry.reason == "unauthorized"
    assert tls_entry.cert_fingerprint == health["tls"]["cert_fingerprint"]  # pin kept


async def test_a_request_in_the_takeover_window_goes_only_to_who_proves_on_its_connection(
    tmp_path: Path, model: Path
) -> None:
    """Right after a health check, the trusted plain-HTTP peer dies and an impostor serving a
    copy of its /health takes its port; a chat comes at once, long before the next check. The
    remote prefill runs a hello on its own connection before the request goes out on it: the
    impostor gets a hello it cannot answer and never the request; the peer is untrusted at
    once and the chat is served locally."""
    real = start_node(tmp_path, model, "prefill", token=TOKEN)  # for an honest /health
    try:
        health = real.get("/health", auth=False)
    finally:
        real.stop()
    honest = HonestPeer(health["model"]["fingerprint"])
    copy = {**health, "instance": honest.instance}  # exactly what the honest peer serves
    log = Log()
    peer = serving(honest.app(health), None)
    url = await peer.__aenter__()
    port = int(url.rsplit(":", 1)[1])
    decode = start_node(
        tmp_path, model, "decode", "--remote-prefill", "always", "--peer", url, token=TOKEN
    )
    try:
        await asyncio.to_thread(poll, lambda: (e := entry(decode, url)) and e.prefill_floor_s, 20.0)

        def checks() -> int:  # health checks that ran to their end (plain HTTP: a hello)
            return honest.log.paths.count(CONFIRM_PATH)

        done = checks()
        await asyncio.to_thread(poll, lambda: checks() > done, 5.0)  # the next is 2 s away
        t0 = time.monotonic()
        await peer.__aexit__(None, None, None)  # the peer dies
        async with serving(impostor(copy, log), None, port):
            reply = await asyncio.to_thread(chat, decode)
            took = time.monotonic() - t0
            after = entry(decode, url)
    finally:
        decode.stop()
    assert took < 1.5, took  # inside the window: no health check could have seen the swap
    assert reply.prefill == "local"
    assert HELLO_PATH in log.paths  # the request's own connection asked it to prove itself
    log.assert_nothing_usable(TOKEN)  # and it got neither the request nor a signature
    assert after is not None and not after.trusted and after.reason == "unauthorized"
    assert "did not prove itself here" in decode.output()


# -- a restart ------------------------------------------------------------------------------


@dataclass
class HonestPeer:
    """A prefill node in the test's hands that holds the token: it can be "restarted" (a
    new instance), its hellos held back, and it records the order of what it gets."""

    fp: str
    instance: str = "first"
    hold: asyncio.Event | None = None
    log: Log = field(default_factory=Log)

    def app(self, health: dict[str, Any]) -> web.Application:
        responder = HelloResponder(TOKEN, health["id"], self.fp, "")

        async def get_health(request: web.Request) -> web.Response:
            return web.json_response({**health, "instance": self.instance})

        async def held() -> None:
            if self.hold is not None:
                await self.hold.wait()

        async def prefill(request: web.Request) -> web.Response:
            await request.read()
            return web.json_response({"error": {"message": "not today"}}, status=409)

        app = web.Application(middlewares=[self.log.middleware()])
        app.router.add_get("/health", get_health)
        add_hello_routes(app, responder, held)
        app.router.add_post("/v1/prefill", prefill)
        return app


async def test_a_restarted_peer_proves_itself_again_before_any_request(
    tmp_path: Path, model: Path
) -> None:
    real = start_node(tmp_path, model, "prefill", token=TOKEN)  # for an honest /health
    try:
        health = real.get("/health", auth=False)
        ok, text = await check(real.url.split("://")[1], TOKEN)  # host:port: plain, after https
        assert ok and text.startswith(f"{health['name']} at {real.url} holds this token")
    finally:
        real.stop()
    honest = HonestPeer(health["model"]["fingerprint"])
    async with serving(honest.app(health), None) as url:
        decode = start_node(
            tmp_path, model, "decode", "--remote-prefill", "always", "--peer", url, token=TOKEN
        )
        try:
            await asyncio.to_thread(
                poll, lambda: (e := entry(decode, url)) and e.prefill_floor_s, 20.0
            )  # trusted, and its probe (a signed /v1/prefill) answered
            mark = len(honest.log.requests)
            honest.instance, honest.hold = "second", asyncio.Event()  # restarted, slow to hello
            await asyncio.to_thread(poll, lambda: not entry(decode, url).trusted, 3.0)
            held = await asyncio.to_thread(chat, decode)
            honest.hold.set()
            await asyncio.to_thread(poll, lambda: entry(decode, url).trusted, 10.0)
            after = await asyncio.to_thread(chat, decode, "and now?")
        finally:
            decode.stop()
    assert held.prefill == "local"
    since = honest.log.paths[mark:]
    first_prefill = since.index("/v1/prefill")
    assert "/v1/hello/confirm" in since[:first_prefill]  # proved again first
    assert after.prefill == "local"  # its 409 made the decode node prefill locally
    prefills = [h for p, h in honest.log.requests if p == "/v1/prefill"]
    assert prefills and all(SIGNATURE in h and "Authorization" not in h for h in prefills)


# -- binds ----------------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["", "::", "0"])
def test_every_interface_without_a_token_is_refused(tmp_path: Path, model: Path, host: str) -> None:
    node = start_node(tmp_path, model, "decode", "--host", host, wait=False)
    assert node.proc.wait(60) == 2
    out = node.output()
    assert "without a token" in out and "Traceback" not in out
