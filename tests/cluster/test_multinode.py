"""Launching on several (virtual) nodes: hpcdl.doctor's per-node facts and its reachability check, and training
with --backend torch across nodes (torch.distributed started from MPI's ranks on hosts whose names do not resolve).

Training across nodes through launch/mpirun.sh is exercised by tests/cluster/test_node_loss.py
(4 ranks on 2 nodes until a node is lost, then 2 ranks on 1 node resuming).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.support.vcluster import make_vcluster, run_launch  # noqa: F401 (a fixture)

pytestmark = pytest.mark.processes


def test_doctor_reports_every_node_through_a_hostfile(make_vcluster, tmp_path: Path) -> None:
    cluster = make_vcluster(3)
    hostfile = cluster.write_hostfile(tmp_path / "hosts", slots=1)
    rc, text = run_launch(["--vcluster", cluster.name, "--hostfile", str(hostfile), "-np", "3",
                           "--entry", "hpcdl.doctor"], tmp_path / "doctor.log", timeout=180)
    assert rc == 0, text[-3000:]
    for index, node in enumerate(cluster.nodes):
        # node, interface, address, cores, GPUs, ranks: the interface is the one in the job's subnet
        assert re.search(rf"^  {node.hostname} +eth0 +{re.escape(node.address)} +\d+ +0 +{index}\s*$", text, re.M), \
            text[-3000:]
    # local rank/size per node: one rank per node here
    assert len(re.findall(r"^  node\d +\d +0 +1 +cpu", text, re.M)) == 3, text[-3000:]
    assert "gloo: allreduce over 3 rank(s) ok" in text, text[-3000:]  # torch.distributed across the nodes


def test_torch_backend_trains_across_two_nodes(make_vcluster, tmp_path: Path) -> None:
    """2 nodes x 2 ranks under --backend torch: rank 0's address is one of its interfaces (its hostname resolves
    nowhere), each rank's Gloo binds the interface towards it, and the replicas end identical."""
    cluster = make_vcluster(2)
    out = tmp_path / "run"
    rc, text = run_launch(["--vcluster", cluster.name, "-np", "4", "--output-dir", str(out), "--epochs", "1",
                           "--backend", "torch", "--no-progress"], tmp_path / "train.log", timeout=300)
    assert rc == 0, text[-3000:]
    assert "4 rank(s) x batch 32" in text and "torch (gloo)" in text, text[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["replicas_identical"] is True and summary["world_size"] == 4


def test_doctor_names_a_node_that_cannot_reach_another(make_vcluster, tmp_path: Path) -> None:
    cluster = make_vcluster(3)
    node2, node3 = cluster.node("node2"), cluster.node("node3")
    # node3 can no longer send to node2 (and so neither side can open a connection to the other)
    subprocess.run(["ip", "-n", node3.namespace, "route", "add", "blackhole", f"{node2.address}/32"],
                   check=True, timeout=30)
    rc, text = run_launch(["--vcluster", cluster.name, "-np", "3", "--entry", "hpcdl.doctor"],
                          tmp_path / "doctor.log", timeout=180)
    assert rc != 0, text[-3000:]
    lines = [line for line in text.splitlines() if line.startswith("doctor: node")]
    assert any(re.match(rf"doctor: node {node3.hostname} \({re.escape(node3.address)}\) cannot reach node "
                        rf"{node2.hostname} \({re.escape(node2.address)}:\d+\)", line) for line in lines), text[-3000:]
    assert not re.search(r"^Ranks$", text, re.M), "the doctor went on past the failed check"


def test_a_run_directory_on_node_local_storage_is_refused_before_training(make_vcluster, tmp_path: Path) -> None:
    """The cluster's local directory is each node's own (like a compute node's /tmp): rank 0's run
    files there would exist on node1 only. The run must stop before training, naming node2 and its
    ranks, and leave nothing behind on node1."""
    cluster = make_vcluster(2)
    out = cluster.local_mount / "run"
    rc, text = run_launch(["--vcluster", cluster.name, "-np", "4", "--output-dir", str(out), "--epochs", "1",
                           "--no-progress"], tmp_path / "train.log", timeout=240)
    assert rc != 0, text[-3000:]
    refusals = [line for line in text.splitlines() if "is not shared by every node" in line]
    assert refusals, text[-3000:]
    assert re.search(rf"output directory {re.escape(str(out))} is not shared by every node: node2 \(ranks 2, 3\) "
                     r"cannot see", refusals[0]), refusals[0]
    assert "Traceback" not in text and not re.search(r"^epoch ", text, re.M), text[-3000:]
    node1 = cluster.node("node1")
    left = cluster.run(node1, ["sh", "-c", f'ls -A "{cluster.local_mount}"'])
    assert left.returncode == 0 and left.stdout == "", left.stdout  # rank 0's empty run directory is gone
