"""Issue 19 item 1: signed node-to-node requests (refusals, replay, relay, tamper, window edges,
nonce memory, the canonical query)."""

from __future__ import annotations

import time

import pytest
from multidict import CIMultiDict
from tandem.nodes.trust.signing import (
    CALLEE,
    CALLER,
    NONCE,
    SIGNATURE,
    SIGNED_HEADERS,
    TIME,
    WINDOW_S,
    SignatureError,
    Verifier,
    canonical_query,
    new_nonce,
    sign,
)
from yarl import URL

TOKEN = "cluster-token-Zq8Vt3yQ1sLkR7wXc5mN"
A, B, C = "caller-a", "callee-b", "callee-c"
T0 = 1_700_000_000
PATH, QUERY, BODY = "/v1/prefill", {"since": "12.5"}, b'{"proto":1,"tokens":[1,2,3]}'


def _signed(now: float = T0, **over: object) -> dict[str, str]:
    args: dict[str, object] = dict(
        token=TOKEN, method="POST", path=PATH, query=QUERY, body=BODY, caller=A, callee=B
    )
    args.update(over)
    return sign(now=now, **args)  # type: ignore[arg-type]


def _refused(verifier: Verifier, headers: dict[str, str], now: float = T0, **over: object) -> str:
    """The refusal's message; it must never carry the token."""
    req: dict[str, object] = dict(method="POST", path=PATH, query=QUERY, body=BODY)
    req.update(over)
    with pytest.raises(SignatureError) as info:
        verifier.verify(headers=headers, now=now, **req)  # type: ignore[arg-type]
    message = str(info.value)
    assert TOKEN not in message and "Zq8V" not in message
    return message


def _ok(verifier: Verifier, headers: dict[str, str], now: float = T0) -> str:
    return verifier.verify("POST", PATH, QUERY, BODY, headers, now=now)


# signed requests: the happy path -------------------------------------------------------------


def test_a_signed_request_verifies_and_names_its_caller() -> None:
    headers = _signed()
    assert set(headers) == set(SIGNED_HEADERS)
    assert headers[CALLER] == A and headers[CALLEE] == B and headers[TIME] == str(T0)
    assert len(headers[NONCE]) == 32 and len(headers[SIGNATURE]) == 64
    assert _ok(Verifier(TOKEN, B), headers) == A


def test_the_token_travels_in_no_header() -> None:
    headers = _signed()
    assert "Authorization" not in headers
    assert not any(TOKEN in v or "Zq8V" in v for v in headers.values())
    assert TOKEN not in repr(Verifier(TOKEN, B))


def test_every_signature_has_a_fresh_nonce() -> None:
    a, b = _signed(), _signed()
    assert a[NONCE] != b[NONCE] and a[SIGNATURE] != b[SIGNATURE]
    assert len({new_nonce() for _ in range(100)}) == 100


def test_headers_are_looked_up_case_insensitively() -> None:
    verifier = Verifier(TOKEN, B)
    assert _ok(verifier, {k.lower(): v for k, v in _signed().items()}) == A
    assert _ok(verifier, CIMultiDict(_signed())) == A  # what aiohttp hands a handler


def test_the_method_is_signed_in_upper_case() -> None:
    verifier = Verifier(TOKEN, B)
    assert verifier.verify("post", PATH, QUERY, BODY, _signed(), now=T0) == A


def test_an_empty_token_cannot_sign_or_verify() -> None:
    with pytest.raises(ValueError):
        _signed(token="")
    with pytest.raises(ValueError):
        Verifier("", B)


# refusals -------------------------------------------------------------------------------------


@pytest.mark.parametrize("header", SIGNED_HEADERS)
def test_a_missing_header_is_refused_by_name(header: str) -> None:
    headers = _signed()
    del headers[header]
    assert header in _refused(Verifier(TOKEN, B), headers)


def test_no_headers_at_all_names_them_all() -> None:
    message = _refused(Verifier(TOKEN, B), {"Authorization": f"Bearer {TOKEN}"})
    assert all(h in message for h in SIGNED_HEADERS)


def test_a_header_given_twice_is_refused() -> None:
    headers = CIMultiDict(_signed())
    headers.add(NONCE, new_nonce())
    with pytest.raises(SignatureError, match="more than once"):
        Verifier(TOKEN, B).verify("POST", PATH, QUERY, BODY, headers, now=T0)


@pytest.mark.parametrize(
    ("header", "value"),
    [
        (NONCE, "zz" * 16),
        (NONCE, "ab" * 8),
        (NONCE, "AB" * 16),
        (SIGNATURE, "g" * 64),
        (SIGNATURE, "ab" * 16),
        (SIGNATURE, " " + "a" * 63),
        (TIME, "soon"),
        (TIME, "-5"),
        (TIME, "1700000000.5"),
        (TIME, "١٧٠٠٠٠٠٠٠٠"),  # Arabic-Indic digits: int() takes them, the check must not
        (CALLER, ""),
        (CALLER, "x" * 300),
    ],
)
def test_malformed_headers_are_refused(header: str, value: str) -> None:
    headers = _signed()
    headers[header] = value
    assert header in _refused(Verifier(TOKEN, B), headers)


def test_a_wrong_token_is_refused() -> None:
    headers = _signed(token="some-other-token")
    assert "does not verify" in _refused(Verifier(TOKEN, B), headers)
    assert "does not verify" in _refused(Verifier("some-other-token", B), _signed())


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("method", "PUT"),
        ("path", "/v1/prefill/"),
        ("path", "/v1/cluster"),
        ("query", {"since": "12.6"}),
        ("query", {"since": "12.5", "extra": ""}),
        ("query", None),
        ("body", BODY.replace(b"3", b"4")),
        ("body", BODY + b" "),
        ("body", b""),
    ],
)
def test_a_tampered_request_is_refused(field: str, value: object) -> None:
    verifier = Verifier(TOKEN, B)
    headers = _signed()
    assert "does not verify" in _refused(verifier, headers, **{field: value})
    assert _ok(verifier, headers) == A  # a refused request used up nothing


@pytest.mark.parametrize(
    ("header", "value"),
    [(CALLER, "caller-z"), (TIME, str(T0 + 1)), (NONCE, "0" * 32), (SIGNATURE, "0" * 64)],
)
def test_a_tampered_header_is_refused(header: str, value: str) -> None:
    headers = _signed()
    headers[header] = value
    assert "does not verify" in _refused(Verifier(TOKEN, B), headers)


def test_refused_requests_never_fill_the_nonce_memory() -> None:
    verifier = Verifier(TOKEN, B)
    for _ in range(50):
        _refused(verifier, _signed(token="guess"))
        _refused(verifier, _signed(), body=b"forged")
    assert len(verifier) == 0


# replay and relay -----------------------------------------------------------------------------


def test_a_replay_is_refused_while_the_window_lasts_and_stale_after() -> None:
    verifier = Verifier(TOKEN, B)
    headers = _signed()
    assert _ok(verifier, headers) == A
    assert "already used" in _refused(verifier, headers)
    assert "already used" in _refused(verifier, headers, now=T0 + WINDOW_S)
    assert "outside" in _refused(verifier, headers, now=T0 + WINDOW_S + 1)


def test_a_relay_to_the_node_it_was_meant_for_gets_one_use() -> None:
    verifier = Verifier(TOKEN, B)
    headers = _signed()
    assert _ok(verifier, dict(headers)) == A  # the relay forwards it unchanged: the real call
    assert "already used" in _refused(verifier, dict(headers))  # and cannot use it again


def test_a_relay_to_another_callee_is_refused() -> None:
    elsewhere = Verifier(TOKEN, C)
    headers = _signed()
    assert "signed for node" in _refused(elsewhere, headers)
    headers[CALLEE] = C  # rewriting the callee header does not help: C checks against C
    assert "does not verify" in _refused(elsewhere, headers)
    assert _ok(Verifier(TOKEN, B), _signed()) == A


def test_ids_cannot_trade_characters_across_the_field_boundary() -> None:
    headers = _signed(caller="ab", callee="c")
    headers[CALLER], headers[CALLEE] = "a", "bc"
    assert "does not verify" in _refused(Verifier(TOKEN, "bc"), headers)


# window edges ---------------------------------------------------------------------------------


@pytest.mark.parametrize("skew", [-WINDOW_S, -WINDOW_S + 0.5, 0, WINDOW_S - 0.5, WINDOW_S])
def test_times_inside_the_window_are_accepted(skew: float) -> None:
    assert _ok(Verifier(TOKEN, B), _signed(), now=T0 + skew) == A


@pytest.mark.parametrize("skew", [-WINDOW_S - 1, -WINDOW_S - 0.5, WINDOW_S + 0.5, WINDOW_S + 1])
def test_times_outside_the_window_are_refused(skew: float) -> None:
    assert "outside" in _refused(Verifier(TOKEN, B), _signed(), now=T0 + skew)


def test_the_window_is_configurable() -> None:
    assert "outside ±5 s" in _refused(Verifier(TOKEN, B, window_s=5), _signed(), now=T0 + 6)
    assert _ok(Verifier(TOKEN, B, window_s=5), _signed(), now=T0 + 5) == A


def test_sign_truncates_fractional_seconds() -> None:
    assert _signed(now=T0 + 0.99)[TIME] == str(T0)


# the nonce memory -----------------------------------------------------------------------------


def test_the_nonce_memory_is_bounded_and_forgetting_fails_closed() -> None:
    verifier = Verifier(TOKEN, B, max_nonces=4)
    now = T0 + 9
    sent = [_signed(now=T0 + i) for i in range(10)]
    for headers in sent:
        assert _ok(verifier, headers, now=now) == A
    assert len(verifier) == 4 and verifier.floor == T0 + 5
    assert "already forgotten" in _refused(verifier, sent[0], now=now)  # forgotten, still refused
    assert "already used" in _refused(verifier, sent[9], now=now)
    assert "already forgotten" in _refused(verifier, _signed(now=T0 + 5), now=now)  # retry later
    assert _ok(verifier, _signed(now=T0 + 6), now=now) == A
    assert len(verifier) == 4


def test_nonces_are_forgotten_once_their_time_leaves_the_window() -> None:
    verifier = Verifier(TOKEN, B)
    old = [_signed() for _ in range(3)]
    for headers in old:
        _ok(verifier, headers)
    assert len(verifier) == 3
    later = T0 + WINDOW_S + 1
    assert _ok(verifier, _signed(now=later), now=later) == A
    assert len(verifier) == 1 and verifier.floor == T0
    assert "outside" in _refused(verifier, old[0], now=later)
    # a clock stepped back does not bring the forgotten nonces back to life
    assert "already forgotten" in _refused(verifier, old[0], now=T0 + 20)


def test_many_requests_stay_within_the_default_bound() -> None:
    verifier = Verifier(TOKEN, B, max_nonces=256)
    for i in range(2000):
        _ok(verifier, _signed(now=T0 + i // 50), now=T0 + i // 50)
    assert len(verifier) <= 256


# the canonical query --------------------------------------------------------------------------


def test_query_order_and_form_do_not_matter() -> None:
    headers = _signed(query={"b": "2", "a": "1 x"})
    verifier = Verifier(TOKEN, B)
    assert verifier.verify("POST", PATH, "a=1+x&b=2", BODY, headers, now=T0) == A
    assert "already used" in _refused(verifier, headers, query=URL("/p?b=2&a=1%20x").query)


def test_repeated_keys_are_all_signed() -> None:
    query = URL("/p?a=2&a=1").query  # a multidict: both pairs count
    assert canonical_query(query) == "a=1&a=2" == canonical_query([("a", "1"), ("a", "2")])
    headers = _signed(query=query)
    assert "does not verify" in _refused(Verifier(TOKEN, B), headers, query={"a": "1"})


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ({"a": "1&b=2"}, {"a": "1", "b": "2"}),
        ({"a=b": "c"}, {"a": "b=c"}),
        ({"k": "ü"}, {"k": "%C3%BC"}),
        ({"": "a"}, {"a": ""}),
    ],
)
def test_the_canonical_query_is_unambiguous(one: dict[str, str], other: dict[str, str]) -> None:
    assert canonical_query(one) != canonical_query(other)


def test_the_canonical_query_escapes_everything_but_unreserved() -> None:
    assert canonical_query({"since": "12.5", "q": "a b/c~_-"}) == "q=a%20b%2Fc~_-&since=12.5"
    assert canonical_query(None) == canonical_query("") == canonical_query({}) == ""


@pytest.mark.parametrize("wrong", ["callee", "time"])
async def test_a_signed_request_fails_on_its_headers_before_its_body_is_read(wrong: str) -> None:
    """Issue 47 item 4: a signature for another node, or a stale one, is refused on its
    headers alone: the body (up to 1 MiB a stranger could dribble) is never read."""
    from aiohttp.test_utils import make_mocked_request
    from tandem.nodes.contract.http import ApiError
    from tandem.nodes.trust.auth import Gate

    token, own = "a-cluster-token-0123456789", "callee-node"
    callee = "another-node" if wrong == "callee" else own
    now = time.time() - (3600 if wrong == "time" else 0)
    headers = sign(token, "POST", "/v1/prefill", {}, b"{}", "caller-node", callee, now)
    request = make_mocked_request("POST", "/v1/prefill", headers=headers)

    async def never() -> bytes:
        raise AssertionError("the body was read")

    request.read = never  # type: ignore[method-assign]
    with pytest.raises(ApiError) as e:
        await Gate(token, own).admit(request)
    assert e.value.status == 401
