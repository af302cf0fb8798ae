"""The virtual cluster itself: nodes with their own hostname and address that reach each other,
a cut that isolates a node, node-local storage, and removal that leaves nothing -- also of a
cluster whose creator died, and of a test suite stopped by SIGTERM. And clusters never touch
each other's: a failed ``up``, the stale sweep of another state folder and the launcher's remote
shell leave another cluster's objects alone."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcdl.tools import vcluster
from tests.support.vcluster import make_vcluster, skip_or_fail_without_cluster  # noqa: F401 (a fixture)

REPO = Path(__file__).resolve().parents[2]
RSH = REPO / "launch" / "vcluster-rsh"

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
    result = rsh(cluster, node2.address, "cat", str(local))
    assert result.returncode == 0 and result.stdout == "node2\n", result.stderr


def rsh(cluster: vcluster.VCluster | None, host: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """launch/vcluster-rsh as Open MPI calls it, for ``cluster`` (as launch/mpirun.sh --vcluster sets it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPCDL_VCLUSTER")}
    if cluster is not None:
        env.update(HPCDL_VCLUSTER=cluster.name, HPCDL_VCLUSTER_STATE=str(cluster.folder))
    return subprocess.run([str(RSH), "-x", host, *argv], capture_output=True, text=True, timeout=30, env=env)


def links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=30).stdout


def netns(name: str) -> bool:
    return Path(f"/run/netns/{name}").exists()


def test_the_remote_shell_stays_in_its_own_cluster(make_vcluster) -> None:
    """Both clusters have a node1: the launcher's lookup must find the one of ITS cluster and refuse the other's."""
    first, second = make_vcluster(1), make_vcluster(1)
    for mine, other in ((first, second), (second, first)):
        result = rsh(mine, "node1", "ip", "-o", "-4", "addr", "show", "dev", "eth0")
        assert result.returncode == 0, result.stderr
        assert f" {mine.nodes[0].address}/" in result.stdout and f" {other.nodes[0].address}/" not in result.stdout
        result = rsh(mine, other.nodes[0].address, "true")
        assert result.returncode == 255
        expected = f"vcluster-rsh: {other.nodes[0].address} is no node of virtual cluster {mine.name}"
        assert result.stderr.strip() == expected
    result = rsh(None, first.nodes[0].address, "true")  # no cluster named: no search across all of them
    assert result.returncode == 255 and "set HPCDL_VCLUSTER" in result.stderr


def test_a_failed_up_leaves_objects_it_did_not_make(monkeypatch: pytest.MonkeyPatch) -> None:
    """Objects with the names a new cluster wants, made by someone else, survive that cluster's failure.

    (The old tool recorded a name before making it, so a failed `up` deleted another cluster's bridge.)"""
    skip_or_fail_without_cluster()
    vcluster.remove_stale()
    bridge, nodes = vcluster.names_for("zz9", 2)
    subprocess.run(["ip", "link", "add", bridge, "type", "bridge"], check=True, timeout=30)
    try:
        with pytest.raises(vcluster.VClusterError, match=f"{bridge} exist.*left alone"):
            vcluster.up(2, name="zz9")
        assert f" {bridge}:" in links()
    finally:
        subprocess.run(["ip", "link", "delete", bridge], check=False, timeout=30)
    # Half way: node2's namespace appears unseen by the check (made by a tool that takes no lock).
    foreign = nodes[1][0]
    subprocess.run(["ip", "netns", "add", foreign], check=True, timeout=30)
    try:
        monkeypatch.setattr(vcluster, "_existing_namespaces", lambda: set())
        with pytest.raises(vcluster.VClusterError, match="netns add"):
            vcluster.up(2, name="zz9")
        assert netns(foreign), "a failed up removed a namespace it had not made"
        assert not netns(nodes[0][0]) and bridge not in links() and nodes[0][1] not in links()  # its own: gone
        assert vcluster.load("zz9") is None
    finally:
        subprocess.run(["ip", "netns", "delete", foreign], check=False, timeout=30)


def test_stale_sweep_leaves_other_state_folders_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two users (or two test runs) with their own state folders: one's sweep never removes the other's clusters,
    not even one whose creator died, nor leftovers no state lists."""
    skip_or_fail_without_cluster()
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    monkeypatch.setattr(vcluster, "STATE_DIR", theirs)
    other = vcluster.up(1, name="oth")
    try:
        other.owner_pid = 2 ** 22 + 1  # its creator is gone: stale, but for ITS folder's sweep to remove
        other.save()
        leftover = f"{vcluster.NS_PREFIX}{vcluster.state_tag()}-gone-n1"  # theirs, listed nowhere
        subprocess.run(["ip", "netns", "add", leftover], check=True, timeout=30)
        monkeypatch.setattr(vcluster, "STATE_DIR", mine)
        assert vcluster.state_tag() != vcluster.state_tag(theirs)
        own = vcluster.up(1, name="oth")  # the same name in another folder: other objects
        assert own.nodes[0].namespace != other.nodes[0].namespace and own.bridge != other.bridge
        own.owner_pid = 2 ** 22 + 1
        own.save()
        removed = vcluster.remove_stale()
        assert removed == ["oth"], removed
        assert not netns(own.nodes[0].namespace)
        assert netns(other.nodes[0].namespace) and netns(leftover) and f" {other.bridge}:" in links()
        monkeypatch.setattr(vcluster, "STATE_DIR", theirs)
        assert sorted(vcluster.remove_stale()) == sorted(["oth", leftover])
        assert not netns(other.nodes[0].namespace) and not netns(leftover) and other.bridge not in links()
    finally:
        other.down()
        subprocess.run(["ip", "netns", "delete", f"{vcluster.NS_PREFIX}{vcluster.state_tag(theirs)}-gone-n1"],
                       check=False, timeout=30, capture_output=True)


def test_two_ups_at_once_get_their_own_subnets() -> None:
    """Under the machine-wide lock, clusters started at the same moment never share a subnet or a name."""
    skip_or_fail_without_cluster()
    code = ("import sys; from hpcdl.tools import vcluster; c = vcluster.up(1); print(c.name, c.subnet, flush=True); "
            "sys.stdin.read(); c.down()")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              cwd=REPO) for _ in range(4)]
    try:
        made = [p.stdout.readline().split() for p in procs]  # type: ignore[union-attr]
        assert all(len(m) == 2 for m in made), made
        assert len({m[0] for m in made}) == 4 and len({m[1] for m in made}) == 4, made
    finally:
        for p in procs:
            p.communicate("", timeout=60)


SLEEPER = """
import time
from hpcdl.tools import vcluster
from tests.support.vcluster import make_vcluster  # noqa: F401


def test_sleeps(make_vcluster):
    by_fixture = make_vcluster(1)
    by_hand = vcluster.up(1)  # outside the fixture, as a test may do
    print("READY", by_fixture.nodes[0].namespace, by_hand.nodes[0].namespace, flush=True)
    time.sleep(300)
"""


def test_a_suite_stopped_by_sigterm_leaves_no_namespace(tmp_path: Path) -> None:
    """`timeout` (or a cancelled CI job) sends SIGTERM to pytest: its clusters must go all the same."""
    skip_or_fail_without_cluster()
    (tmp_path / "test_sleeper.py").write_text(SLEEPER)
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                             "-p", "tests.conftest", "--rootdir", str(REPO), str(tmp_path / "test_sleeper.py")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    try:
        assert proc.stdout is not None
        deadline, seen = time.monotonic() + 120, ""
        while "READY" not in seen:
            assert time.monotonic() < deadline and proc.poll() is None, seen
            if select.select([proc.stdout], [], [], 1)[0]:
                seen += proc.stdout.readline()
        namespaces = seen.split("READY", 1)[1].split()[:2]
        assert all(netns(n) for n in namespaces)
        proc.send_signal(signal.SIGTERM)
        output = seen + proc.communicate(timeout=60)[0]
        assert proc.returncode != 0
        assert [n for n in namespaces if netns(n)] == [], output[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_down_and_stale_removal_leave_nothing() -> None:
    skip_or_fail_without_cluster()
    cluster = vcluster.up(2)
    cluster.owner_pid = 2 ** 22 + 1  # above pid_max's default: no such process
    cluster.save()
    sleeper = cluster.popen(cluster.nodes[0], ["sleep", "60"])
    removed = vcluster.remove_stale()
    sleeper.wait(timeout=10)  # killed by the removal
    assert cluster.name in removed
    assert not Path(f"/run/netns/{cluster.nodes[0].namespace}").exists()
    assert f"{cluster.name}br" not in links() and cluster.bridge not in links()
    assert not cluster.state_file.exists()
    assert not cluster.local_mount.exists() and not cluster.local_source(cluster.nodes[0]).exists()
