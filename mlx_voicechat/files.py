"""File-system helpers shared by every writer (bottom layer: imports nothing of this package)."""

from __future__ import annotations

import os


def current_umask() -> int:
    """The process umask, read without changing it where the OS allows (``os.umask`` sets it
    for every thread while it is read)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask
