"""Issue 19 in-process: hello v2 (mutual, bound to the certificate or the address), the auth
middleware (bearer or signed, replay and tamper refused), the mDNS `cert` key and `/health`'s
new fields."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import aiohttp
import pytest
from tandem.nodes.cluster.mdns_records import Advert, read_service, url_for
from tandem.nodes.contract.cluster import Health
from tandem.nodes.contract.http import PROTO, SERVICE_TYPE
from tandem.nodes.trust.hello import (
    PENDING_S,
    HelloError,
    HelloRefused,
    HelloResponder,
    channel_address,
    prove,
)
from tandem.nodes.trust.signing import TIME, hello_proof, sign
from tandem.nodes.trust.tls import Identity
from zeroconf.asyncio import AsyncServiceInfo

from tests import hello_support
from tests.hello_support import CALLEE, FP, TOKEN, callee
from tests.trust_support import Log, relay, serving

ident = hello_support.ident  # this module's TLS identities (module-scoped fixtures)
other_ident = hello_support.other_ident

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
