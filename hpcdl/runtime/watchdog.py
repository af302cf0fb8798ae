"""Stall watchdog: end the job when no training step completes for too long.

A rank that dies is noticed by the launcher; a rank that freezes (a stuck file system, a hung
data loader or GPU) is noticed by nobody: the others wait for it forever inside an allreduce,
burning the allocation. Horovod's own stall check cannot help (its coordinator blocks in MPI
too), so each rank runs a thread of ours that wakes every ``interval`` seconds and

* exchanges heartbeats with rank 0 (ranks > 0 send theirs to rank 0, rank 0 sends one to each):
  the thread runs while the main thread is blocked in a collective, and a frozen process
  (SIGSTOP, a kernel-level hang) sends nothing. A heartbeat carries the rank's last completed
  step and what its main thread is doing (its *phase*: "data", "compute", "collective", ...);
* on rank 0, when no step has completed for ``timeout`` seconds, names the culprits -- the ranks
  that went silent, or else the live ranks whose main thread is not waiting in a collective like
  the others (stuck in data loading, say) -- and calls MPI_Abort, which ends every rank;
* on ranks > 0, ends the job itself if rank 0 went silent (rank 0 may be the frozen one), and as
  a last resort ``grace`` seconds after the timeout if rank 0 did not.

Heartbeats travel on a duplicate of the world communicator, so they never mix with training
traffic. An MPI_Abort from this thread ends the job even while the main thread waits in Horovod.
A job started without MPI (torchrun, plain srun: hpcdl.runtime.coordination) sends its heartbeats
as UDP datagrams instead, which a frozen peer simply stops sending and which wait for nobody; its
abort ends this process, and the launcher or the others' failing collectives end the rest.

That thread needs the GIL, and a main thread blocked inside a C extension that did not release
it starves the thread for good. Horovod does exactly that with ``HOROVOD_DYNAMIC_PROCESS_SETS=1``:
its background thread holds the process-set table's lock through an MPI_Allgather every cycle,
and the main thread's next ``allreduce`` waits for that lock with the GIL held -- so when a peer
freezes, every Python thread of every live rank freezes too (seen with gdb). The backstop is
faulthandler's watchdog, a C thread that needs no GIL: armed ``backstop`` seconds ahead and
pushed back as progress is made, it dumps every thread's stack to stderr and exits the process
with status 1, which makes the launcher end the job.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import socket
import sys
import threading
import time
from typing import Any

from hpcdl.runtime.coordination import GlooComm

HEARTBEAT_TAG = 7011
EXIT_STALL = 3
WAITING_PHASES = ("collective",)  # a rank here waits for the others; it is not the culprit
_running: list[StallWatchdog] = []


def stop_all() -> None:
    """Stop every watchdog of this process: after an exception, an in-process caller (a notebook,
    a test) must not have a forgotten watchdog end the process later."""
    for watchdog in list(_running):
        watchdog.stop()


class StallWatchdog:
    def __init__(self, comm, timeout: float, interval: float | None = None) -> None:
        self.comm = comm.Dup()  # collective: every rank constructs its watchdog at the same point
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        # rank -> hostname, gathered while every node still answers, so that a verdict can name the
        # node a silent rank ran on (a lost node shows as all of its ranks silent at once).
        self.hosts: list[str] = list(self.comm.allgather(socket.gethostname()))
        self.heartbeats: MpiHeartbeats | UdpHeartbeats = (
            UdpHeartbeats(self.comm, self.hosts) if isinstance(self.comm, GlooComm) else MpiHeartbeats(self.comm))
        self.timeout = timeout
        self.interval = interval if interval is not None else max(0.2, min(5.0, timeout / 5))
        self.silent_after = 3 * self.interval  # no heartbeat for this long: that rank is not running
        self.grace = max(10.0, timeout / 2)
        # Later than every verdict of the Python thread, so that one speaks first when it can.
        self.backstop = timeout + self.grace + max(5.0, 2 * self.interval)
        self._armed_at = float("-inf")
        self.last_progress = time.monotonic()
        self.step = 0
        self.phase = "starting"
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpcdl-watchdog", daemon=True)

    def start(self) -> StallWatchdog:
        if self.timeout > 0:
            self.last_progress = time.monotonic()
            self._thread.start()
            self._arm_backstop(self.last_progress)
            _running.append(self)
            # Before mpi4py's own exit handler finalizes MPI (atexit runs newest first): the thread
            # must not be inside an MPI call while MPI shuts down, e.g. after a usage error.
            atexit.register(self.stop)
        return self

    def beat(self, step: int | None = None, phase: str | None = None) -> None:
        """Record progress (a completed step, an evaluated batch, a written checkpoint)."""
        self.last_progress = now = time.monotonic()
        if now - self._armed_at > 1.0:  # re-arming costs a thread start: at most once a second
            self._arm_backstop(now)
        if step is not None:
            self.step = step
        if phase is not None:
            self.phase = phase

    def _arm_backstop(self, now: float) -> None:
        if self._thread.ident is not None and not self._done.is_set():  # only a started watchdog
            self._armed_at = now
            faulthandler.dump_traceback_later(self.backstop, exit=True, file=sys.stderr)

    def stop(self) -> None:
        if not self._done.is_set() and self._armed_at > float("-inf"):
            faulthandler.cancel_dump_traceback_later()
        self._done.set()
        if self in _running:
            _running.remove(self)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval + 1)

    def _abort(self, message: str) -> None:
        if self._done.is_set():
            return  # training finished while we were deciding
        print(f"hpcdl: {message}; ending the job", file=sys.stderr, flush=True)
        self.comm.Abort(EXIT_STALL)

    def _run(self) -> None:
        start = time.monotonic()
        last_heard = {rank: start for rank in range(self.size) if rank != self.rank}
        reported: dict[int, tuple[int, str]] = {}
        while not self._done.wait(self.interval):
            now = time.monotonic()
            for source, state in self.heartbeats.exchange((self.step, self.phase)).items():
                reported[source] = state
                last_heard[source] = now
            stalled = now - self.last_progress
            if self._done.is_set() or stalled <= self.timeout:
                continue
            silent = sorted(r for r, t in last_heard.items() if now - t > self.silent_after)
            if self.rank == 0:
                self._abort(self._diagnosis(stalled, silent, reported, now, last_heard))
            elif 0 in silent:
                self._abort(f"stall: rank {self.rank} completed no step for {stalled:.0f} s and rank 0 went silent "
                            f"(no heartbeat for {now - last_heard[0]:.0f} s); {self._where([0])}")
            elif stalled > self.timeout + self.grace:
                self._abort(f"stall: rank {self.rank} completed no step for {stalled:.0f} s and rank 0, still alive, "
                            "did not end the job")

    def _where(self, silent: list[int]) -> str:
        """Which nodes the silent ranks ran on; a node all of whose ranks are silent is named lost."""
        parts = []
        for host in dict.fromkeys(self.hosts[r] for r in silent):
            on_host = [r for r, h in enumerate(self.hosts) if h == host]
            mine = [r for r in silent if self.hosts[r] == host]
            ranks = ", ".join(map(str, mine))
            if mine == on_host and host != self.hosts[self.rank]:
                parts.append(f"node {host} lost (all its ranks silent: {ranks})")
            else:
                parts.append(f"on node {host}: rank {ranks}")
        return "; ".join(parts)

    def _diagnosis(self, stalled: float, silent: list[int], reported: dict[int, tuple[int, str]], now: float,
                   last_heard: dict[int, float]) -> str:
        """Rank 0's one-line account of who is holding the job up."""
        head = f"stall: no training step completed for {stalled:.0f} s (step {self.step})"
        if silent:
            ranks = ", ".join(map(str, silent))
            quiet = max(now - last_heard[r] for r in silent)
            return (f"{head}; rank {ranks} went silent (no heartbeat for {quiet:.0f} s: frozen, stopped or "
                    f"unreachable); {self._where(silent)}")
        states = {r: state for r, state in reported.items()}
        states[0] = (self.step, self.phase)
        stuck = sorted(r for r, (_, phase) in states.items() if phase not in WAITING_PHASES)
        if stuck and len(stuck) < self.size:
            where = "; ".join(f"rank {r} in '{states[r][1]}' after step {states[r][0]}" for r in stuck)
            return f"{head}; alive but stuck: {where} (the other ranks wait in a collective)"
        return f"{head}; every rank is alive, phases: " + ", ".join(
            f"{r}={states[r][1]}" for r in sorted(states)) + " (a hung collective, data loader or device)"


class MpiHeartbeats:
    """Heartbeats over MPI: ranks > 0 send to rank 0, rank 0 to each; at most one in flight per peer, so a frozen
    peer costs nothing."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        rank, size = comm.Get_rank(), comm.Get_size()
        self.peers = [r for r in range(size) if r != rank] if rank == 0 else [0]
        self.pending: dict[int, Any] = {}  # mpi4py Requests

    def exchange(self, state: tuple[int, str]) -> dict[int, tuple[int, str]]:
        """The heartbeats received since the last call (by rank), after sending ours."""
        from mpi4py import MPI

        heard = {}
        status = MPI.Status()
        while self.comm.iprobe(source=MPI.ANY_SOURCE, tag=HEARTBEAT_TAG, status=status):
            source = status.Get_source()
            heard[source] = self.comm.recv(source=source, tag=HEARTBEAT_TAG)
        for peer in self.peers:
            if peer not in self.pending or self.pending[peer].Test():
                self.pending[peer] = self.comm.isend(state, dest=peer, tag=HEARTBEAT_TAG)
        return heard


class UdpHeartbeats:
    """Heartbeats as UDP datagrams (a job without MPI): ranks > 0 send to rank 0's socket, rank 0 answers each at
    the address its datagrams came from. Nothing waits: a frozen or lost peer only falls silent."""

    def __init__(self, comm: Any, hosts: list[str]) -> None:
        from hpcdl.runtime.rendezvous import root_address

        self.rank = comm.Get_rank()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("", 0))
        self.sock.setblocking(False)
        mine = (root_address(hosts, hosts[0]), self.sock.getsockname()[1]) if self.rank == 0 else None
        self.root: tuple[str, int] = comm.bcast(mine, root=0)  # collective: every rank constructs its watchdog
        self.senders: dict[int, Any] = {}  # rank -> the address its heartbeats come from (rank 0's view)
        atexit.register(self.sock.close)

    def exchange(self, state: tuple[int, str]) -> dict[int, tuple[int, str]]:
        heard = {}
        while True:
            try:
                data, sender = self.sock.recvfrom(4096)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # an ICMP error from a peer that is gone: it falls silent
                continue
            try:
                rank, step, phase = json.loads(data)
            except ValueError:
                continue
            heard[int(rank)] = (int(step), str(phase))
            self.senders[int(rank)] = sender
        message = json.dumps([self.rank, *state]).encode()
        targets = list(self.senders.values()) if self.rank == 0 else [self.root]
        for target in targets:
            with contextlib.suppress(OSError):  # unreachable now: that peer's silence is the verdict's evidence
                self.sock.sendto(message, target)
        return heard
