"""A virtual cluster on one Linux machine: N nodes as network namespaces on a bridge.

    python -m hpcdl.tools.vcluster up --nodes 2 [--rate 1gbit] [--name demo]
    python -m hpcdl.tools.vcluster exec --name demo node1 -- hostname
    launch/mpirun.sh --vcluster demo -np 4 --epochs 2      # ranks on node1 and node2
    python -m hpcdl.tools.vcluster down --name demo        # or: down --all

Why: multi-node launch paths and the loss of a whole node cannot be tried with every rank on one
host, where they talk through shared memory. Each node here is a network namespace with its own
address on a private 10.x.y.0/24 (the launcher's side, the bridge, is .254) and, for every command
started in it, its own UTS namespace with the node's hostname -- two "nodes" with one hostname would
let Open MPI's shared-memory transport cross between them. Open MPI reaches the nodes through
``launch/vcluster-rsh`` (``--mca plm_rsh_agent``), which looks the host up in that one cluster's state
file (``HPCDL_VCLUSTER``, set by ``launch/mpirun.sh --vcluster``).
The nodes share the machine's file system, as cluster nodes share /home and /scratch, except for
one directory, ``/run/hpcdl-vcluster/<name>.local``, which is each node's own (a bind mount in a
mount namespace per command): node-local storage, like a compute node's /tmp.

Two clusters, two users or two test runs on one machine never touch each other's: every name
carries a tag of the state folder (HPCDL_VCLUSTER_STATE) besides the cluster's name (namespaces
``hpcdlvc-<tag>-<name>-nK``, interfaces ``hv<tag><name>...``), so clusters listed in different
folders never share one; a cluster's state file lists only what it really created (recorded right
after creating it), so ``down``, a failed ``up`` and :func:`remove_stale` remove exactly that;
the sweep for leftovers of a killed run looks at its own folder's tag only; and ``up`` and the
sweep hold a machine-wide lock (:data:`LOCK_FILE`), so two ``up`` never pick one subnet and a
sweep never sees a cluster half made. Needs root, iproute2 (``ip``, ``tc``) and util-linux
(``nsenter``, ``unshare``).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import ipaddress
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hpcdl.runtime.processes import pid_alive

STATE_DIR = Path(os.environ.get("HPCDL_VCLUSTER_STATE", "/run/hpcdl-vcluster"))
# One lock for the whole machine, whatever the state folder: links and namespaces are machine-wide.
LOCK_FILE = Path("/run/lock/hpcdl-vcluster.lock") if Path("/run/lock").is_dir() else Path("/tmp/hpcdl-vcluster.lock")
LOCK_TIMEOUT = 120.0
NS_PREFIX = "hpcdlvc-"
NAME_RE = re.compile(r"^[a-z0-9]{1,6}$")  # "hv" + tag (3) + name (6) + "h16": interface names are at most 15
TAG_CHARS = "0123456789abcdefghijklmnopqrstuvwxyz"
RATE_RE = re.compile(r"^[1-9][0-9]*(\.[0-9]+)?(bit|kbit|mbit|gbit)$")
TOOLS = ("ip", "tc", "nsenter", "unshare")
CMD_TIMEOUT = 30.0


class VClusterError(RuntimeError):
    """A virtual cluster cannot be made or used; the message is one line."""


@dataclass
class Node:
    hostname: str
    namespace: str
    address: str
    host_veth: str  # the end on the bridge: `ip link set <it> down` cuts the node off

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.namespace}"


def state_tag(folder: Path | None = None) -> str:
    """Three characters [a-z0-9] derived from a state folder's path, in the names of what its clusters create."""
    digest = hashlib.sha256(str((folder or STATE_DIR).resolve()).encode()).digest()
    number = int.from_bytes(digest[:8], "big")
    return "".join(TAG_CHARS[(number // len(TAG_CHARS) ** i) % len(TAG_CHARS)] for i in range(3))


@dataclass
class VCluster:
    name: str
    subnet: str
    bridge: str  # "" until created: the state lists only what this cluster made
    bridge_address: str
    rate: str | None
    owner_pid: int
    nodes: list[Node] = field(default_factory=list)
    state_dir: str = ""  # the folder that lists it ("": STATE_DIR)

    # ------------------------------------------------------------------ facts
    @property
    def folder(self) -> Path:
        return Path(self.state_dir) if self.state_dir else STATE_DIR

    @property
    def state_file(self) -> Path:
        return self.folder / f"{self.name}.json"

    @property
    def hostfile(self) -> Path:
        return self.folder / f"{self.name}.hostfile"

    @property
    def agent_table(self) -> Path:
        return self.folder / f"{self.name}.hosts"

    @property
    def local_mount(self) -> Path:
        """Node-local storage: one path, and inside each node its own directory (like a node's /tmp)."""
        return self.folder / f"{self.name}.local"

    def local_source(self, node: Node) -> Path:
        """What ``node`` sees at :attr:`local_mount`."""
        return self.folder / f"{self.name}.{node.hostname}.local"

    def node(self, key: str) -> Node:
        """A node by hostname, address or 1-based index."""
        for index, node in enumerate(self.nodes, 1):
            if key in (node.hostname, node.address, str(index)):
                return node
        raise VClusterError(f"virtual cluster {self.name} has no node {key!r} (nodes: "
                            f"{', '.join(n.hostname for n in self.nodes)})")

    def hosts_arg(self, slots: int, nodes: Sequence[Node] | None = None) -> str:
        """mpirun's -H value: ADDRESS:SLOTS for each node."""
        return ",".join(f"{n.address}:{slots}" for n in (nodes or self.nodes))

    def write_hostfile(self, path: Path, slots: int, nodes: Sequence[Node] | None = None) -> Path:
        path.write_text("".join(f"{n.address} slots={slots}\n" for n in (nodes or self.nodes)))
        return path

    # ------------------------------------------------------------------ commands in a node
    def wrap(self, node: Node, argv: Sequence[str]) -> list[str]:
        """argv, run inside the node: its network namespace, a UTS namespace with its hostname, and
        a mount namespace in which :attr:`local_mount` is the node's own directory."""
        return ["nsenter", f"--net={node.netns_path}", "unshare", "--uts", "--mount", "sh", "-c",
                'hostname "$0" && mount --bind "$1" "$2" && shift 2 && exec "$@"', node.hostname,
                str(self.local_source(node)), str(self.local_mount), *argv]

    def popen(self, node: Node, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.wrap(node, argv), **kwargs)

    def run(self, node: Node, argv: Sequence[str], timeout: float = CMD_TIMEOUT, **kwargs
            ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.wrap(node, argv), timeout=timeout, text=True, capture_output=True, **kwargs)

    def pids(self, node: Node) -> list[int]:
        """Every process in the node's network namespace."""
        out = _ip(["netns", "pids", node.namespace], check=False).stdout
        return [int(p) for p in out.split() if p.isdigit()]

    def crash(self, node: Node) -> list[int]:
        """A node crash: SIGKILL every process of the node at once."""
        pids = self.pids(node)
        for pid in pids:
            _kill(pid, signal.SIGKILL)
        return pids

    def cut(self, node: Node) -> None:
        """A partition: the node's link goes down, its processes go on running."""
        _ip(["link", "set", node.host_veth, "down"])

    # ------------------------------------------------------------------ life cycle
    def save(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        temporary = self.state_file.with_name(f".{self.state_file.name}.tmp")
        temporary.write_text(json.dumps(asdict(self), indent=1))
        os.replace(temporary, self.state_file)  # a reader (launch/mpirun.sh) never sees half a file
        self.write_hostfile(self.hostfile, slots=2)
        self.local_mount.mkdir(exist_ok=True)
        for node in self.nodes:
            self.local_source(node).mkdir(exist_ok=True)
        # What launch/vcluster-rsh reads: ADDRESS HOSTNAME NETNS_PATH LOCAL_SOURCE LOCAL_MOUNT per node.
        self.agent_table.write_text("".join(
            f"{n.address} {n.hostname} {n.netns_path} {self.local_source(n)} {self.local_mount}\n" for n in self.nodes))

    def down(self) -> None:
        """Kill every process in the nodes, delete namespaces, veths, bridge and state files: what the
        state lists, which is what this cluster created, never another's (signals wait until done)."""
        with _signals_held():
            self._remove()

    def _remove(self) -> None:
        for node in self.nodes:
            for _ in range(3):  # processes may fork while we kill
                if not self.crash(node):
                    break
                time.sleep(0.2)
            _ip(["netns", "delete", node.namespace], check=False)
            if node.host_veth:
                _ip(["link", "delete", node.host_veth], check=False)
        if self.bridge:
            _ip(["link", "delete", self.bridge], check=False)
        for node in self.nodes:  # bound only inside the nodes' own mount namespaces, gone with them
            shutil.rmtree(self.local_source(node), ignore_errors=True)
        with contextlib.suppress(OSError):
            self.local_mount.rmdir()
        for path in (self.state_file, self.hostfile, self.agent_table):
            path.unlink(missing_ok=True)


def _ip(args: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], text=True, capture_output=True, timeout=CMD_TIMEOUT)
    if check and result.returncode != 0:
        raise VClusterError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def _tc(args: Sequence[str]) -> None:
    result = subprocess.run(["tc", *args], text=True, capture_output=True, timeout=CMD_TIMEOUT)
    if result.returncode != 0:
        raise VClusterError(f"tc {' '.join(args)}: {result.stderr.strip()}")


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


_LOCK_DEPTH = threading.local()


@contextlib.contextmanager
def machine_lock(timeout: float = LOCK_TIMEOUT) -> Iterator[None]:
    """The machine-wide lock of ``up`` and the sweep (re-entrant within a thread)."""
    depth = getattr(_LOCK_DEPTH, "value", 0)
    if depth:
        _LOCK_DEPTH.value = depth + 1
        try:
            yield
        finally:
            _LOCK_DEPTH.value = depth
        return
    with open(LOCK_FILE, "a") as handle:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise VClusterError(f"another virtual-cluster command has held {LOCK_FILE} for {timeout:.0f} s"
                                        ) from None
                time.sleep(0.1)
        _LOCK_DEPTH.value = 1
        try:
            yield
        finally:
            _LOCK_DEPTH.value = 0
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT/SIGTERM wait while something is created and recorded, or removed: an interrupt between the two
    would leave an object no state lists. (Only the main thread handles signals; elsewhere nothing to hold.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _existing_links() -> set[str]:
    names = set()
    for line in _ip(["-o", "link"], check=False).stdout.splitlines():
        if ":" in line:
            names.add(line.split(":")[1].strip().split("@")[0])
    return names


def _existing_namespaces() -> set[str]:
    return {line.split(" ")[0] for line in _ip(["netns", "list"], check=False).stdout.splitlines() if line}


def missing_requirements() -> str | None:
    """Why a virtual cluster cannot be made here, or None."""
    if os.geteuid() != 0:
        return "a virtual cluster needs root (network namespaces)"
    absent = [tool for tool in TOOLS if shutil.which(tool) is None]
    if absent:
        return f"missing {', '.join(absent)}: run 'bash scripts/install-cluster-tools.sh' (iproute2, util-linux)"
    return None


def _free_subnet() -> ipaddress.IPv4Network:
    """A random 10.x.y.0/24 that no route or address of this machine touches."""
    used = [ipaddress.ip_network(w, strict=False) for w in
            re.findall(r"\b(\d+\.\d+\.\d+\.\d+(?:/\d+)?)\b", _ip(["-4", "route", "show", "table", "all"]).stdout
                       + _ip(["-4", "addr"]).stdout)]
    rng = random.Random()
    for _ in range(200):
        net = ipaddress.IPv4Network(f"10.{rng.randint(128, 254)}.{rng.randint(0, 255)}.0/24")
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise VClusterError("no free 10.x.y.0/24 found")


BURST_FLOOR = 256 * 1024  # bytes
BURST_SECONDS = 0.001


def tbf(device: str, rate: str, namespace: str | None = None) -> None:
    """Shape a device's egress to `rate` with a token bucket.

    The bucket holds 1 ms of traffic, and at least 256 KiB: a smaller one caps the rate below the
    setting (one GSO packet is 64 KiB; a 64 KiB bucket gave iperf3 0.78 Gbit/s on a 1 Gbit/s link,
    256 KiB 0.957), and a larger one lets whole messages through unshaped (10 ms at 10 Gbit/s,
    12.5 MB, passed a 1 MiB allreduce at twice the link rate)."""
    bits = _rate_bits(rate)
    burst = max(BURST_FLOOR, int(bits / 8 * BURST_SECONDS))
    prefix = ["-n", namespace] if namespace else []
    _tc([*prefix, "qdisc", "replace", "dev", device, "root", "tbf", "rate", rate, "burst", str(burst),
         "latency", "20ms"])


def _rate_bits(rate: str) -> float:
    if not RATE_RE.match(rate):
        raise VClusterError(f"--rate must look like 1gbit, 500mbit or 10gbit, got {rate!r}")
    scale = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    unit = re.sub(r"^[0-9.]+", "", rate)
    return float(rate[: -len(unit)]) * scale[unit]


def names_for(name: str, nodes: int, folder: Path | None = None) -> tuple[str, list[tuple[str, str]]]:
    """(bridge, [(namespace, host veth) per node]) of cluster ``name`` listed in ``folder``."""
    tag = state_tag(folder)
    return f"hv{tag}{name}br", [(f"{NS_PREFIX}{tag}-{name}-n{i}", f"hv{tag}{name}h{i}") for i in range(1, nodes + 1)]


def up(nodes: int, name: str | None = None, rate: str | None = None) -> VCluster:
    """Create a cluster of `nodes` namespaces; on any failure remove what it made (only that) and raise."""
    reason = missing_requirements()
    if reason:
        raise VClusterError(reason)
    if not 1 <= nodes <= 16:
        raise VClusterError(f"--nodes must be 1..16, got {nodes}")
    if rate is not None:
        _rate_bits(rate)
    if name is not None and not NAME_RE.match(name):
        raise VClusterError(f"--name must be 1-6 lower-case letters or digits, got {name!r}")
    with machine_lock(), _signals_held():
        taken = _existing_links() | _existing_namespaces()
        for _ in range(100):
            chosen = name or f"{random.getrandbits(20):05x}"
            bridge, node_names = names_for(chosen, nodes)
            clash = sorted({bridge, *(n for pair in node_names for n in pair)} & taken)
            if load(chosen) is None and not clash:
                break
            if name is not None:
                why = (f"exists already (down --name {name} removes it)" if load(name) is not None else
                       f"cannot be made: {', '.join(clash)} exist(s) and belong(s) to no cluster of {STATE_DIR}"
                       " (left alone)")
                raise VClusterError(f"virtual cluster {name} {why}")
        else:
            raise VClusterError("no free cluster name found")
        return _make(chosen, nodes, rate, bridge, node_names)


def _make(name: str, nodes: int, rate: str | None, bridge: str, node_names: list[tuple[str, str]]) -> VCluster:
    """up()'s work, under its lock and with signals held: each object is recorded right after it is made."""
    net = _free_subnet()
    hosts = list(net.hosts())
    cluster = VCluster(name=name, subnet=str(net), bridge="", bridge_address=str(hosts[-1]), rate=rate,
                       owner_pid=os.getpid(), state_dir=str(STATE_DIR))
    cluster.save()
    try:
        _ip(["link", "add", bridge, "type", "bridge"])
        cluster.bridge = bridge
        cluster.save()
        _ip(["addr", "add", f"{cluster.bridge_address}/{net.prefixlen}", "dev", cluster.bridge])
        _ip(["link", "set", cluster.bridge, "up"])
        for index, (namespace, host_veth) in enumerate(node_names, 1):
            node = Node(hostname=f"node{index}", namespace=namespace, address=str(hosts[index - 1]), host_veth="")
            _ip(["netns", "add", node.namespace])
            cluster.nodes.append(node)
            cluster.save()
            _ip(["link", "add", host_veth, "type", "veth", "peer", "name", "eth0", "netns", node.namespace])
            node.host_veth = host_veth
            cluster.save()
            _ip(["link", "set", node.host_veth, "master", cluster.bridge, "up"])
            _ip(["-n", node.namespace, "addr", "add", f"{node.address}/{net.prefixlen}", "dev", "eth0"])
            _ip(["-n", node.namespace, "link", "set", "eth0", "up"])
            _ip(["-n", node.namespace, "link", "set", "lo", "up"])
            if rate:  # both directions: into the node (host end) and out of it (node end)
                tbf(node.host_veth, rate)
                tbf("eth0", rate, namespace=node.namespace)
        cluster.save()
    except BaseException:
        cluster.down()
        raise
    return cluster


def load(name: str) -> VCluster | None:
    path = STATE_DIR / f"{name}.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    raw["nodes"] = [Node(**n) for n in raw.get("nodes", [])]
    raw["state_dir"] = str(STATE_DIR)
    return VCluster(**raw)


def all_clusters() -> list[VCluster]:
    found = [load(p.stem) for p in sorted(STATE_DIR.glob("*.json"))] if STATE_DIR.is_dir() else []
    return [c for c in found if c is not None]


def remove_owned(pid: int) -> list[str]:
    """Remove the clusters of this folder that process ``pid`` made (a test run's last sweep)."""
    removed = []
    for cluster in all_clusters():
        if cluster.owner_pid == pid:
            cluster.down()
            removed.append(cluster.name)
    return removed


def remove_stale() -> list[str]:
    """Remove this folder's clusters whose creating process is gone, and namespaces/interfaces with this
    folder's tag that none of its state files lists (a run killed with SIGKILL). Clusters listed in other
    state folders carry other tags and are never touched. Returns what was removed."""
    removed = []
    claimed: set[str] = set()
    tag = state_tag()
    with machine_lock():
        for cluster in all_clusters():
            if pid_alive(cluster.owner_pid):
                claimed.update(n.namespace for n in cluster.nodes)
                claimed.update(n.host_veth for n in cluster.nodes)
                claimed.add(cluster.bridge)
                continue
            cluster.down()
            removed.append(cluster.name)
        for ns in sorted(_existing_namespaces()):
            if ns.startswith(f"{NS_PREFIX}{tag}-") and ns not in claimed:
                for pid in _ip(["netns", "pids", ns], check=False).stdout.split():
                    _kill(int(pid), signal.SIGKILL)
                _ip(["netns", "delete", ns], check=False)
                removed.append(ns)
        for dev in sorted(_existing_links()):
            if re.match(rf"^hv{tag}[a-z0-9]{{1,6}}(br|h\d+)$", dev) and dev not in claimed:
                _ip(["link", "delete", dev], check=False)
                removed.append(dev)
    return removed


# ---------------------------------------------------------------------- command line
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hpcdl.tools.vcluster", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="create N nodes; prints the hostfile and an mpirun line")
    p_up.add_argument("--nodes", type=int, default=2)
    p_up.add_argument("--name", help="1-6 lower-case letters/digits (default: random)")
    p_up.add_argument("--rate", help="shape every link to this rate both ways, e.g. 1gbit (tc tbf)")
    p_up.add_argument("--keep", action="store_true", help=argparse.SUPPRESS)
    p_down = sub.add_parser("down", help="remove a cluster (--all: every one, and leftovers)")
    p_down.add_argument("--name")
    p_down.add_argument("--all", action="store_true")
    sub.add_parser("list", help="the clusters that exist")
    p_exec = sub.add_parser("exec", help="run a command on a node: exec --name N node1 -- CMD")
    p_exec.add_argument("--name")
    p_exec.add_argument("node")
    p_exec.add_argument("argv", nargs=argparse.REMAINDER)
    p_cut = sub.add_parser("cut", help="take a node's link down (a partition)")
    p_cut.add_argument("--name")
    p_cut.add_argument("node")
    return parser


def _one(name: str | None) -> VCluster:
    clusters = all_clusters()
    if name is not None:
        cluster = load(name)
        if cluster is None:
            raise VClusterError(f"no virtual cluster named {name!r} (python -m hpcdl.tools.vcluster list)")
        return cluster
    if len(clusters) != 1:
        raise VClusterError(f"{len(clusters)} virtual clusters exist: say which with --name")
    return clusters[0]


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "up":
            cluster = up(args.nodes, args.name, args.rate)
            cluster.owner_pid = 1  # made from the shell: it lives until `down`, not until we exit
            cluster.save()
            print(f"virtual cluster {cluster.name}: {len(cluster.nodes)} nodes on {cluster.subnet}"
                  f"{' at ' + cluster.rate if cluster.rate else ''}, launcher side {cluster.bridge_address}")
            for node in cluster.nodes:
                print(f"  {node.hostname}  {node.address}  (netns {node.namespace}, link {node.host_veth})")
            print(f"hostfile: {cluster.hostfile}\n"
                  f"try: launch/mpirun.sh --vcluster {cluster.name} -np {2 * len(cluster.nodes)} --epochs 1\n"
                  f"end: python -m hpcdl.tools.vcluster down --name {cluster.name}")
        elif args.command == "down":
            if args.all:
                for cluster in all_clusters():
                    cluster.down()
                    print(f"removed {cluster.name}")
                for item in remove_stale():
                    print(f"removed {item}")
            else:
                cluster = _one(args.name)
                cluster.down()
                print(f"removed {cluster.name}")
        elif args.command == "list":
            for cluster in all_clusters():
                print(f"{cluster.name}: {', '.join(f'{n.hostname}={n.address}' for n in cluster.nodes)}"
                      f" rate={cluster.rate or 'unshaped'}")
        elif args.command == "exec":
            cluster = _one(args.name)
            argv_ = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
            if not argv_:
                raise VClusterError("exec needs a command after the node: exec node1 -- hostname")
            os.execvp("nsenter", cluster.wrap(cluster.node(args.node), argv_))
        elif args.command == "cut":
            cluster = _one(args.name)
            cluster.cut(cluster.node(args.node))
    except VClusterError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
