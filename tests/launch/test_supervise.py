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


@pytest.mark.parametrize("report, host", [
    # Open MPI when a daemon stops answering (keepalive) or its connection drops
    ("  Remote daemon: [[22079,0],2] on node 10.9.9.2", "10.9.9.2"),
    # Open MPI's TCP transport in a surviving rank, when a peer's process died
    ("  Peer host:    10.9.9.2", "10.9.9.2"),
    ("  Message:    connect() to 10.9.9.2:1025 failed", "10.9.9.2"),
    # the remote shell that carried a daemon that was killed (Open MPI then says only "unable to
    # reliably start one or more daemons")
    ("vcluster-rsh: connection to node2 (10.9.9.2) closed: its remote command was killed (signal 9)", "10.9.9.2"),
    ("Connection to 10.9.9.2 closed by remote host.", "10.9.9.2"),
    ("Timeout, server 10.9.9.2 not responding.", "10.9.9.2"),
    ("srun: error: 10.9.9.2: task 1: Killed", "10.9.9.2"),
])
def test_a_lost_node_is_named_once_with_its_ranks(report: str, host: str) -> None:
    script = f"echo '{report}' >&2; echo '{report}' >&2; exit 205"
    result, _ = supervise(script, "--map", "10.9.9.1=0,1;10.9.9.2=2,3")
    assert result.returncode == 205
    named = [line for line in result.stderr.splitlines() if line.startswith("[hpcdl] node ")]
    assert len(named) == 1, result.stderr
    assert named[0].startswith(f"[hpcdl] node {host} lost or its ranks died: ") and \
        named[0].endswith("(ranks 2, 3); ending the job"), named[0]


def test_a_node_outside_the_host_list_is_still_named() -> None:
    result, _ = supervise("echo '  Peer host: 10.9.9.7' >&2; exit 1", "--map", "10.9.9.1=0,1")
    assert "[hpcdl] node 10.9.9.7 lost or its ranks died: connections to it broke (ranks ?)" in result.stderr


def test_without_an_abort_the_exit_status_passes_through() -> None:
    result, _ = supervise("echo fine; sleep 2; exit 0", "--grace", "1")
    assert result.returncode == 0 and result.stdout == "fine\n", result.stderr
