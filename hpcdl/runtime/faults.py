"""Fault injection, to prove that failures end the job promptly and nothing saved is lost.

Set ``HPCDL_FAULT=RANK:STEP:KIND`` (several separated by commas) and rank RANK misbehaves just
before optimizer step STEP (counted from 1 over the whole run; ``A-B`` means every step from A to
B inclusive, e.g. ``1:3-9:nan``):

    exception  raise a RuntimeError                kill     SIGKILL itself (a crashed node)
    stop       SIGSTOP itself (a frozen process)    hang     its main thread blocks forever while
    oom        raise MemoryError (out of memory)             the process stays alive (a hung
    nan        make its loss NaN (non-finite)                data loader, file system or GPU)
    exit       exit(3) without a word               term     send itself SIGTERM (preemption)
    usr1       send itself SIGUSR1 (Slurm's notice before the time limit)
    killsave   SIGKILL itself half-way through writing the checkpoint of step STEP (rank 0 writes)

The same syntax is accepted by ``python -m hpcdl.train`` under any launcher; a malformed value,
or one naming a rank the job does not have, is a usage error (exit 2), never silently ignored.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from hpcdl.runtime.errors import UsageError

KINDS = ("exception", "kill", "stop", "hang", "oom", "nan", "exit", "term", "usr1", "killsave")
ENV = "HPCDL_FAULT"


class FaultSpecError(UsageError):
    """HPCDL_FAULT cannot be understood (the message says which entry and why)."""


@dataclass(frozen=True)
class Fault:
    rank: int
    first_step: int
    last_step: int
    kind: str

    def at(self, step: int) -> bool:
        return self.first_step <= step <= self.last_step


def _steps(text: str) -> tuple[int, int]:
    first, _, last = text.partition("-")
    low, high = int(first), int(last or first)
    if low < 1 or high < low:
        raise ValueError(text)
    return low, high


def parse(spec: str | None) -> list[Fault]:
    """Faults from the HPCDL_FAULT syntax; FaultSpecError on a malformed entry."""
    faults = []
    for entry in filter(None, (part.strip() for part in (spec or "").split(","))):
        try:
            rank, steps, kind = entry.split(":")
            first, last = _steps(steps)
            fault = Fault(int(rank), first, last, kind.strip().lower())
        except ValueError as exc:
            raise FaultSpecError(
                f"{ENV} entry {entry!r} is not RANK:STEP:KIND (STEP a number >= 1 or a range A-B)"
            ) from exc
        if fault.rank < 0:
            raise FaultSpecError(f"{ENV} entry {entry!r} names a negative rank")
        if fault.kind not in KINDS:
            raise FaultSpecError(f"{ENV} kind {fault.kind!r} is not one of {', '.join(KINDS)}")
        faults.append(fault)
    return faults


def check(spec: str | None, world_size: int) -> list[Fault]:
    """All faults of ``spec``, refusing ranks outside the job (a test that injects nothing proves nothing)."""
    faults = parse(spec)
    for fault in faults:
        if fault.rank >= world_size:
            raise FaultSpecError(f"{ENV} names rank {fault.rank} but the job has {world_size} rank(s)")
        if fault.kind == "killsave" and fault.rank != 0:
            raise FaultSpecError(f"{ENV} kind killsave needs rank 0 (the rank that writes checkpoints)")
    return faults


class FaultInjector:
    """The faults of one rank, asked at the few places where they can strike."""

    def __init__(self, rank: int, spec: str | None = None, world_size: int | None = None) -> None:
        spec = os.environ.get(ENV) if spec is None else spec
        faults = parse(spec) if world_size is None else check(spec, world_size)
        self.rank = rank
        self.faults = [f for f in faults if f.rank == rank]

    def _due(self, step: int, kinds: tuple[str, ...]) -> list[Fault]:
        return [f for f in self.faults if f.kind in kinds and f.at(step)]

    def announce(self, kind: str, step: int) -> None:
        """One line with the wall-clock time, so tests can measure how fast the job ended."""
        print(f"hpcdl: injecting fault {kind!r} on rank {self.rank} at step {step} (t={time.time():.3f})",
              flush=True)

    def poison_loss(self, step: int) -> bool:
        """True when this rank should make its loss NaN at ``step``."""
        due = bool(self._due(step, ("nan",)))
        if due:
            self.announce("nan", step)
        return due

    def before_step(self, step: int) -> None:
        """Misbehave as configured for ``step``."""
        for fault in self._due(step, ("exception", "oom", "exit", "kill", "stop", "term", "usr1", "hang")):
            self.announce(fault.kind, step)
            message = f"injected fault on rank {fault.rank} at step {step}"
            if fault.kind == "exception":
                raise RuntimeError(message)
            if fault.kind == "oom":
                raise MemoryError(message)
            if fault.kind == "exit":
                os._exit(3)
            if fault.kind == "hang":
                while True:  # alive (its threads run) but the training loop never comes back
                    time.sleep(3600)
            sig = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM,
                   "usr1": signal.SIGUSR1}[fault.kind]
            os.kill(os.getpid(), sig)

    def while_saving(self, step: int):
        """A hook for :func:`hpcdl.persistence.checkpoint_files.save`, or None: SIGKILL half-way through the write."""
        if not self._due(step, ("killsave",)):
            return None

        def kill_half_way(temporary: Path) -> None:
            self.announce("killsave", step)
            with open(temporary, "r+b") as handle:
                handle.truncate(max(1, temporary.stat().st_size // 2))
                handle.flush()
                os.fsync(handle.fileno())
            os.kill(os.getpid(), signal.SIGKILL)

        return kill_half_way
