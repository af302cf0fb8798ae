"""Real Slurm across virtual nodes: one slurmd per node, srun and sbatch over two nodes.

slurmctld runs in this namespace on the cluster's bridge address; each node's slurmd runs inside
the node (tests/support/slurm_cluster.py with ``vcluster=``). Ranks talk TCP on the cluster's subnet.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.slurm_cluster import SlurmCluster, missing_requirements
from tests.support.vcluster import PYTHON, REPO, make_vcluster  # noqa: F401 (a fixture)

pytestmark = pytest.mark.processes

# Slurm 22.05's PMIx plugin tells the other node's slurmd where its step's socket is by path
# (under SlurmdSpoolDir/TmpFS). On virtual nodes that share one file system that path is the
# sender's own socket, so the inter-node fence loops back ("unexpected contrib from node1:0,
# expected is 1" in slurmd's log) and MPI_Init under srun --mpi=pmix hangs. Per-node mount
# namespaces (the same path, a different folder per node) are the way out; not done yet.
PMIX_ACROSS_VNODES = pytest.mark.skip(
    reason="srun --mpi=pmix across virtual nodes on one file system: Slurm's PMIx fence loops back "
           "(socket path shared); see docs/cluster.md")


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


@PMIX_ACROSS_VNODES
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


@PMIX_ACROSS_VNODES
def test_sbatch_slurm_script_trains_on_two_nodes(slurm2: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "run"
    job = slurm2.sbatch(REPO / "launch" / "slurm.sbatch", ["--epochs", "1", "--no-progress"],
                        ["-N", "2", "--ntasks-per-node", "2", "--cpus-per-task", "1", "-o", str(tmp_path / "job.out"),
                         "--export", f"ALL,HPCDL_OUTPUT_DIR={out}"], cwd=REPO)
    state = slurm2.wait_for_job(job, timeout=300)
    text = (tmp_path / "job.out").read_text(errors="replace")
    assert state == "COMPLETED", text[-3000:]
    assert "4 rank(s)" in text and (out / "summary.json").exists(), text[-3000:]


@PMIX_ACROSS_VNODES
def test_frontera_script_multi_node_path(slurm2: SlurmCluster, tmp_path: Path) -> None:
    job = slurm2.sbatch(REPO / "launch" / "frontera-rtx.sbatch", ["--modules", "", "--entry", "hpcdl.doctor"],
                        ["-N", "2", "-n", "4", "-o", str(tmp_path / "job.out")], cwd=REPO)
    state = slurm2.wait_for_job(job, timeout=300)
    text = (tmp_path / "job.out").read_text(errors="replace")
    assert state == "COMPLETED", text[-3000:]
    assert "4 tasks on 2 node(s)" in text and "launcher srun" in text, text[-3000:]
    assert re.search(r"^  node2 +eth0 +\S+ +\d+ +0 +2,3\s*$", text, re.M), text[-3000:]
