"""parse_size and format_bytes: exact byte counts, and readable errors for non-sizes."""

import pytest

from runtime.sizes import format_bytes, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        (4096, 4096),
        ("0", 0),
        ("12B", 12),
        ("2KiB", 2048),
        ("24MiB", 25_165_824),
        ("256 MiB", 268_435_456),
        ("1GiB", 1_073_741_824),
        ("1.5GB", 1_500_000_000),
        ("1k", 1000),
        ("3mb", 3_000_000),
        ("  2gib ", 2 * 1024**3),
    ],
)
def test_parse_size_exact(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "not a size"),
        ("abc", "not a size"),
        ("-1", "not a size"),
        ("1.2.3MiB", "not a size"),
        ("12XB", "unknown size unit"),
    ],
)
def test_parse_size_rejects(text: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        parse_size(text)


def test_parse_size_rejects_negative_int() -> None:
    with pytest.raises(ValueError, match="negative"):
        parse_size(-1)


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(25_165_824) == "24.0 MiB"
    assert format_bytes(3 * 1024**4) == "3072.0 GiB"
