"""Sizes and link rates as users type them (DESIGN.md "Units")."""

from __future__ import annotations

import pytest
from tandem.nodes.contract.units import format_bytes, gbps_to_Bps, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MiB", 512 * 2**20),
        ("12GiB", 12 * 2**30),
        ("2GB", 2 * 10**9),
        ("1000", 1000),
        ("1000B", 1000),
        ("4KiB", 4096),
        ("4kb", 4000),
        ("1.5GiB", 3 * 2**29),
        (" 64 MiB ", 64 * 2**20),
        ("1TiB", 2**40),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


def test_binary_and_decimal_units_differ() -> None:
    assert parse_size("1GiB") - parse_size("1GB") == 2**30 - 10**9


@pytest.mark.parametrize("text", ["", "GiB", "abc", "-1GiB", "12XB", "1.5.5GiB", "12 Gib s"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


def test_gbps_is_bits_not_bytes() -> None:
    assert gbps_to_Bps(1) == 125e6
    assert gbps_to_Bps(10) == 1.25e9


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (3 * 2**30, "3.0 GiB"), (2**41, "2.0 TiB")],
)
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text
