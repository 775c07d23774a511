"""Parsing of sizes, token counts and durations as users type them ("32k", "1.5GiB", "2k,8k", "7d")."""

from __future__ import annotations

import re

from tierguard.common.errors import TierguardError

GIB = 1024**3
MIB = 1024**2
KIB = 1024

_TOKEN_SUFFIX = {"": 1, "k": 1024, "m": 1024 * 1024}
_BYTE_SUFFIX = {
    "": 1, "b": 1,
    "k": KIB, "kb": 1000, "kib": KIB,
    "m": MIB, "mb": 1000**2, "mib": MIB,
    "g": GIB, "gb": 1000**3, "gib": GIB,
    "t": 1024**4, "tb": 1000**4, "tib": 1024**4,
}


def parse_tokens(text: str, what: str = "token count") -> int:
    """Parse "2048", "2k" (=2048), "128K", "1m" into a positive token count."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", str(text))
    if not m:
        raise TierguardError(f"invalid {what} {text!r}: expected a number like 2048 or 32k")
    value = float(m.group(1)) * _TOKEN_SUFFIX[m.group(2).lower()]
    if value <= 0 or value != int(value):
        raise TierguardError(f"invalid {what} {text!r}: must be a positive whole number of tokens")
    return int(value)


def parse_token_list(text: str, what: str = "context lengths") -> list[int]:
    """Parse "2k,8k,32k" into [2048, 8192, 32768]."""
    parts = [p for p in str(text).split(",") if p.strip()]
    if not parts:
        raise TierguardError(f"invalid {what} {text!r}: expected a comma-separated list like 2k,8k")
    return [parse_tokens(p, what) for p in parts]


def parse_bytes(text: str, what: str = "size") -> int:
    """Parse "512MiB", "1.5GiB", "80G" (binary for bare K/M/G/T) into bytes (>= 0)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _BYTE_SUFFIX:
        raise TierguardError(f"invalid {what} {text!r}: expected a size like 512MiB or 1.5GiB")
    return int(float(m.group(1)) * _BYTE_SUFFIX[m.group(2).lower()])


def positive(value: float, what: str) -> float:
    """Reject zero and negative sizes with a message naming the option."""
    if value is None or value <= 0:
        raise TierguardError(f"{what} must be positive, got {value}")
    return value


_DURATION_SUFFIX = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


def parse_duration(text: str, what: str = "duration") -> float:
    """Parse "90", "90s", "15m", "2h", "7d", "1.5h" into seconds (> 0)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]?)\s*", str(text))
    if not m or m.group(2).lower() not in _DURATION_SUFFIX:
        raise TierguardError(f"invalid {what} {text!r}: expected a duration like 90s, 15m, 2h or 7d")
    seconds = float(m.group(1)) * _DURATION_SUFFIX[m.group(2).lower()]
    if seconds <= 0:
        raise TierguardError(f"invalid {what} {text!r}: must be longer than zero")
    return seconds
