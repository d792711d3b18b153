"""What the machine says about itself, read without heavy imports."""

from __future__ import annotations

from pathlib import Path


def available_memory() -> int | None:
    """Bytes of memory available to start new work (Linux's MemAvailable), or None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
