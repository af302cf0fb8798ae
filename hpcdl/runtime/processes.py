"""Whether a process is alive, answered once for every caller (locks, staged folders, virtual clusters), and
ending a process with everything it started (a study's training runs)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """Whether a process of this host has that pid (someone else's counts: it is alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def descendants(root: int) -> list[int]:
    """Every process below ``root`` (children, their children, ...), from /proc; [] where there is none."""
    parent_of: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent_of[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # it ended while we looked
    found, frontier = [], [root]
    while frontier:
        current = frontier.pop()
        children = [pid for pid, parent in parent_of.items() if parent == current]
        found += children
        frontier += children
    return found


def end_trees(pids: list[int], grace: float = 2.0) -> None:
    """End each of ``pids`` and every process below it: SIGTERM, then SIGKILL to whatever is left after ``grace``
    seconds. The trees are read first: Open MPI gives each rank a process group of its own, and a rank whose
    mpirun died first would be orphaned out of its tree."""
    victims = [victim for pid in pids for victim in (pid, *descendants(pid))]
    for victim in victims:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(victim, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_running(v) for v in victims):
        time.sleep(0.1)
    for victim in victims:
        if _running(victim):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(victim, signal.SIGKILL)


def _running(pid: int) -> bool:
    """Alive and not a zombie (a child that ended but was not reaped yet counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
