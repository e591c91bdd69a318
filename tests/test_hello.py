"""Issue 19 in-process: hello v2 (mutual, bound to the certificate or the address), the auth
middleware (bearer or signed, replay and tamper refused), the peer table's trust per
connection identity, the mDNS `cert` key and `/health`'s new fields."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from tandem.app.tui.client import NodeClient, NodeError
from tandem.nodes.cluster.mdns_records import Advert, read_service, url_for
from tandem.nodes.cluster.peers import PeerTable, UntrustedPeer
from tandem.nodes.contract.cluster import Cluster, Health, Peer
from tandem.nodes.contract.http import PROTO, SERVICE_TYPE
from tandem.nodes.trust.auth import auth_middleware
from tandem.nodes.trust.hello import (
    PENDING_S,
    HelloError,
    HelloRefused,
    HelloResponder,
    channel_address,
    prove,
)
from tandem.nodes.trust.signing import SIGNATURE, TIME, Verifier, hello_proof, sign
from tandem.nodes.trust.tls import Identity, load_or_create
from zeroconf.asyncio import AsyncServiceInfo

from tests.trust_support import Log, add_hello_routes, relay, serving

TOKEN = "hello-test-token-0123456789abcdef"
FP = "f" * 64
CALLEE = "callee-node"


@dataclass
class FakeCallee:
    """A node as far as trust goes: /health, the hello, and one protected route (/v1/echo)
    behind the real auth middleware. Records every request it gets."""

    token: str | None = TOKEN
    identity: Identity | None = None
    instance: str = "i-1"
    hold: asyncio.Event | None = None  # when set to an unset event, hellos wait for it
    seen: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    url: str = ""

    def app(self) -> web.Application:
        cert = self.identity.fingerprint if self.identity else ""
        responder = HelloResponder(self.token, CALLEE, FP, cert)
        self.responder = responder

        @web.middleware
        async def record(request: web.Request, handler: Any) -> web.StreamResponse:
            self.seen.append((request.path, dict(request.headers)))
            return await handler(request)

        async def health(request: web.Request) -> web.Response:
            h = Health(
                CALLEE, "callee", ("prefill",), PROTO, "0", "cpu", 0, 0, "m", FP, 2,
                instance=self.instance, cert_fingerprint=cert,
            )  # fmt: skip
            return web.json_response(h.to_json())

        async def held() -> None:
            if self.hold is not None:
                await self.hold.wait()

        async def cluster(request: web.Request) -> web.Response:
            return web.json_response({"self": {"id": CALLEE}, "peers": []})

        async def echo(request: web.Request) -> web.Response:
            return web.json_response({"body": (await request.read()).decode()})

        app = web.Application(middlewares=[record, auth_middleware(self.token, CALLEE)])
        app.router.add_get("/health", health)
        add_hello_routes(app, responder, held)
        app.router.add_route("*", "/v1/echo", echo)
        app.router.add_get("/v1/cluster", cluster)
        return app

    def paths(self) -> list[str]:
        return [p for p, _ in self.seen]


@asynccontextmanager
async def callee(identity: Identity | None = None, **kw: Any) -> AsyncIterator[FakeCallee]:
    fake = FakeCallee(identity=identity, **kw)
    async with serving(fake.app(), identity) as url:
        fake.url = url
        yield fake


@pytest.fixture(scope="module")
def ident(tmp_path_factory: pytest.TempPathFactory) -> Identity:
    return load_or_create(tmp_path_factory.mktemp("callee-tls"), "callee")


@pytest.fixture(scope="module")
def other_ident(tmp_path_factory: pytest.TempPathFactory) -> Identity:
    return load_or_create(tmp_path_factory.mktemp("other-tls"), "impostor")


# -- hello v2 -------------------------------------------------------------------------------


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
async def test_a_hello_proves_both_sides_and_pins_the_certificate(
    ident: Identity, tls: bool
) -> None:
    async with callee(ident if tls else None) as fake, aiohttp.ClientSession() as s:
        proven = await prove(s, fake.url, TOKEN, "caller-a")
    assert proven.id == CALLEE and proven.fingerprint == FP
    assert proven.cert_fingerprint == (ident.fingerprint if tls else "")
    assert list(fake.responder.proven) == ["caller-a"]  # the callee saw the caller prove
    assert fake.paths() == ["/v1/hello", "/v1/hello/confirm"]


async def test_a_callee_without_the_token_gets_no_proof_from_the_caller() -> None:
    async with callee(token="another-token-entirely-000") as fake, aiohttp.ClientSession() as s:
        with pytest.raises(HelloError) as e:
            await prove(s, fake.url, TOKEN, "caller-a")
    assert e.value.reason == "unauthorized"
    assert fake.paths() == ["/v1/hello"]  # no confirm: the caller proves only to a prover


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
async def test_a_relay_to_the_real_node_is_not_trusted(
    ident: Identity, other_ident: Identity, tls: bool
) -> None:
    """A relay on its own port (plain) or with its own certificate (TLS) forwards the hello
    to the node that holds the token: that node's proof names its own channel."""
    relayed = Log()
    async with (
        callee(ident if tls else None) as real,
        serving(relay(real.url, relayed), other_ident if tls else None) as relay_url,
        aiohttp.ClientSession() as s,
    ):
        with pytest.raises(HelloError, match="relay") as e:
            await prove(s, relay_url, TOKEN, "caller-a")
    assert e.value.reason == "unauthorized"
    assert relayed.paths == ["/v1/hello"]  # the caller's proof never went out
    relayed.assert_nothing_usable(TOKEN)
    assert not real.responder.proven


async def test_a_name_with_several_addresses_is_refused_over_plain_http(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`localhost` may name 127.0.0.1 and ::1: a node proven at one of them says nothing
    about a relay listening at the other, on the same port, where the next request may go.
    Here the real node is at 127.0.0.1:P, a relay at 127.0.0.2:P, and a name resolves to
    both, the relay first. Over plain HTTP a peer must be named by one address."""
    relayed = Log()
    async with callee() as real:
        port = int(real.url.rsplit(":", 1)[1])
        async with serving(relay(real.url, relayed), None, port=port, host="127.0.0.2"):
            loop = asyncio.get_running_loop()
            resolve = loop.getaddrinfo

            async def both(host, *args, **kw):
                if host != "twice.test":
                    return await resolve(host, *args, **kw)
                return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port))
                        for a in ("127.0.0.2", "127.0.0.1")]  # fmt: skip

            monkeypatch.setattr(loop, "getaddrinfo", both)
            async with aiohttp.ClientSession() as s:
                with pytest.raises(HelloError, match=r"resolves to 127\.0\.0\.2:\d+, 127") as e:
                    await prove(s, f"http://twice.test:{port}", TOKEN, "caller-a")
                assert e.value.reason == "unauthorized"
                proven = await prove(s, f"http://127.0.0.1:{port}", TOKEN, "caller-a")
                assert proven.id == CALLEE  # named by its one address, as before
    assert relayed.paths == []  # nothing went out to the ambiguous name


async def test_the_address_is_what_binds_a_plain_hello() -> None:
    async with callee() as fake:
        port = int(fake.url.rsplit(":", 1)[1])
        body = fake.responder.answer({"nonce": "n" * 32, "id": "c"}, ("127.0.0.1", port))
    args = ("n" * 32, body["nonce"], "c", CALLEE, FP, "")
    mine = channel_address("127.0.0.1", port)
    assert mine == f"127.0.0.1:{port}" == channel_address("::ffff:127.0.0.1", port)
    assert channel_address("::1", port) == f"[::1]:{port}"
    assert body["proof"] == hello_proof(TOKEN, "callee", *args, mine)
    assert body["proof"] != hello_proof(TOKEN, "callee", *args, f"127.0.0.2:{port}")


SOCK = ("127.0.0.1", 1)  # the callee's side of the hello's connection


def _confirm_for(r: HelloResponder, caller: str = "caller") -> tuple[dict[str, str], str]:
    """A fresh hello to `r` and the confirm its caller would send: (confirm body, the callee's
    own proof in that hello)."""
    answer = r.answer({"nonce": "c" * 32, "id": caller}, SOCK)
    args = ("c" * 32, answer["nonce"], caller, CALLEE, FP, "", "127.0.0.1:1")
    body = {"nonce": answer["nonce"], "id": caller, "proof": hello_proof(TOKEN, "caller", *args)}
    return body, answer["proof"]


def test_a_confirm_is_used_once_and_only_for_its_own_hello() -> None:
    r = HelloResponder(TOKEN, CALLEE, FP, "")
    good, callee_proof = _confirm_for(r)
    with pytest.raises(HelloRefused):  # the callee's own proof is no caller's proof
        r.confirm({**good, "proof": callee_proof}, SOCK)
    good, _ = _confirm_for(r)
    with pytest.raises(HelloRefused):  # the hello's caller only...
        r.confirm({**good, "id": "someone-else"}, SOCK)
    with pytest.raises(HelloRefused):  # ...on the hello's channel only...
        r.confirm(good, ("127.0.0.1", 2))
    assert r.confirm(good, SOCK) == "caller" and "caller" in r.proven
    with pytest.raises(HelloRefused):  # ...and once
        r.confirm(good, SOCK)
    for forged in ("0" * 32, good["nonce"] + "0", good["nonce"].replace(".", ".1", 1)):
        with pytest.raises(HelloRefused):  # a nonce this node never handed out
            r.confirm({**good, "nonce": forged}, SOCK)
    other = HelloResponder(TOKEN, CALLEE, FP, "")  # another process: another secret
    good, _ = _confirm_for(other)
    with pytest.raises(HelloRefused):
        r.confirm(good, SOCK)
    for junk in (None, [], {"nonce": 1, "id": "x", "proof": "y"}, {"nonce": "x"}):
        with pytest.raises(ValueError):
            r.confirm(junk, SOCK)
    assert "hello-test-token" not in repr(r)


def test_a_callee_nonce_expires(monkeypatch: pytest.MonkeyPatch) -> None:
    r = HelloResponder(TOKEN, CALLEE, FP, "")
    good, _ = _confirm_for(r)
    now = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: now + PENDING_S + 1)
    with pytest.raises(HelloRefused):
        r.confirm(good, SOCK)


def test_hello_bodies_are_checked() -> None:
    r = HelloResponder(TOKEN, CALLEE, FP, "")
    for junk in (
        None,
        [],
        {"id": "x"},
        {"nonce": "short"},
        {"nonce": "n" * 300},
        {"nonce": "n" * 16, "id": 5},
        {"nonce": "n" * 16, "id": "x" * 300},
    ):
        with pytest.raises(ValueError):
            r.answer(junk, SOCK)
    odd = 'ü."/=' * 40  # any 8..256 characters come back to the proof as they went
    answer = r.answer({"nonce": odd, "id": "x"}, SOCK)
    proof = hello_proof(TOKEN, "caller", odd, answer["nonce"], "x", CALLEE, FP, "", "127.0.0.1:1")
    assert r.confirm({"nonce": answer["nonce"], "id": "x", "proof": proof}, SOCK) == "x"


def test_a_flood_of_hellos_on_the_same_address_keeps_no_caller_out() -> None:
    """On loopback every caller has one address: a hello leaves no state to push out."""
    r = HelloResponder(TOKEN, CALLEE, FP, "")
    honest, _ = _confirm_for(r)
    for _ in range(4096):
        r.answer({"nonce": "f" * 16, "id": "x"}, SOCK)
    assert r.confirm(honest, SOCK) == "caller"


def test_forgetting_used_confirms_never_reopens_a_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter(range(10**6))  # one ms a call: each hello its own expiry
    monkeypatch.setattr(time, "monotonic", lambda: 100 + next(clock) / 1000)
    r = HelloResponder(TOKEN, CALLEE, FP, "", max_used=4)
    made = [_confirm_for(r, f"caller-{i}")[0] for i in range(6)]
    for body in made:
        assert r.confirm(body, SOCK) == body["id"]
    assert len(r._used) == 4
    for body in made:  # the two forgotten ones are below the floor
        with pytest.raises(HelloRefused):
            r.confirm(body, SOCK)


# -- the auth middleware: bearer for clients, signatures for peers --------------------------


async def _call(
    s: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str],
    body: bytes = b"{}",
    method: str = "POST",
    path: str = "/v1/echo",
) -> tuple[int, str]:
    async with s.request(method, url + path, data=body, headers=headers) as r:
        return r.status, await r.text()


async def test_bearer_or_a_signature_for_this_node_and_nothing_else() -> None:
    body = b'{"tokens": [1, 2, 3]}'
    async with callee() as fake, aiohttp.ClientSession() as s:
        signed = sign(TOKEN, "POST", "/v1/echo", None, body, "caller-a", CALLEE)
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        assert await _call(s, fake.url, bearer, body) == (200, json.dumps({"body": body.decode()}))
        assert await _call(s, fake.url, signed, body) == (200, json.dumps({"body": body.decode()}))
        refusals = {
            "replayed": (signed, body),
            "tampered body": (sign(TOKEN, "POST", "/v1/echo", None, body, "a", CALLEE), b"{}"),
            "for another node": (sign(TOKEN, "POST", "/v1/echo", None, body, "a", "b"), body),
            "another token": (sign("x" * 32, "POST", "/v1/echo", None, body, "a", CALLEE), body),
            "stale": (
                sign(TOKEN, "POST", "/v1/echo", None, body, "a", CALLEE, now=time.time() - 120),
                body,
            ),
            "other path": (sign(TOKEN, "POST", "/v1/prefill", None, body, "a", CALLEE), body),
            "no headers": ({}, body),
            "lower-case bearer": ({"Authorization": f"bearer {TOKEN}"}, body),
            "bare token": ({"Authorization": TOKEN}, body),
            "short token": ({"Authorization": f"Bearer {TOKEN[:-1]}"}, body),
            "long token": ({"Authorization": f"Bearer {TOKEN}x"}, body),
        }
        for why, (headers, data) in refusals.items():
            status, text = await _call(s, fake.url, headers, data)
            assert status == 401, why
            assert TOKEN not in text and json.loads(text)["error"]["code"] == "unauthorized"
        # a tampered time header breaks the signature too
        forged = {**sign(TOKEN, "POST", "/v1/echo", None, body, "a", CALLEE)}
        forged[TIME] = str(int(forged[TIME]) + 1)
        assert (await _call(s, fake.url, forged, body))[0] == 401
        # the query is signed: the same signature with another query is refused
        q = sign(TOKEN, "GET", "/v1/echo", {"since": "1"}, b"", "a", CALLEE)
        assert (await _call(s, fake.url, q, b"", "GET", "/v1/echo?since=1"))[0] == 200
        q = sign(TOKEN, "GET", "/v1/echo", {"since": "1"}, b"", "a", CALLEE)
        assert (await _call(s, fake.url, q, b"", "GET", "/v1/echo?since=0"))[0] == 401
        assert (await _call(s, fake.url, {}, b"", "GET", "/health"))[0] == 200


async def test_a_restarted_node_refuses_what_was_signed_before_it_started() -> None:
    body = b"{}"
    old = sign(TOKEN, "POST", "/v1/echo", None, body, "a", CALLEE, now=time.time() - 5)
    async with callee() as fake, aiohttp.ClientSession() as s:
        assert (await _call(s, fake.url, old, body))[0] == 401  # inside the window, but older


# -- the peer table: trust per connection identity ------------------------------------------


def table_for(session: aiohttp.ClientSession, url: str) -> PeerTable:
    """A decode node's peer table knowing `url`, checked by hand (no background loop)."""
    table = PeerTable("decode-a", FP, TOKEN, PROTO)
    table._session = session
    table.add(url)
    return table


async def test_a_failed_health_check_untrusts_at_once(ident: Identity) -> None:
    fake = FakeCallee(identity=ident)
    async with aiohttp.ClientSession() as s:
        async with serving(fake.app(), ident) as url:
            table = table_for(s, url)
            assert (await table.check(url)).trusted  # type: ignore[union-attr]
        after = await table.check(url)  # one failed check, not a timeout later
    assert after is not None and not after.trusted and after.reason == "unreachable"


async def test_a_late_health_answer_untrusts_only_the_second_time_in_a_row(
    ident: Identity, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A busy node can answer one check late (its loop held by a CPU prefill): that alone
    must not cancel the requests it serves; a second late answer in a row does."""
    fake = FakeCallee(identity=ident)
    async with aiohttp.ClientSession() as s, serving(fake.app(), ident) as url:
        table = table_for(s, url)
        assert (await table.check(url)).trusted  # type: ignore[union-attr]

        async def late(address: str, pin: str | None) -> None:
            raise TimeoutError

        monkeypatch.setattr(table, "_health", late)
        assert (await table.check(url)).trusted  # type: ignore[union-attr]
        after = await table.check(url)
    assert after is not None and not after.trusted and after.reason == "unreachable"


async def test_a_restart_is_untrusted_before_the_new_hello_ends() -> None:
    """A new `instance` at the same address: untrusted at once, trusted again only after it
    proves the token; nothing may be signed for it in between."""
    async with callee() as fake, aiohttp.ClientSession() as s:
        table = table_for(s, fake.url)
        assert (await table.check(fake.url)).trusted  # type: ignore[union-attr]
        fake.instance, fake.hold = "i-2", asyncio.Event()
        check = asyncio.create_task(table.check(fake.url))
        for _ in range(100):
            if not table.peers[fake.url].trusted:
                break
            await asyncio.sleep(0.02)
        assert not table.peers[fake.url].trusted and not check.done()
        with pytest.raises(UntrustedPeer):
            table.signed(fake.url, "POST", "/v1/prefill", b"{}")
        fake.hold.set()
        again = await check
    assert again is not None and again.trusted and again.instance == "i-2"


async def test_another_certificate_at_the_address_is_refused(
    tmp_path: Path, ident: Identity, other_ident: Identity
) -> None:
    async with callee(ident) as fake, aiohttp.ClientSession() as s:
        table = table_for(s, fake.url)
        assert (await table.check(fake.url)).trusted  # type: ignore[union-attr]
        pinned = table.peers[fake.url].cert_fingerprint
        assert pinned == ident.fingerprint
        port = int(fake.url.rsplit(":", 1)[1])
        headers = table.signed(fake.url, "POST", "/v1/prefill", b"{}")
        assert headers.pin == ident.fingerprint
        assert Verifier(TOKEN, CALLEE).verify("POST", "/v1/prefill", None, b"{}", headers.headers)
    # an impostor holding no token, with its own certificate, a copy of /health and the port
    impostor = FakeCallee(token="not-the-cluster-token-000", identity=other_ident)
    async with serving(impostor.app(), other_ident, port) as url, aiohttp.ClientSession() as s:
        table = table_for(s, url)
        table.peers[url] = replace_trusted(url, pinned)  # as the table left it
        after = await table.check(url)
        assert after is not None and not after.trusted and after.reason == "unauthorized"
        assert impostor.paths() == []  # the pinned handshake failed before any request
        after = await table.check(url)  # proving again: it cannot
        assert after is not None and not after.trusted and after.reason == "unauthorized"
    assert all(SIGNATURE not in h and "Authorization" not in h for _, h in impostor.seen)
    assert "/v1/hello/confirm" not in impostor.paths()


def replace_trusted(url: str, pin: str) -> Peer:
    return Peer(
        url,
        id=CALLEE,
        roles=("prefill",),
        proto=PROTO,
        trusted=True,
        reason=None,
        model={"name": "m", "fingerprint": FP},
        instance="i-1",
        cert_fingerprint=pin,
    )


def test_signed_needs_a_trusted_peer() -> None:
    table = PeerTable("me", FP, TOKEN)
    with pytest.raises(UntrustedPeer):
        table.signed("http://127.0.0.1:1", "POST", "/v1/prefill", b"")
    table.peers["https://h:1"] = Peer("https://h:1", id="p", trusted=True, reason=None)
    with pytest.raises(UntrustedPeer, match="pinned"):  # https without a pin: never
        table.signed("https://h:1", "POST", "/v1/prefill", b"")
    open_table = PeerTable("me", FP, None)
    open_table.peers["http://h:1"] = Peer("http://h:1", id="p", trusted=True, reason=None)
    assert open_table.signed("http://h:1", "POST", "/v1/prefill", b"").headers == {}


# -- clients: the dashboard and `tandem pair` ------------------------------------------------


async def test_the_dashboard_client_pins_what_the_hello_covered(
    ident: Identity, other_ident: Identity
) -> None:
    async with aiohttp.ClientSession() as s:
        async with callee(ident) as fake:
            client = NodeClient(s, fake.url, TOKEN)
            probe = await client.probe()
            view = Cluster.from_json({"self": {"id": CALLEE}, "peers": []})  # what it answered
            assert probe.ok and probe.cluster == view
            assert client.cert_fingerprint == ident.fingerprint
            port = int(fake.url.rsplit(":", 1)[1])
        bearer_seen = [p for p, h in fake.seen if "Authorization" in h]
        assert bearer_seen == ["/v1/cluster"]  # after the hello, never before
        impostor = FakeCallee(identity=other_ident)  # even one holding the token
        async with serving(impostor.app(), other_ident, port):
            with pytest.raises(NodeError) as e:  # the pinned certificate is not this one
                await client._get_json("/v1/cluster", auth=True)
            assert e.value.reason == "unreachable"
            assert impostor.seen == []
            again = await client.probe()  # a new probe proves again, and pins anew
            assert again.ok and client.cert_fingerprint == other_ident.fingerprint
        async with callee(ident, token="wrong-token-0123456789abcdef") as liar:
            probe = await NodeClient(s, liar.url, TOKEN).probe()
            assert probe.reason == "unauthorized"
            assert not [p for p, h in liar.seen if "Authorization" in h]


async def test_the_dashboard_client_proves_a_plain_http_node_before_each_stream() -> None:
    """On plain HTTP nothing pins a node between hellos: a chat or an event stream proves the
    node at that address first, so an impostor that took the port after the probe (here one
    with another token) never receives the bearer."""
    async with aiohttp.ClientSession() as s:
        async with callee() as fake:
            client = NodeClient(s, fake.url, TOKEN)
            assert (await client.probe()).ok and client.proven
            port = int(fake.url.rsplit(":", 1)[1])
        impostor = FakeCallee(token="wrong-token-0123456789abcdef")
        async with serving(impostor.app(), None, port):
            with pytest.raises(NodeError) as e:
                async for _ in client.chat([{"role": "user", "content": "hi"}]):
                    pass
            assert e.value.reason == "unauthorized" and not client.proven
            with pytest.raises(NodeError) as e:
                async for _ in client.events():
                    pass
            assert e.value.reason == "unauthorized"
            assert impostor.paths() and not [p for p, h in impostor.seen if "Authorization" in h]
        async with serving(fake.app(), None, port):  # the real node back: proved again, used
            assert (await client.probe()).ok and client.proven


# -- what nodes publish ---------------------------------------------------------------------


def test_health_carries_instance_and_certificate() -> None:
    h = Health("n", "x", ("prefill",), PROTO, "0", "cpu", 1, 2, "m", FP, 4, "abc", "d" * 64)
    body = h.to_json()
    assert body["instance"] == "abc" and body["cert_fingerprint"] == "d" * 64
    assert Health.from_json(json.loads(json.dumps(body))) == h
    old = {k: v for k, v in body.items() if k not in ("instance", "cert_fingerprint")}
    assert Health.from_json(old).cert_fingerprint == ""


def test_txt_cert_key_and_https_urls() -> None:
    h = Health("n1", "x", ("prefill",), PROTO, "0", "cpu", 1, 2, "m", FP, 4, "abc", "d" * 64)
    advert = Advert.from_health(h, "10.0.0.2", 8470)
    assert advert.properties()["cert"] == "d" * 64
    plain = Advert.from_health(
        Health.from_json({**h.to_json(), "cert_fingerprint": ""}), "127.0.0.1", 1
    )
    assert "cert" not in plain.properties()
    assert url_for("10.0.0.2", 8470, True) == "https://10.0.0.2:8470"
    assert url_for("fd00::2", 8470, True) == "https://[fd00::2]:8470"
    info = AsyncServiceInfo(
        SERVICE_TYPE,
        f"n1.{SERVICE_TYPE}",
        port=8470,
        properties=advert.properties(),
        parsed_addresses=["10.0.0.2"],
    )
    seen = read_service(info)
    assert seen is not None and seen.urls == ("https://10.0.0.2:8470",)
    assert seen.peer(seen.urls[0]).cert_fingerprint == "d" * 64
    bad = AsyncServiceInfo(
        SERVICE_TYPE,
        f"n2.{SERVICE_TYPE}",
        port=1,
        properties={**advert.properties(), "cert": "nothex"},
    )
    assert read_service(bad) is None
