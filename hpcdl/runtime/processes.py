"""Whether a process is alive, answered once for every caller (locks, staged folders, virtual clusters)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether a process of this host has that pid (someone else's counts: it is alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True
