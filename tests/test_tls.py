"""A node's TLS identity (issue 19 item 3): made once, reused, pinned by fingerprint, served
over real loopback TLS connections (asyncio streams and aiohttp)."""

from __future__ import annotations

import asyncio
import ssl
import stat
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from hashlib import sha256
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from tandem.nodes.trust.tls import (
    CERT_FILE,
    KEY_FILE,
    Identity,
    TLSError,
    aiohttp_pin,
    check_peer,
    client_context,
    load_or_create,
    peer_fingerprint,
    server_context,
)

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def _der_fingerprint(cert_path: Path) -> str:
    return sha256(ssl.PEM_cert_to_DER_cert(cert_path.read_text())).hexdigest()


def test_first_start_makes_a_private_key_and_a_certificate(tmp_path: Path) -> None:
    config = tmp_path / "not" / "yet" / "there"
    ident = load_or_create(config, "prefill-box")
    assert ident.cert_path == config / CERT_FILE and ident.key_path == config / KEY_FILE
    assert stat.S_IMODE(ident.key_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(config.stat().st_mode) & 0o077 == 0
    assert sorted(p.name for p in config.iterdir()) == [CERT_FILE, KEY_FILE]  # no temp files
    assert ident.fingerprint == _der_fingerprint(ident.cert_path)
    assert len(ident.fingerprint) == 64 and int(ident.fingerprint, 16) >= 0
    assert "PRIVATE KEY" in ident.key_path.read_text()


def test_later_starts_reuse_the_identity(tmp_path: Path) -> None:
    first = load_or_create(tmp_path, "node")
    cert, key = first.cert_path.read_bytes(), first.key_path.read_bytes()
    again = load_or_create(tmp_path, "another name")
    assert again == first
    assert (again.cert_path.read_bytes(), again.key_path.read_bytes()) == (cert, key)


def test_each_config_dir_is_its_own_identity(tmp_path: Path) -> None:
    a = load_or_create(tmp_path / "a", "node")
    b = load_or_create(tmp_path / "b", "node")
    assert a.fingerprint != b.fingerprint
    assert a.key_path.read_bytes() != b.key_path.read_bytes()


def test_identity_is_a_frozen_record(tmp_path: Path) -> None:
    ident = load_or_create(tmp_path, "node")
    with pytest.raises(AttributeError):
        ident.fingerprint = "0" * 64  # type: ignore[misc]


@pytest.mark.parametrize("name", ["", "n" * 200, "ünïcode node"])
def test_any_node_name_makes_a_certificate(tmp_path: Path, name: str) -> None:
    ident = load_or_create(tmp_path, name)
    assert server_context(ident) is not None


def test_a_crash_between_key_and_certificate_keeps_the_key(tmp_path: Path) -> None:
    first = load_or_create(tmp_path, "node")
    key = first.key_path.read_bytes()
    first.cert_path.unlink()  # as if the process died after publishing the key
    second = load_or_create(tmp_path, "node")
    assert second.key_path.read_bytes() == key
    assert second.fingerprint == _der_fingerprint(second.cert_path)


def test_racing_first_starts_agree_on_one_identity(tmp_path: Path) -> None:
    config = tmp_path / "shared"
    barrier = threading.Barrier(4)
    got: list[Identity] = []

    def start() -> None:
        barrier.wait()
        got.append(load_or_create(config, "node"))

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(got) == 4 and len({i.fingerprint for i in got}) == 1
    assert got[0].fingerprint == _der_fingerprint(config / CERT_FILE)
    assert sorted(p.name for p in config.iterdir()) == [CERT_FILE, KEY_FILE]


def test_a_certificate_without_its_key_is_refused(tmp_path: Path) -> None:
    load_or_create(tmp_path, "node").key_path.unlink()
    with pytest.raises(TLSError, match="does not"):
        load_or_create(tmp_path, "node")


def test_a_key_from_another_identity_is_refused(tmp_path: Path) -> None:
    a = load_or_create(tmp_path / "a", "node")
    b = load_or_create(tmp_path / "b", "node")
    b.key_path.unlink()
    b.key_path.write_bytes(a.key_path.read_bytes())
    b.key_path.chmod(0o600)
    with pytest.raises(TLSError, match="does not belong"):
        load_or_create(tmp_path / "b", "node")


def test_a_key_others_can_read_is_refused(tmp_path: Path) -> None:
    load_or_create(tmp_path, "node").key_path.chmod(0o644)
    with pytest.raises(TLSError, match="chmod 600"):
        load_or_create(tmp_path, "node")


def test_a_garbled_key_is_refused(tmp_path: Path) -> None:
    ident = load_or_create(tmp_path, "node")
    ident.cert_path.unlink()
    ident.key_path.write_text("not a key")
    with pytest.raises(TLSError, match="not a readable private key"):
        load_or_create(tmp_path, "node")


def test_a_config_dir_that_cannot_be_made_is_a_tls_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(TLSError, match="cannot store"):
        load_or_create(tmp_path / "file" / "sub", "node")


def test_contexts_speak_tls_1_2_or_later_and_the_client_trusts_by_pin_only(
    tmp_path: Path,
) -> None:
    server = server_context(load_or_create(tmp_path, "node"))
    client = client_context()
    assert server.minimum_version == client.minimum_version == ssl.TLSVersion.TLSv1_2
    assert client.verify_mode == ssl.CERT_NONE and not client.check_hostname


@asynccontextmanager
async def _tls_echo(ident: Identity) -> AsyncIterator[int]:
    """A loopback TLS echo server that serves `ident`: its port."""

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(await reader.readline())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0, ssl=server_context(ident))
    async with server:  # closes it and waits for it on the way out
        yield server.sockets[0].getsockname()[1]


@asynccontextmanager
async def _tls_echo_client(ident: Identity) -> AsyncIterator[Connection]:
    """A first-contact client (no pin yet) connected to `_tls_echo(ident)`: (reader, writer)."""
    async with _tls_echo(ident) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_context())
        try:
            yield reader, writer
        finally:
            writer.close()
            await writer.wait_closed()


async def test_a_client_sees_the_identity_it_was_told_to_pin(tmp_path: Path) -> None:
    ident = load_or_create(tmp_path / "server", "prefill")
    other = load_or_create(tmp_path / "other", "impostor")
    async with _tls_echo_client(ident) as (reader, writer):
        ssl_object = writer.get_extra_info("ssl_object")
        assert ssl_object.version() in ("TLSv1.2", "TLSv1.3")
        assert peer_fingerprint(ssl_object) == ident.fingerprint
        assert check_peer(ssl_object, ident.fingerprint) == ident.fingerprint
        pretty = ":".join(ident.fingerprint[i : i + 2] for i in range(0, 64, 2)).upper()
        assert check_peer(ssl_object, pretty) == ident.fingerprint
        with pytest.raises(TLSError, match="not the pinned"):
            check_peer(ssl_object, other.fingerprint)
        with pytest.raises(TLSError, match="not a hex SHA-256"):
            check_peer(ssl_object, "deadbeef")
        writer.write(b"private prompt\n")
        assert await reader.readline() == b"private prompt\n"


async def test_an_impostor_on_the_same_port_is_told_apart(tmp_path: Path) -> None:
    real = load_or_create(tmp_path / "real", "prefill")
    impostor = load_or_create(tmp_path / "impostor", "prefill")
    async with _tls_echo_client(impostor) as (_, writer):
        with pytest.raises(TLSError, match="not the node that proved"):
            check_peer(writer.get_extra_info("ssl_object"), real.fingerprint)


async def test_a_plain_connection_has_no_fingerprint() -> None:
    with pytest.raises(TLSError, match="not a TLS connection"):
        peer_fingerprint(None)
    with pytest.raises(TLSError, match="not a TLS connection"):
        check_peer(None, "0" * 64)


async def test_aiohttp_serves_with_these_contexts_and_pins_every_connection(
    tmp_path: Path,
) -> None:
    ident = load_or_create(tmp_path / "node", "node")
    other = load_or_create(tmp_path / "other", "node")

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_context(ident))
    await site.start()
    url = f"https://127.0.0.1:{runner.addresses[0][1]}/health"
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(url, ssl=client_context()) as resp:  # first contact
                assert await resp.json() == {"status": "ok"}
            async with session.get(url, ssl=aiohttp_pin(ident.fingerprint)) as resp:
                assert await resp.json() == {"status": "ok"}
            with pytest.raises(aiohttp.ServerFingerprintMismatch):
                async with session.get(url, ssl=aiohttp_pin(other.fingerprint)):
                    pass
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                async with session.get(url):  # default verification: self-signed is no CA
                    pass
    finally:
        await runner.cleanup()


def test_aiohttp_pin_takes_the_fingerprint_as_shown_and_refuses_junk(tmp_path: Path) -> None:
    fp = load_or_create(tmp_path, "node").fingerprint
    pretty = ":".join(fp[i : i + 2] for i in range(0, 64, 2)).upper()
    assert aiohttp_pin(pretty).fingerprint == bytes.fromhex(fp)
    with pytest.raises(TLSError, match="not a hex SHA-256"):
        aiohttp_pin("sha1:" + "0" * 40)


async def test_a_client_given_the_certificate_file_checks_the_names_it_was_made_for(
    tmp_path: Path,
) -> None:
    """What an OpenAI client on the LAN does: trust this one certificate (`verify=cert.pem`)
    and check the name it dialled against the certificate's alternative names."""
    ident = load_or_create(tmp_path, "decode", ["localhost", "127.0.0.1", "0.0.0.0", "bad_name!"])
    trusting = ssl.create_default_context(cafile=str(ident.cert_path))
    async with _tls_echo(ident) as port:
        for host in ("localhost", "127.0.0.1"):
            _, writer = await asyncio.open_connection(host, port, ssl=trusting)
            writer.close()
            await writer.wait_closed()
        with pytest.raises(ssl.SSLCertVerificationError):  # a name it was not made for
            await asyncio.open_connection("127.0.0.1", port, ssl=trusting, server_hostname="x.lan")
        with pytest.raises(ssl.SSLCertVerificationError):  # and nothing else is trusted
            await asyncio.open_connection("127.0.0.1", port, ssl=ssl.create_default_context())
