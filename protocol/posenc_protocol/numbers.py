"""Integers as people type them, for the server's settings and the CLI's arguments."""

from __future__ import annotations

import re
from typing import Final

# Size suffixes of integers users type: 512MiB, 1GiB, 64KiB (binary), 1MB, 2GB (decimal).
_SIZE_SUFFIXES: Final = {
    "": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_SIZE: Final = re.compile(r"^(?P<number>[0-9][0-9_]*)\s*(?P<suffix>[a-z]*)$")


def exact_integer(raw: str) -> int:
    """An integer as a user types it: ``1048576``, ``1_048_576``, ``0x100000``, ``2**20``;
    ValueError otherwise."""
    text = raw.strip().replace("_", "")
    if "**" in text:
        base, exponent = (int(part, 0) for part in text.split("**", 1))
        if not 0 <= exponent <= 64:
            raise ValueError(f"exponent must be in 0..64, got {exponent}")
        return int(base**exponent)
    return int(text, 0)


def integer(raw: str) -> int:
    """An integer setting or size (a server setting, a CLI size): what
    :func:`exact_integer` takes, or a size such as ``1MiB``; ValueError otherwise."""
    text = raw.strip().replace("_", "").lower()
    if (match := _SIZE.match(text)) and match["suffix"] in _SIZE_SUFFIXES:
        return int(match["number"]) * _SIZE_SUFFIXES[match["suffix"]]
    return exact_integer(text)
