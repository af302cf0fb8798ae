"""The virtual cluster itself: nodes with their own hostname and address that reach each other,
a cut that isolates a node, node-local storage, and removal that leaves nothing -- also of a
cluster whose creator died."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpcdl.tools import vcluster
from tests.support.vcluster import make_vcluster  # noqa: F401 (a fixture)

pytestmark = pytest.mark.processes

CONNECT = "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()"


def reaches(cluster, src, dst, port: int) -> bool:
    return cluster.run(src, [sys.executable, "-c", CONNECT, dst.address, str(port)]).returncode == 0


def test_nodes_have_own_hostnames_and_reach_each_other_until_cut(make_vcluster) -> None:
    cluster = make_vcluster(2)
    node1, node2 = cluster.nodes
    assert cluster.run(node1, ["hostname"]).stdout.strip() == "node1"
    assert cluster.run(node2, ["hostname"]).stdout.strip() == "node2"
    server = cluster.popen(node2, [sys.executable, "-c",
                                   "import socket,time; s=socket.create_server(('0.0.0.0', 7777)); time.sleep(60)"])
    try:
        for _ in range(50):
            if reaches(cluster, node1, node2, 7777):
                break
        else:
            pytest.fail("node1 never reached node2")
        cluster.cut(node2)
        assert not reaches(cluster, node1, node2, 7777)
    finally:
        server.kill()
        server.wait(timeout=10)


def test_each_node_has_its_own_local_directory_and_shares_the_rest(make_vcluster, tmp_path: Path) -> None:
    cluster = make_vcluster(2)
    node1, node2 = cluster.nodes
    local = cluster.local_mount / "mine"
    shared = tmp_path / "shared"
    for node in (node1, node2):
        result = cluster.run(node, ["sh", "-c", f'hostname > "{local}" && hostname >> "{shared}"'])
        assert result.returncode == 0, result.stderr
    assert cluster.run(node1, ["cat", str(local)]).stdout == "node1\n"
    assert cluster.run(node2, ["cat", str(local)]).stdout == "node2\n"
    assert not local.exists()  # the machine itself sees neither node's
    assert shared.read_text() == "node1\nnode2\n"
    # launch/vcluster-rsh (Open MPI's way in) gives the same view
    rsh = Path(__file__).resolve().parents[2] / "launch" / "vcluster-rsh"
    result = subprocess.run([str(rsh), node2.address, "cat", str(local)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and result.stdout == "node2\n", result.stderr


def test_down_and_stale_removal_leave_nothing() -> None:
    from tests.support.vcluster import skip_or_fail_without_cluster

    skip_or_fail_without_cluster()
    cluster = vcluster.up(2)
    cluster.owner_pid = 2 ** 22 + 1  # above pid_max's default: no such process
    cluster.save()
    sleeper = cluster.popen(cluster.nodes[0], ["sleep", "60"])
    removed = vcluster.remove_stale()
    sleeper.wait(timeout=10)  # killed by the removal
    assert cluster.name in removed
    assert not Path(f"/run/netns/{cluster.nodes[0].namespace}").exists()
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, timeout=30).stdout
    assert f"hv{cluster.name}" not in links
    assert not cluster.state_file.exists()
    assert not cluster.local_mount.exists() and not cluster.local_source(cluster.nodes[0]).exists()
