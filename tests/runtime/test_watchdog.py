"""The stall watchdog's heartbeats and diagnosis, without ending any job.

The job tests (tests/runtime/test_reliability.py) prove that a real frozen rank ends a real job. Here the
watchdog's MPI_Abort is replaced by a recorder, so the same heartbeat machinery can be checked
in-process on every rank of a pytest-mpi run (``mpiexec -n 4 python -m pytest --with-mpi``), and
its diagnosis as a plain function.
"""

from __future__ import annotations

import subprocess
import time

import pytest

from hpcdl.runtime.watchdog import StallWatchdog
from tests.support.mpi_harness import PYTHON, REPO

pytestmark = pytest.mark.processes  # starts processes: not in the fast tier


class FakeComm:
    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def Dup(self) -> FakeComm:
        return self

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size

    def allgather(self, value: object) -> list[object]:
        return [value] * self.size


def diagnose(phases: dict[int, tuple[int, str]], silent: list[int], size: int = 4,
             hosts: list[str] | None = None) -> str:
    watchdog = StallWatchdog(FakeComm(0, size), timeout=20)
    watchdog.hosts = hosts or ["node1"] * size
    watchdog.step, watchdog.phase = phases.pop(0)
    now = 1000.0
    last_heard = {r: (now - 30 if r in silent else now - 1) for r in range(1, size)}
    return watchdog._diagnosis(25.0, silent, phases, now, last_heard)


def test_silent_ranks_are_named_first() -> None:
    message = diagnose({0: (4, "collective"), 2: (4, "collective")}, silent=[1, 3])
    assert message == ("stall: no training step completed for 25 s (step 4); rank 1, 3 went silent "
                       "(no heartbeat for 30 s: frozen, stopped or unreachable); on node node1: rank 1, 3")


def test_a_lost_node_is_named_with_its_ranks() -> None:
    """Every rank of node2 silent: the verdict names the node as lost; a lone silent rank elsewhere
    is named with its node but not called a lost node."""
    hosts = ["node1", "node1", "node2", "node2", "node3", "node3"]
    message = diagnose({0: (4, "collective")}, silent=[2, 3, 5], size=6, hosts=hosts)
    assert message.endswith("rank 2, 3, 5 went silent (no heartbeat for 30 s: frozen, stopped or unreachable); "
                            "node node2 lost (all its ranks silent: 2, 3); on node node3: rank 5")


def test_a_live_rank_outside_the_collective_is_the_culprit() -> None:
    message = diagnose({0: (4, "collective"), 1: (4, "data"), 2: (4, "collective"), 3: (4, "collective")}, silent=[])
    assert message.endswith("alive but stuck: rank 1 in 'data' after step 4 (the other ranks wait in a collective)")


def test_rank_0_itself_can_be_the_culprit() -> None:
    message = diagnose({0: (7, "checkpoint"), 1: (7, "collective")}, silent=[], size=2)
    assert "alive but stuck: rank 0 in 'checkpoint' after step 7" in message


def test_all_alive_all_waiting_says_so() -> None:
    message = diagnose({0: (4, "collective"), 1: (4, "collective")}, silent=[], size=2)
    assert message.endswith("every rank is alive, phases: 0=collective, 1=collective (a hung collective, data loader or device)")


def test_disabled_with_timeout_zero_starts_no_thread() -> None:
    watchdog = StallWatchdog(FakeComm(0, 2), timeout=0).start()
    assert not watchdog._thread.is_alive()
    watchdog.stop()


def test_interval_and_grace_follow_the_timeout() -> None:
    assert StallWatchdog(FakeComm(0, 2), timeout=300).interval == 5.0
    assert StallWatchdog(FakeComm(0, 2), timeout=2).interval == pytest.approx(0.4)
    assert StallWatchdog(FakeComm(1, 2), timeout=300).grace == 150


def recording(watchdog: StallWatchdog, verdicts: list[str]) -> StallWatchdog:
    """Record instead of MPI_Abort. The thread goes on watching (and sending heartbeats), as it would
    for the instant before the abort lands; so a verdict may be recorded more than once."""
    watchdog._abort = verdicts.append  # type: ignore[method-assign]
    return watchdog


@pytest.mark.mpi(min_size=2)
def test_heartbeats_name_the_rank_that_sends_none() -> None:
    """Rank 1 builds its watchdog (a collective) but never starts it: it is silent, like a SIGSTOPped
    rank. Nobody beats, so every rank is stalled; rank 0 must name rank 1 and nobody else."""
    from mpi4py import MPI

    from tests.support.mpi_harness import assert_all_ranks

    comm = MPI.COMM_WORLD
    verdicts: list[str] = []
    watchdog = recording(StallWatchdog(comm, timeout=1.0, interval=0.2), verdicts)
    if comm.Get_rank() != 1:
        watchdog.start()
    time.sleep(3.0)
    watchdog.stop()
    comm.Barrier()
    rank = comm.Get_rank()
    if rank == 0:
        ok = bool(verdicts) and all("; rank 1 went silent (no heartbeat for" in v for v in verdicts)
    else:  # rank 0 is alive and sending; the others wait (grace) for it to act
        ok = verdicts == []
    assert_all_ranks(ok, f"rank {rank}: {verdicts}")


@pytest.mark.mpi(min_size=2)
def test_heartbeats_carry_the_phase_of_a_stuck_rank() -> None:
    from mpi4py import MPI

    from tests.support.mpi_harness import assert_all_ranks

    comm = MPI.COMM_WORLD
    verdicts: list[str] = []
    watchdog = recording(StallWatchdog(comm, timeout=1.0, interval=0.2), verdicts)
    watchdog.beat(step=9, phase="data" if comm.Get_rank() == 1 else "collective")
    watchdog.start()
    time.sleep(3.0)
    watchdog.stop()
    comm.Barrier()
    expected = "alive but stuck: rank 1 in 'data' after step 9 (the other ranks wait in a collective)"
    ok = (bool(verdicts) and all(v.endswith(expected) for v in verdicts)) if comm.Get_rank() == 0 else verdicts == []
    assert_all_ranks(ok, f"rank {comm.Get_rank()}: {verdicts}")


@pytest.mark.mpi(min_size=2)
def test_the_others_name_a_silent_rank_0() -> None:
    from mpi4py import MPI

    from tests.support.mpi_harness import assert_all_ranks

    comm = MPI.COMM_WORLD
    verdicts: list[str] = []
    watchdog = recording(StallWatchdog(comm, timeout=1.0, interval=0.2), verdicts)
    if comm.Get_rank() != 0:
        watchdog.start()
    time.sleep(3.0)
    watchdog.stop()
    comm.Barrier()
    rank = comm.Get_rank()
    ok = verdicts == [] if rank == 0 else bool(verdicts) and all(
        f"stall: rank {rank} completed no step for" in v and "and rank 0 went silent" in v for v in verdicts)
    assert_all_ranks(ok, f"rank {rank}: {verdicts}")


BLOCKED_WITH_THE_GIL = """
import ctypes, sys
from mpi4py import MPI
from hpcdl.runtime.watchdog import StallWatchdog

watchdog = StallWatchdog(MPI.COMM_SELF, timeout=1.0, interval=0.2).start()
print(f"backstop {watchdog.backstop:g}", flush=True)
# {how}: PyDLL keeps the GIL through the C call, as Horovod's allreduce does while it waits for
# a lock; time.sleep releases it.
{call}
print("not reached", flush=True)
"""


def _blocked(how: str, call: str) -> subprocess.CompletedProcess[str]:
    code = BLOCKED_WITH_THE_GIL.replace("{how}", how).replace("{call}", call)
    return subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)


def test_backstop_ends_a_process_whose_main_thread_holds_the_gil() -> None:
    """The Python watchdog thread cannot run at all; faulthandler's C thread still ends the process."""
    start = time.monotonic()
    result = _blocked("main thread blocked in C holding the GIL", "ctypes.PyDLL(None).sleep(60)")
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stdout + result.stderr
    assert "backstop 16" in result.stdout and "not reached" not in result.stdout
    assert "Timeout (0:00:16)!" in result.stderr  # faulthandler's dump: where each thread was
    assert "stall:" not in result.stderr  # the Python thread never got to speak
    assert 15 < elapsed < 50, elapsed


def test_python_watchdog_speaks_first_when_it_can() -> None:
    result = _blocked("main thread asleep without the GIL", "import time; time.sleep(60)")
    assert result.returncode == 3, result.stdout + result.stderr  # EXIT_STALL, through MPI_Abort
    assert "hpcdl: stall: no training step completed for" in result.stderr
    assert "Timeout (" not in result.stderr
