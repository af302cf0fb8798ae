"""launch/supervise.py: ends an mpirun that does not end after an abort, and names a lost node.

A stand-in "mpirun" (a shell script) prints what Open MPI prints and then hangs, as the real one
does when a node is cut off; the supervisor must end it within its grace and say why.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

SUPERVISE = Path(__file__).resolve().parents[2] / "launch" / "supervise.py"


def supervise(script: str, *args: str, timeout: float = 30) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    result = subprocess.run([sys.executable, str(SUPERVISE), *args, "--", "sh", "-c", script],
                            capture_output=True, text=True, timeout=timeout)
    return result, time.monotonic() - start


def test_a_hung_mpirun_is_killed_after_the_grace() -> None:
    result, took = supervise("echo 'MPI_ABORT was invoked on rank 0' >&2; sleep 600", "--grace", "1")
    assert result.returncode == 3, result.stderr
    assert 1 <= took < 15, took
    assert "mpirun still running 1 s after the job was aborted" in result.stderr
    assert "MPI_ABORT was invoked on rank 0" in result.stderr  # passed through


def test_a_lost_daemon_is_named_with_its_ranks() -> None:
    script = "echo '  Remote daemon: [[22079,0],2] on node 10.9.9.2' >&2; exit 205"
    result, _ = supervise(script, "--map", "10.9.9.1=0,1;10.9.9.2=2,3")
    assert result.returncode == 205
    assert "[hpcdl] node 10.9.9.2 lost: Open MPI lost its daemon there (ranks 2, 3); ending the job" in result.stderr


def test_without_an_abort_the_exit_status_passes_through() -> None:
    result, _ = supervise("echo fine; sleep 2; exit 0", "--grace", "1")
    assert result.returncode == 0 and result.stdout == "fine\n", result.stderr
