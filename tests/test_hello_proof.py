"""Issue 19 item 2: hello v2 proofs: each side's, over every field, unambiguous."""

from __future__ import annotations

import hmac
from hashlib import sha256

import pytest
from tandem.nodes.trust.signing import hello_proof, verify_hello_proof

from tests.test_signing import TOKEN, A, B

# hello v2 -------------------------------------------------------------------------------------

HELLO = dict(
    caller_nonce="c0" * 16,
    callee_nonce="e1" * 16,
    caller_id=A,
    callee_id=B,
    model_fingerprint="m" * 64,
    cert_fingerprint="f" * 64,
    address="127.0.0.1:8470",
)


def _proof(role: str = "callee", token: str = TOKEN, **over: str) -> str:
    return hello_proof(token, role, **{**HELLO, **over})  # type: ignore[arg-type]


@pytest.mark.parametrize("role", ["caller", "callee"])
def test_a_hello_proof_verifies_for_its_own_fields(role: str) -> None:
    proof = _proof(role)
    assert len(proof) == 64 and int(proof, 16) >= 0
    assert verify_hello_proof(TOKEN, role, **HELLO, proof=proof)  # type: ignore[arg-type]


def test_the_callers_proof_is_not_the_callees() -> None:
    caller = _proof("caller")
    assert caller != _proof("callee")
    assert not verify_hello_proof(TOKEN, "callee", **HELLO, proof=caller)  # type: ignore[arg-type]


@pytest.mark.parametrize("field", list(HELLO))
def test_every_hello_field_is_covered(field: str) -> None:
    proof = _proof()
    changed = {**HELLO, field: HELLO[field] + "0"}
    assert not verify_hello_proof(TOKEN, "callee", **changed, proof=proof)  # type: ignore[arg-type]


def test_swapped_nonces_or_ids_do_not_verify() -> None:
    proof = _proof()
    swapped = {
        **HELLO,
        "caller_nonce": HELLO["callee_nonce"],
        "callee_nonce": HELLO["caller_nonce"],
    }
    assert not verify_hello_proof(TOKEN, "callee", **swapped, proof=proof)  # type: ignore[arg-type]
    swapped = {**HELLO, "caller_id": B, "callee_id": A}
    assert not verify_hello_proof(TOKEN, "callee", **swapped, proof=proof)  # type: ignore[arg-type]


def test_a_proof_for_another_certificate_does_not_verify() -> None:
    # a relay presents its own certificate: the real node's proof names the real one
    proof = _proof(cert_fingerprint="a" * 64)
    assert not verify_hello_proof(TOKEN, "callee", **HELLO, proof=proof)  # type: ignore[arg-type]


def test_a_wrong_token_or_a_junk_proof_does_not_verify() -> None:
    args = dict(HELLO)
    assert not verify_hello_proof("other", "callee", **args, proof=_proof())  # type: ignore[arg-type]
    for junk in (None, 42, "", _proof().upper(), "é" * 64, _proof()[:-1]):
        assert not verify_hello_proof(TOKEN, "callee", **args, proof=junk)  # type: ignore[arg-type]


def test_an_unknown_role_is_refused() -> None:
    with pytest.raises(ValueError, match="role"):
        _proof("relay")


def _old_proof(nonce: str, caller: str, own_id: str, fingerprint: str) -> str:
    """The hello proof before issue 19, fields joined with newlines."""
    msg = "\n".join((nonce, caller, own_id, fingerprint)).encode()
    return hmac.new(TOKEN.encode(), msg, sha256).hexdigest()


def test_the_old_newline_ambiguity_is_gone() -> None:
    # issue 19: with "\n" joins these two hellos had the same proof
    n = "ab" * 16
    old_a = _old_proof(n + "\ncallerA", "B", "callee", "fp")
    old_b = _old_proof(n, "callerA\nB", "callee", "fp")
    assert old_a == old_b
    new_a = _proof(caller_nonce=n + "\ncallerA", caller_id="B")
    new_b = _proof(caller_nonce=n, caller_id="callerA\nB")
    assert new_a != new_b
    # and neighbouring fields cannot trade characters either
    assert _proof(caller_id="ab", callee_id="c") != _proof(caller_id="a", callee_id="bc")
    assert _proof(model_fingerprint="m1", cert_fingerprint="") != _proof(
        model_fingerprint="m", cert_fingerprint="1"
    )
