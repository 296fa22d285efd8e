"""Human-readable byte sizes: ``256MiB``, ``1.5GB``, ``4096`` (bytes).

Binary suffixes (KiB, MiB, GiB) are powers of 1024 and decimal ones (KB, MB, GB) powers of
1000, as the units say; a user who writes ``24MiB`` gets 25,165,824 bytes exactly.
"""

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse a byte size; raise ``ValueError`` with a readable message when it is not one."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative: {text}")
        return text
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (expected e.g. 256MiB, 1.5GB or 4096)")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"unknown size unit {unit!r} in {text!r} (use B, KiB, MiB, GiB, KB, MB or GB)")
    return int(float(number) * factor)


def format_bytes(num_bytes: float) -> str:
    """``25165824`` -> ``'24.0 MiB'``; exact byte counts stay available to callers that need them."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo; None where the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
