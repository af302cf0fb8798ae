"""Fault injection, to prove that failures end the job promptly and nothing saved is lost.

Set ``HPCDL_FAULT=RANK:STEP:KIND`` (several separated by commas) and rank RANK misbehaves just
before optimizer step STEP (counted from 1 over the whole run):

    exception  raise a RuntimeError            kill   SIGKILL itself (a crashed node)
    stop       SIGSTOP itself (a frozen rank)   oom    raise MemoryError (out of memory)
    nan        make its loss NaN (non-finite)   exit   exit(3) without a word
    term       send itself SIGTERM (preemption / the time limit approaching)
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

KINDS = ("exception", "kill", "stop", "oom", "nan", "exit", "term")


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    kind: str


def parse(spec: str | None) -> list[Fault]:
    """Faults from the HPCDL_FAULT syntax; ValueError on a malformed entry."""
    faults = []
    for entry in filter(None, (part.strip() for part in (spec or "").split(","))):
        try:
            rank, step, kind = entry.split(":")
            fault = Fault(int(rank), int(step), kind)
        except ValueError as exc:
            raise ValueError(f"HPCDL_FAULT entry {entry!r} is not RANK:STEP:KIND") from exc
        if fault.kind not in KINDS:
            raise ValueError(f"HPCDL_FAULT kind {fault.kind!r} is not one of {', '.join(KINDS)}")
        faults.append(fault)
    return faults


class FaultInjector:
    def __init__(self, rank: int, spec: str | None = None) -> None:
        spec = os.environ.get("HPCDL_FAULT") if spec is None else spec
        self.faults = [f for f in parse(spec) if f.rank == rank]

    def poison_loss(self, step: int) -> bool:
        """True when this rank should make its loss NaN at ``step``."""
        return any(f.step == step and f.kind == "nan" for f in self.faults)

    def before_step(self, step: int) -> None:
        """Misbehave as configured for ``step``."""
        for fault in self.faults:
            if fault.step != step:
                continue
            message = f"injected fault on rank {fault.rank} at step {step}"
            if fault.kind == "exception":
                raise RuntimeError(message)
            if fault.kind == "oom":
                raise MemoryError(message)
            if fault.kind == "exit":
                os._exit(3)
            if fault.kind in ("kill", "stop", "term"):
                sig = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}[fault.kind]
                os.kill(os.getpid(), sig)
