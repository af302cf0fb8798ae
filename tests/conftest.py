"""Suite-wide fixtures: the fast tier, and the guard that keeps collective tests from hanging.

The fast tier (``pytest --fast``, ``make test-fast``) runs every test not marked ``processes`` or
``mpi``, in one process: no launcher, no child interpreter, no DataLoader worker. A test in it that
starts a process anyway fails at once, naming itself, so the tier stays fast by construction.

Under ``mpiexec -n N python -m pytest --with-mpi`` a rank whose test fails would go on to the
next test while the other ranks wait for it in a collective: the job would hang. So a failure
on any rank of an MPI test prints the report and calls MPI_Abort, which ends every rank at once
with a non-zero exit. pytest-timeout (pyproject) is the backstop for a test stuck in MPI.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast", action="store_true",
                     help="the fast tier: only tests that start no process (not marked processes or mpi)")


def _sigterm_unwinds(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    # A suite stopped by SIGTERM (an outer `timeout`, a cancelled CI job) must still tear down its
    # fixtures (virtual clusters, Slurm daemons): KeyboardInterrupt does, SIGTERM's default does not.
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _sigterm_unwinds)
    # The collective session lets Horovod start with dynamic process sets, so that K-FAC's rank
    # groups use them (tests/kfac/test_kfac_mpi.py). Only there: in the plain session the variable would
    # reach every `mpirun ... hpcdl.train` a test starts, and with it Horovod's background thread
    # holds a lock through an MPI call every cycle (see docs/reliability.md, "frozen rank").
    # Its tests compare runs bit for bit, so Horovod starts there without tensor fusion, whose timing-dependent
    # buffers change the order of addition from 3 ranks on (hpcdl.runtime.world.fix_reduction_order).
    if config.getoption("--with-mpi", default=False):
        os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
        os.environ.setdefault("HOROVOD_FUSION_THRESHOLD", "0")
        os.environ.setdefault("HOROVOD_AUTOTUNE", "0")


@pytest.hookimpl(trylast=True)  # after the fixtures' own teardown (pytest's runner does it at session end)
def pytest_sessionfinish(session: pytest.Session) -> None:
    # The last sweep: virtual clusters this process made that no fixture took down (one made outside a
    # fixture, or an interrupt between a cluster's creation and its fixture's list).
    vcluster = sys.modules.get("hpcdl.tools.vcluster")
    if vcluster is not None:
        for name in vcluster.remove_owned(os.getpid()):
            sys.stderr.write(f"\n[conftest] removed virtual cluster {name}, left by a test\n")


def _mpi_size() -> int:
    if "mpi4py.MPI" not in sys.modules:
        return 1
    return sys.modules["mpi4py.MPI"].COMM_WORLD.Get_size()


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not report.failed or _mpi_size() < 2:
        return
    MPI = sys.modules["mpi4py.MPI"]
    rank = MPI.COMM_WORLD.Get_rank()
    sys.stderr.write(f"\n[rank {rank}] {report.nodeid} failed ({report.when}); aborting every rank\n")
    sys.stderr.write(report.longreprtext + "\n")
    sys.stderr.flush()
    MPI.COMM_WORLD.Abort(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--fast"):
        return
    slow = [item for item in items if item.get_closest_marker("processes") or item.get_closest_marker("mpi")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item not in set(slow)]


@pytest.fixture(autouse=True)
def _fast_tier_starts_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if request.config.getoption("--fast"):
        def refuse(*args: object, **kwargs: object) -> None:
            raise AssertionError(f"{request.node.nodeid} starts a process: mark it `processes` (the fast tier starts none)")
        monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
        monkeypatch.setattr(os, "fork", refuse)
        monkeypatch.setattr(os, "posix_spawn", refuse)
    yield
