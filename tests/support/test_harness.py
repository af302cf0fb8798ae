"""The test harness itself: a collective test that fails on one rank must not hang the run."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from tests.support.mpi_harness import REPO, run_mpi

pytestmark = pytest.mark.processes  # starts processes: not in the fast tier

FAILING_TEST = '''
import pytest
from mpi4py import MPI


@pytest.mark.mpi(min_size=2)
def test_rank_one_fails_before_a_collective():
    comm = MPI.COMM_WORLD
    assert comm.Get_rank() != 1, "deliberate failure on rank 1"
    comm.Barrier()  # ranks 0, 2, 3 wait here for rank 1 forever unless the harness aborts

@pytest.mark.mpi(min_size=2)
def test_after():
    MPI.COMM_WORLD.Barrier()
'''


def test_failing_rank_ends_the_whole_run_quickly(tmp_path: Path) -> None:
    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_failing.py").write_text(FAILING_TEST)
    start = time.monotonic()
    result = run_mpi(4, ["-m", "pytest", "-q", "--with-mpi", "-p", "no:cacheprovider", str(tmp_path)],
                     timeout=150)
    elapsed = time.monotonic() - start
    assert result.returncode not in (0, 124), result.stdout[-2000:] + result.stderr[-2000:]
    assert elapsed < 120
    assert "deliberate failure on rank 1" in result.stderr
    assert "aborting every rank" in result.stderr


def test_timeout_kills_every_rank_not_only_mpirun(tmp_path: Path) -> None:
    """A hung job is ended whole: Open MPI puts each rank in its own process group, so killing
    mpirun's group alone would leave the ranks running, holding the pipes the test reads."""
    marker = f"hpcdl-harness-{tmp_path.name}"
    start = time.monotonic()
    result = run_mpi(2, ["-c", f"import time; time.sleep(600)  # {marker}"], timeout=10)
    assert result.returncode == 124
    assert time.monotonic() - start < 60  # not waiting on pipes held by orphaned ranks
    time.sleep(1)
    survivors = [p for p in Path("/proc").glob("[0-9]*/cmdline")
                 if marker in p.read_bytes().decode(errors="replace") if p.exists()]
    assert not survivors, survivors
