"""Stall watchdog: end the job when no training step completes for too long.

A rank that dies is noticed by the launcher; a rank that freezes (a stuck file system, a hung
data loader or GPU) is noticed by nobody: the others wait for it forever inside an allreduce,
burning the allocation. Each rank runs a thread that

* on ranks > 0, sends a small heartbeat to rank 0 every ``interval`` seconds (the thread runs
  while the main thread is blocked in a collective; a frozen process sends nothing);
* on rank 0, records when it last heard from each rank, and if no step has completed for
  ``timeout`` seconds, names the ranks that went silent and calls MPI_Abort, ending every rank;
* on ranks > 0, aborts by itself a little later if rank 0 did not (rank 0 may be the frozen one).

Heartbeats travel on a duplicate of the world communicator, so they never mix with training traffic.
"""

from __future__ import annotations

import sys
import threading
import time

HEARTBEAT_TAG = 7011


class StallWatchdog:
    def __init__(self, comm, timeout: float, interval: float | None = None) -> None:
        self.comm = comm.Dup()  # collective: every rank constructs its watchdog at the same point
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.timeout = timeout
        self.interval = interval if interval is not None else max(0.2, min(5.0, timeout / 5))
        self.grace = max(10.0, timeout / 2)
        self.last_progress = time.monotonic()
        self.step = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpcdl-watchdog", daemon=True)

    def start(self) -> "StallWatchdog":
        if self.timeout > 0:
            self.last_progress = time.monotonic()
            self._thread.start()
        return self

    def beat(self, step: int | None = None) -> None:
        """Record progress (a completed step, an evaluated batch, a written checkpoint)."""
        self.last_progress = time.monotonic()
        if step is not None:
            self.step = step

    def stop(self) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval + 1)

    def _abort(self, message: str) -> None:
        print(f"hpcdl: {message}; ending the job", file=sys.stderr, flush=True)
        self.comm.Abort(3)

    def _run(self) -> None:
        from mpi4py import MPI

        last_heard = {rank: time.monotonic() for rank in range(1, self.size)}
        pending = None
        status = MPI.Status()
        while not self._done.wait(self.interval):
            now = time.monotonic()
            stalled = now - self.last_progress
            if self.rank == 0:
                while self.comm.iprobe(source=MPI.ANY_SOURCE, tag=HEARTBEAT_TAG, status=status):
                    source = status.Get_source()
                    self.comm.recv(source=source, tag=HEARTBEAT_TAG)
                    last_heard[source] = now
                if stalled > self.timeout:
                    silent = sorted(r for r, t in last_heard.items() if now - t > 3 * self.interval)
                    who = (
                        f"rank {', '.join(map(str, silent))} went silent "
                        f"(no heartbeat for {max(now - last_heard[r] for r in silent):.0f} s)"
                        if silent
                        else "every rank is alive but none progresses (a hung collective or data loader)"
                    )
                    self._abort(f"stall: no training step completed for {stalled:.0f} s (step {self.step}); {who}")
            else:
                if pending is None or pending.Test():
                    pending = self.comm.isend(self.step, dest=0, tag=HEARTBEAT_TAG)
                if stalled > self.timeout + self.grace:
                    self._abort(
                        f"stall: rank {self.rank} completed no step for {stalled:.0f} s and rank 0 did not end "
                        "the job; rank 0 may be the rank that froze"
                    )
