"""A node's TLS identity: a self-signed certificate made on first start, pinned by peers.

The Syncthing model: a node's identity is its certificate, named by `fingerprint` (hex
SHA-256 of the DER). Nobody verifies a CA chain or a hostname; a peer is trusted at an
address after it proved the cluster token in a hello that covers this fingerprint, and the
fingerprint is pinned from then on (`check_peer`).

Files, in the config dir given: `key.pem` (EC P-256, PKCS#8, mode 0600) and `cert.pem`.
Each is written to a temporary file and published with a hard link, which never overwrites:
a crash leaves no half-written key, and two processes starting at once agree on one identity.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import hmac
import ipaddress
import os
import re
import ssl
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path

import aiohttp
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CERT_FILE = "cert.pem"
KEY_FILE = "key.pem"
# RFC 5280 4.1.2.5: a certificate with no well-defined expiry; the pin is what is trusted
NOT_AFTER = datetime.datetime(9999, 12, 31, 23, 59, 59, tzinfo=datetime.UTC)
CLOCK_SKEW = datetime.timedelta(days=1)  # a peer whose clock is behind still parses it sanely
MAX_CN = 64  # X.520 ub-common-name
_FINGERPRINT = re.compile(r"[0-9a-f]{64}")
_HOSTNAME = re.compile(r"(?=.{1,253}$)([A-Za-z0-9-]{1,63}\.)*[A-Za-z0-9-]{1,63}\.?")


class TLSError(Exception):
    """An identity that cannot be made, read or used, or a peer that is not the one pinned."""


@dataclass(frozen=True)
class Identity:
    """Where a node's certificate and key live, and the certificate's fingerprint."""

    cert_path: Path
    key_path: Path
    fingerprint: str  # hex sha256 of the certificate's DER


def load_or_create(config_dir: Path, name: str, hosts: Sequence[str] = ()) -> Identity:
    """This node's identity from `config_dir`, made there (and the dir with it) if missing.

    `name` becomes the certificate's common name; it identifies nothing (the fingerprint
    does) and only helps a person reading the certificate. `hosts` (names and addresses)
    go in its subject alternative names when it is made, so that a client that is given
    the certificate file as its trust anchor (an OpenAI client: `verify=cert.pem`) can also
    check the name it dialled; peers never look at them.
    """
    config_dir = Path(config_dir)
    cert_path, key_path = config_dir / CERT_FILE, config_dir / KEY_FILE
    try:
        config_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not cert_path.exists():
            key = _read_key(key_path) if key_path.exists() else None
            if key is None:
                key = ec.generate_private_key(ec.SECP256R1())
                pem = key.private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                )
                if not _publish(key_path, pem, 0o600):
                    key = _read_key(key_path)  # another process made it first: use theirs
            cert = _self_signed(key, name, hosts)
            _publish(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        elif not key_path.exists():
            raise TLSError(
                f"{cert_path} exists but {key_path} does not: delete {cert_path} to make a new "
                "identity (peers that pinned the old one must pair again)"
            )
        cert = _read_cert(cert_path)
        key = _read_key(key_path)
    except OSError as e:
        raise TLSError(f"{config_dir}: cannot store the TLS identity ({e.strerror})") from None
    if cert.public_key().public_bytes(*_SPKI) != key.public_key().public_bytes(*_SPKI):
        raise TLSError(
            f"{cert_path} does not belong to {key_path}: delete both to make a new identity "
            "(peers that pinned the old one must pair again)"
        )
    if key_path.stat().st_mode & 0o077:
        raise TLSError(f"{key_path}: the private key is readable by others (chmod 600 it)")
    der = cert.public_bytes(serialization.Encoding.DER)
    return Identity(cert_path, key_path, sha256(der).hexdigest())


def server_context(identity: Identity) -> ssl.SSLContext:
    """A TLS 1.2+ server context that presents `identity`'s certificate."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(identity.cert_path, identity.key_path)
    except (OSError, ssl.SSLError) as e:
        raise TLSError(f"{identity.cert_path}: cannot serve TLS with it ({e})") from None
    return ctx


def client_context() -> ssl.SSLContext:
    """A TLS 1.2+ client context that accepts any certificate: peers are self-signed, so
    trust comes from the hello proof and the pinned fingerprint (`check_peer`), not a CA."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False  # must come before verify_mode
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def peer_fingerprint(ssl_object: ssl.SSLObject | ssl.SSLSocket | None) -> str:
    """Hex SHA-256 of the certificate the other end of a TLS connection presented."""
    if ssl_object is None:
        raise TLSError("not a TLS connection: there is no certificate to check")
    der = ssl_object.getpeercert(binary_form=True)
    if not der:
        raise TLSError("the peer presented no certificate")
    return sha256(der).hexdigest()


def check_peer(ssl_object: ssl.SSLObject | ssl.SSLSocket | None, pinned: str) -> str:
    """The peer's fingerprint if it is `pinned` (hex, any case, colons allowed), else TLSError.

    For an asyncio stream: `check_peer(writer.get_extra_info("ssl_object"), pin)`. For
    aiohttp requests use `aiohttp_pin`, which aiohttp checks on every new connection.
    """
    pin = _normal_pin(pinned)
    got = peer_fingerprint(ssl_object)
    if not hmac.compare_digest(got.encode(), pin.encode()):
        raise TLSError(
            f"the peer's certificate is {got[:16]}…, not the pinned {pin[:16]}…: "
            "it is not the node that proved the token at this address"
        )
    return got


def aiohttp_pin(pinned: str) -> aiohttp.Fingerprint:
    """`ssl=` for aiohttp requests that must reach the certificate `pinned`.

    aiohttp checks it on every new connection and raises `aiohttp.ServerFingerprintMismatch`
    otherwise (connections are pooled per pin: one object per pin, so they are reused). It
    checks only https:// URLs: on a plain http:// one it is silently ignored, so never pair
    it with one.
    """
    return _fingerprint(_normal_pin(pinned))


@functools.lru_cache(maxsize=256)
def _fingerprint(pin: str) -> aiohttp.Fingerprint:
    return aiohttp.Fingerprint(bytes.fromhex(pin))


def _normal_pin(pinned: str) -> str:
    pin = pinned.strip().lower().replace(":", "")
    if not _FINGERPRINT.fullmatch(pin):
        raise TLSError("the pinned fingerprint is not a hex SHA-256")
    return pin


_SPKI = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _alt_names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(h.strip("[]") for h in hosts if h):
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            if host.isascii() and _HOSTNAME.fullmatch(host):
                names.append(x509.DNSName(host))
            continue
        if not ip.is_unspecified:  # a wildcard bind names no address
            names.append(x509.IPAddress(ip))
    return names


def _self_signed(
    key: ec.EllipticCurvePrivateKey, name: str, hosts: Sequence[str] = ()
) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, (name or "tandem")[:MAX_CN])])
    now = datetime.datetime.now(datetime.UTC)
    builder = x509.CertificateBuilder()
    if alt := _alt_names(hosts):
        builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
    return (
        builder.subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(NOT_AFTER)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )


def _read_key(path: Path) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError) as e:
        raise TLSError(f"{path}: not a readable private key ({e})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise TLSError(f"{path}: not an EC private key")
    return key


def _read_cert(path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except ValueError as e:
        raise TLSError(f"{path}: not a readable certificate ({e})") from None


def _publish(path: Path, data: bytes, mode: int) -> bool:
    """Write `data` to `path` unless it exists; False when another writer got there first.

    The bytes go to a temporary file (created with `mode`, so a key is never readable by
    others even for a moment), are synced, then hard-linked into place: a reader sees the
    whole file or none, and an existing file is never replaced.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        _sync_dir(path.parent)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _sync_dir(path: Path) -> None:
    # the new directory entry survives a crash too (a no-op where dirs cannot be opened)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)
