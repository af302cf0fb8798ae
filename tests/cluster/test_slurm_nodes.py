"""Real Slurm across virtual nodes: one slurmd per node, srun and sbatch over two nodes.

slurmctld runs in this namespace on the cluster's bridge address; each node's slurmd runs inside
the node (tests/support/slurm_cluster.py with ``vcluster=``). Ranks talk TCP on the cluster's subnet.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.backends import BACKENDS
from tests.support.mpi_harness import epochs_to_resume_to
from tests.support.slurm_cluster import SlurmCluster, missing_requirements
from tests.support.vcluster import PYTHON, REPO, make_vcluster  # noqa: F401 (a fixture)

pytestmark = pytest.mark.processes



@pytest.fixture
def slurm2(make_vcluster) -> Iterator[SlurmCluster]:
    reason = missing_requirements()
    if reason:
        if os.environ.get("HPCDL_REQUIRE_SLURM") == "1" or os.environ.get("CI") == "true":
            pytest.fail(f"Slurm tests must run here but {reason}")
        pytest.skip(reason)
    cluster = make_vcluster(2)
    slurm = SlurmCluster(vcluster=cluster)
    subnet = cluster.subnet
    slurm.env.update(OMPI_MCA_btl_tcp_if_include=subnet, OMPI_MCA_oob_tcp_if_include=subnet,
                     OMPI_MCA_btl="tcp,self,vader", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with slurm:
        yield slurm


def test_srun_places_two_tasks_on_each_of_two_nodes(slurm2: SlurmCluster) -> None:
    result = slurm2.run(["srun", "-N", "2", "--ntasks-per-node", "2", "sh", "-c",
                         "echo $(hostname) $SLURM_PROCID $SLURM_NODEID $SLURM_LOCALID"], timeout=90)
    assert sorted(result.stdout.split("\n")[:-1]) == ["node1 0 0 0", "node1 1 0 1", "node2 2 1 0", "node2 3 1 1"], \
        result.stdout


def test_srun_pmix_across_two_nodes_gives_one_world_of_four(slurm2: SlurmCluster) -> None:
    # Each rank reports its rank, the world size and the sum over all ranks (MPI's own allreduce).
    code = ("from mpi4py import MPI; c = MPI.COMM_WORLD; import socket; "
            "print(socket.gethostname(), c.Get_rank(), c.Get_size(), c.allreduce(c.Get_rank()))")
    result = slurm2.run(["timeout", "100", "srun", "-N", "2", "--ntasks-per-node", "2", "--mpi=pmix",
                         "--kill-on-bad-exit=1", str(PYTHON), "-c", code], timeout=120, check=False)
    text = result.stdout + result.stderr
    assert result.returncode == 0, text[-3000:] + slurm2.logs()
    assert sorted(result.stdout.split("\n")[:-1]) == [
        "node1 0 4 6", "node1 1 4 6", "node2 2 4 6", "node2 3 4 6"], text[-3000:]


def test_srun_two_nodes_two_tasks_each_has_right_node_facts(slurm2: SlurmCluster, tmp_path: Path) -> None:
    result = slurm2.run(["srun", "-N", "2", "--ntasks-per-node", "2", "--mpi=pmix", "--kill-on-bad-exit=1",
                         str(PYTHON), "-m", "hpcdl.doctor"], timeout=240, check=False, cwd=REPO)
    text = result.stdout + result.stderr
    assert result.returncode == 0, text[-3000:]
    assert re.search(r"^  node1 +eth0 +\S+ +\d+ +0 +0,1\s*$", text, re.M), text[-3000:]
    assert re.search(r"^  node2 +eth0 +\S+ +\d+ +0 +2,3\s*$", text, re.M), text[-3000:]
    # host, rank, local_rank, local_size
    for host, rank, local in (("node1", 0, 0), ("node1", 1, 1), ("node2", 2, 0), ("node2", 3, 1)):
        assert re.search(rf"^  {host} +{rank} +{local} +2 ", text, re.M), text[-3000:]


@pytest.mark.parametrize("backend", BACKENDS)
def test_sbatch_slurm_script_trains_on_two_nodes(slurm2: SlurmCluster, tmp_path: Path, backend: str) -> None:
    """srun --mpi=pmix across 2 nodes x 2 ranks, under either backend (torch.distributed's rendezvous on a host
    whose name resolves nowhere)."""
    out = tmp_path / "run"
    job = slurm2.sbatch(REPO / "launch" / "slurm.sbatch", ["--epochs", "1", "--no-progress", "--backend", backend],
                        ["-N", "2", "--ntasks-per-node", "2", "--cpus-per-task", "1", "-o", str(tmp_path / "job.out"),
                         "--export", f"ALL,HPCDL_OUTPUT_DIR={out}"], cwd=REPO)
    state = slurm2.wait_for_job(job, timeout=300)
    text = (tmp_path / "job.out").read_text(errors="replace")
    assert state == "COMPLETED", text[-3000:]
    assert "4 rank(s)" in text and (out / "summary.json").exists(), text[-3000:]
    assert f"| {backend}" in text, text[-3000:]


def test_frontera_script_multi_node_path(slurm2: SlurmCluster, tmp_path: Path) -> None:
    job = slurm2.sbatch(REPO / "launch" / "frontera-rtx.sbatch", ["--modules", "", "--entry", "hpcdl.doctor"],
                        ["-N", "2", "-n", "4", "--ntasks-per-node", "2", "-o", str(tmp_path / "job.out")], cwd=REPO)
    state = slurm2.wait_for_job(job, timeout=300)
    text = (tmp_path / "job.out").read_text(errors="replace")
    assert state == "COMPLETED", text[-3000:]
    assert "4 tasks on 2 node(s)" in text and "launcher srun" in text, text[-3000:]
    assert re.search(r"^  node2 +eth0 +\S+ +\d+ +0 +2,3\s*$", text, re.M), text[-3000:]


@pytest.mark.parametrize("how", ["cut", "crash"])
def test_node_loss_under_srun_ends_the_job_names_the_node_and_resumes(
        slurm2: SlurmCluster, tmp_path: Path, how: str) -> None:
    """Node loss under srun (link down, or every process of the node killed, slurmd included):
    non-zero within --stall-timeout + 60 s, one line naming the node and its ranks, the checkpoint
    intact, and --resume on the remaining node (2 ranks) goes on."""
    stall = 10  # the watchdog's verdict on a cut node; every step here takes well under a second
    out = tmp_path / "run"
    log = tmp_path / "job.log"
    train = [str(PYTHON), "-m", "hpcdl.train", "--output-dir", str(out), "--no-progress"]
    with open(log, "wb") as sink:
        job = subprocess.Popen(["timeout", "-s", "KILL", "400", "srun", "-N", "2", "--ntasks-per-node", "2",
                                "--mpi=pmix", "--kill-on-bad-exit=1", *train, "--epochs", "30",
                                "--stall-timeout", str(stall)],
                               stdout=sink, stderr=subprocess.STDOUT, cwd=REPO, env=slurm2.env, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not list((out / "checkpoints").glob("ckpt-*.pt")):
            assert job.poll() is None, "the job ended before its first checkpoint\n" + log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint after 240 s\n" + log.read_text()[-3000:]
            time.sleep(0.5)
        time.sleep(1)
        assert slurm2.vcluster is not None
        node2 = slurm2.vcluster.node("node2")
        if how == "cut":
            slurm2.vcluster.cut(node2)
        else:
            assert slurm2.vcluster.crash(node2), "node2 had no processes to kill"
        lost_at = time.monotonic()
        rc = job.wait(timeout=stall + 90)
        ended_after = time.monotonic() - lost_at
        print(f"node2 {how} under srun: the job ended {ended_after:.0f} s later, exit {rc}")
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
            job.wait(timeout=10)
    text = log.read_text(errors="replace")
    assert rc != 0, text[-3000:]
    assert ended_after <= stall + 60, f"ended {ended_after:.0f} s after the {how}\n{text[-3000:]}"
    assert [line for line in text.splitlines() if re.search(r"node node2 lost.*\b2, 3\b", line)], text[-3000:]
    assert sorted((out / "checkpoints").glob("ckpt-*.pt")), "the checkpoint is gone"
    target = epochs_to_resume_to(out)
    resumed = slurm2.run(["timeout", "-s", "KILL", "230", "srun", "-N", "1", "-w", "node1", "-n", "2", "--mpi=pmix",
                          "--kill-on-bad-exit=1", *train, "--resume", "--epochs", str(target), "--stall-timeout", "60"],
                         timeout=240, check=False, cwd=REPO)
    text2 = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, text2[-3000:]
    assert "checkpoint was written by 4 rank(s)" in text2, text2[-3000:]
    epochs = [int(m) for m in re.findall(r"^epoch +(\d+)/", text2, re.M)]
    assert epochs and epochs[-1] == target and epochs[0] >= 1, text2[-3000:]
