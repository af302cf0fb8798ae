"""A host's cores shared among the ranks placed on it, worked out here only: the launch plan's threads per rank
(``--threads``' default), each rank's torch threads (hpcdl.runtime.world) and the placement check's share that a
rank bound to too few cores is compared with (hpcdl.runtime.placement) all read :class:`CoreShare`.

Standard library only, as the rest of the planner: it runs before a virtual environment is known.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class CoreShare:
    """``cores`` of one host shared by the ``ranks`` placed on it."""

    cores: int
    ranks: int

    @property
    def per_rank(self) -> int:
        """Each rank's whole cores, at least one (more ranks than cores then share them)."""
        return max(1, self.cores // max(1, self.ranks))

    def threads(self, given: int | None = None) -> int:
        """Threads per rank: a count the user gave (--threads, OMP_NUM_THREADS) wins, else one per core of the
        share, so that the ranks of a host do not fight over its cores."""
        return given if given else self.per_rank


def usable_cores() -> int:
    """Cores this process may run on: its affinity mask (a taskset, a job step, mpirun's binding narrow it), not
    the machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def given_threads(env: Mapping[str, str]) -> int | None:
    """The threads OMP_NUM_THREADS gives a rank (what the launch scripts' --threads and Slurm's --cpus-per-task
    set), or None where it holds no positive whole number."""
    text = env.get("OMP_NUM_THREADS", "").strip()
    return int(text) if text.isdecimal() and int(text) > 0 else None


def threads_per_rank(ranks_per_host: int, cores: int | None = None, env: Mapping[str, str] | None = None) -> int:
    """A rank's intra-op threads: OMP_NUM_THREADS where set, else its share of the cores this process may use
    (``cores``) among the ``ranks_per_host`` ranks on its host."""
    env = os.environ if env is None else env
    return CoreShare(usable_cores() if cores is None else cores, ranks_per_host).threads(given_threads(env))
