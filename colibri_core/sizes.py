"""Sizes in bytes: reading "2GB" / "1.5GiB", printing them, and the memory the machine has free."""
from __future__ import annotations

import re
from pathlib import Path

from .errors import ColibriError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like "512MB", "2GB", "1.5GiB"."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(size))
    if not m or m.group(2).lower() not in _UNITS:
        raise ColibriError(f"cannot read size {size!r}: use bytes or a number with KB, MB, GB, GiB, …")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def available_memory() -> int:
    """MemAvailable from /proc/meminfo (bytes), or 8 GB where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 10**9
