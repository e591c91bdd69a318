"""Issue 19 item 4: which hosts count as loopback, and which binds therefore need a token."""

from __future__ import annotations

import socket
from collections.abc import Callable

import pytest
from tandem.nodes.trust.auth import AuthError, check_bind, is_loopback

from tests.test_signing import TOKEN

# which binds need a token (issue 19 item 4) ---------------------------------------------------

LOOPBACK = [
    "127.0.0.1",
    "127.255.255.254",
    "::1",
    "[::1]",
    "localhost",
    "::ffff:127.0.0.1",
    "127.1",
]
NOT_LOOPBACK = [
    "",
    "0.0.0.0",
    "::",
    "0",
    "[::]",
    "::ffff:0.0.0.0",
    "::ffff:192.168.1.2",
    "::127.0.0.1",  # IPv4-compatible (deprecated), not mapped: ::7f00:1 is no loopback
    "192.168.1.2",
    "10.0.0.1",
    "fe80::1",
    "[localhost]",
    "[]",
    "0127.0.0.1",  # inet_aton reads 0127 as octal 87
]


@pytest.mark.parametrize("host", LOOPBACK)
def test_loopback_hosts(host: str) -> None:
    assert is_loopback(host)
    check_bind(host, None)


@pytest.mark.parametrize("host", NOT_LOOPBACK)
def test_hosts_beyond_loopback_need_a_token(host: str) -> None:
    assert not is_loopback(host)
    with pytest.raises(AuthError, match="without a token") as info:
        check_bind(host, None)
    assert (host or '""') in str(info.value)
    with pytest.raises(AuthError):
        check_bind(host, "")  # an empty token is no token
    check_bind(host, TOKEN)


Resolver = Callable[..., list[tuple[object, ...]]]


def _resolves_to(*addresses: str) -> Resolver:
    def fake(host: str, *_: object, **__: object) -> list[tuple[object, ...]]:
        if not addresses:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [
            (socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 0))
            for a in addresses
        ]

    return fake


@pytest.mark.parametrize(
    ("addresses", "loopback"),
    [
        (("127.0.0.1",), True),
        (("127.0.0.1", "::1"), True),
        (("127.0.0.1", "192.168.1.2"), False),  # every address must be loopback
        (("::ffff:10.0.0.1",), False),
        (("0.0.0.0",), False),
        ((), False),  # unresolvable
    ],
)
def test_a_name_counts_only_if_everything_it_resolves_to_is_loopback(
    monkeypatch: pytest.MonkeyPatch, addresses: tuple[str, ...], loopback: bool
) -> None:
    monkeypatch.setattr(socket, "getaddrinfo", _resolves_to(*addresses))
    assert is_loopback("node.example") is loopback
    if not loopback:
        with pytest.raises(AuthError, match=r"refusing to listen on node\.example"):
            check_bind("node.example", None)


def test_a_name_that_empties_the_resolver_is_not_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "getaddrinfo", lambda *_a, **_k: [])
    assert not is_loopback("node.example")


def test_a_name_idna_cannot_encode_is_not_loopback() -> None:
    assert not is_loopback("a" * 64 + ".example")  # a label longer than 63: UnicodeError
