"""Losing a node mid-training on a virtual cluster (2 nodes x 2 ranks, launch/mpirun.sh).

Each case: the job ends, launcher included, non-zero, within --stall-timeout + 60 s of the failure;
one line names the lost node and its ranks; the last checkpoint is intact, and ``--resume`` on
the remaining node with another world size (2 ranks) continues from it.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.support.mpi_harness import epochs_to_resume_to
from tests.support.vcluster import Launch, make_vcluster, run_launch  # noqa: F401 (a fixture)

pytestmark = pytest.mark.processes

STALL = 20
TRAIN = ["--epochs", "30", "--stall-timeout", str(STALL), "--no-progress"]


def start_and_lose_node2(make_vcluster, tmp_path: Path, how: str,
                         backend: str | None = None) -> tuple[object, Path, float, int, str]:
    cluster = make_vcluster(2)
    out = tmp_path / "run"
    chosen = ["--backend", backend] if backend else []
    job = Launch(["--vcluster", cluster.name, "-np", "4", "--output-dir", str(out), *TRAIN, *chosen],
                 tmp_path / "job.log", timeout=400)
    try:
        job.wait_for_checkpoint(out)
        time.sleep(1)
        node2 = cluster.node("node2")
        if how == "cut":
            cluster.cut(node2)
        else:
            assert cluster.crash(node2), "node2 had no processes to kill"
        lost_at = time.monotonic()
        rc = job.wait(timeout=STALL + 90)
        ended_after = time.monotonic() - lost_at
        print(f"node2 {how}: the job ended {ended_after:.0f} s later, exit {rc}")
        # Nothing of the job may survive on the node that is still up, within the same target: the
        # launcher can return a moment before that node's daemon has reaped its ranks.
        node1 = cluster.node("node1")
        while cluster.pids(node1) and time.monotonic() < lost_at + STALL + 60:
            time.sleep(0.5)
        assert not cluster.pids(node1), "processes left on node1 after the job ended"
        return cluster, out, ended_after, rc, job.text
    finally:
        job.kill()


def check_loss_and_resume(cluster, out: Path, ended_after: float, rc: int, text: str, tmp_path: Path) -> None:
    node2 = cluster.node("node2")
    assert rc != 0, text[-3000:]
    assert ended_after <= STALL + 60, f"ended {ended_after:.0f} s after the loss\n{text[-3000:]}"
    named = [line for line in text.splitlines()
             if re.search(rf"node ({node2.hostname}|{re.escape(node2.address)}) lost.*\b2, 3\b", line)]
    assert named, f"no line names the lost node and its ranks 2, 3\n{text[-3000:]}"
    checkpoints = sorted((out / "checkpoints").glob("ckpt-*.pt"))
    assert checkpoints, "the checkpoint is gone"
    # Resume on the node that is left, 2 ranks instead of 4.
    node1 = cluster.node("node1")
    target = epochs_to_resume_to(out)
    rc2, text2 = run_launch(["--vcluster", cluster.name, "-H", f"{node1.address}:2", "-np", "2",
                             "--output-dir", str(out), "--resume", "--epochs", str(target), "--stall-timeout", "60",
                             "--no-progress"], tmp_path / "resume.log", timeout=240)
    assert rc2 == 0, text2[-3000:]
    assert "checkpoint was written by 4 rank(s)" in text2, text2[-3000:]
    epochs = [int(m) for m in re.findall(r"^epoch +(\d+)/", text2, re.M)]
    assert epochs and epochs[-1] == target and epochs[0] >= 1, text2[-3000:]


@pytest.mark.parametrize("backend", [None, "torch"], ids=["default", "torch"])
def test_node_cut_off_the_network(make_vcluster, tmp_path: Path, backend: str | None) -> None:
    """A cut node sends nothing and closes nothing: Gloo's peers wait like Horovod's, and the watchdog (over MPI)
    names the node under either backend."""
    cluster, out, ended_after, rc, text = start_and_lose_node2(make_vcluster, tmp_path, "cut", backend)
    check_loss_and_resume(cluster, out, ended_after, rc, text, tmp_path)


def test_node_crash_kills_all_its_processes(make_vcluster, tmp_path: Path) -> None:
    cluster, out, ended_after, rc, text = start_and_lose_node2(make_vcluster, tmp_path, "crash")
    check_loss_and_resume(cluster, out, ended_after, rc, text, tmp_path)
