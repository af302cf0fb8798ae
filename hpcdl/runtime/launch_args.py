"""The command line of launch/mpirun.sh: which words are the launcher's, which the entry module's,
and every value checked before mpirun starts.

    python3 hpcdl/runtime/launch_args.py mpirun REPO_ROOT ARGS...   # prints shell assignments

The shell script runs this file by path with any python3 (standard library only: it runs before
a virtual environment is known) and ``eval``s what it prints: one ``NAME=value`` per setting,
arrays for the word lists, each value shell-quoted. A bad value is one ``error: ...`` line on
stderr and exit 2, and the script stops before anything starts. ``--help`` prints a ``printf``
of the help text and ``exit 0``.

The rule for the words: everything after the first ``--`` is the entry module's; before it, a
launcher option is the launcher's wherever it stands (``--epochs 1 -np 2`` is -np for mpirun),
and every other word goes, in order, to the entry module. Options are matched whole (no
abbreviations). Host lists count slots as Open MPI does: ``HOST`` alone is one slot, a repeated
host adds up (``-H a,a,b`` is two slots on a).

A virtual cluster (hpcdl.tools.vcluster) is read from its state file ``<state>/<name>.json``
(``subnet`` and ``nodes[].hostname/address``), the format that tool writes.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

# Container runtimes by name -> the program that runs an image. AUTO is tried in order when none is named.
RUNTIMES = {"apptainer": "apptainer", "singularity": "singularity", "charliecloud": "ch-run"}
AUTO_RUNTIMES = ("apptainer", "singularity")
VCLUSTER_STATE = "/run/hpcdl-vcluster"
VCLUSTER_NAME = re.compile(r"^[a-z0-9]{1,6}$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
IFACE_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,15}$")
COUNT = re.compile(r"^[1-9][0-9]*$")
WHOLE = re.compile(r"^[0-9]+$")


class LaunchError(ValueError):
    """A bad launcher argument; the message is one line."""


# ---------------------------------------------------------------------- host lists
@dataclass
class Host:
    name: str
    slots: int | None  # None: a hostfile line without slots= (Open MPI then counts the node's cores)


def _count(text: str, what: str) -> int:
    if not COUNT.match(text):
        raise LaunchError(f"{what} must be a positive whole number, got '{text}'")
    return int(text)


def _merge(hosts: list[Host]) -> list[Host]:
    """One entry per host in order of first appearance; a repeated host adds its slots (Open MPI's rule)."""
    merged: dict[str, Host] = {}
    for host in hosts:
        seen = merged.get(host.name)
        if seen is None:
            merged[host.name] = Host(host.name, host.slots)
        elif seen.slots is not None and host.slots is not None:
            seen.slots += host.slots
        else:
            seen.slots = None
    return list(merged.values())


def parse_host_list(text: str) -> list[Host]:
    """-H's HOST[:SLOTS],HOST[:SLOTS]... A host alone is one slot; repeats add up."""
    hosts = []
    for item in text.split(","):
        name, colon, slots = item.strip().partition(":")
        if not name or any(c.isspace() for c in name) or (colon and not COUNT.match(slots)):
            raise LaunchError(f"-H wants HOST:SLOTS,HOST:SLOTS with SLOTS a positive whole number (HOST alone is "
                              f"one slot), got '{text}'")
        hosts.append(Host(name, int(slots) if colon else 1))
    return _merge(hosts)


def parse_hostfile(path: str) -> list[Host]:
    """An Open MPI hostfile: ``HOST [slots=N] [max_slots=M]`` per line, # comments; MPICH's ``HOST:N`` too."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError):
        raise LaunchError(f"hostfile not readable: {path}") from None
    hosts = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        name, colon, slots_text = words[0].partition(":")
        slots: int | None = None
        where = f"hostfile {path} line {number}"
        if colon:
            slots = _count(slots_text, f"the slots in {where}")
        for word in words[1:]:
            key, _, value = word.partition("=")
            if key == "slots":
                slots = _count(value, f"slots= in {where}")
            elif key in ("max_slots", "max-slots"):
                _count(value, f"{key}= in {where}")
            else:
                raise LaunchError(f"{where}: '{word}' is not 'slots=N' or 'max_slots=N'")
        if not name:
            raise LaunchError(f"{where} names no host")
        hosts.append(Host(name, slots))
    if not hosts:
        raise LaunchError(f"hostfile lists no hosts: {path}")
    return _merge(hosts)


def total_slots(hosts: Sequence[Host]) -> int | None:
    return None if any(h.slots is None for h in hosts) else sum(h.slots or 0 for h in hosts)


def fill_slots(hosts: Sequence[Host], np: int) -> list[list[int]] | None:
    """The ranks each host gets under -map-by slot (fill a host's slots, then the next), or None
    when that is not known (slots unknown, or more ranks than slots)."""
    total = total_slots(hosts)
    if total is None or np > total:
        return None
    ranks, next_rank = [], 0
    for host in hosts:
        take = min(host.slots or 0, np - next_rank)
        ranks.append(list(range(next_rank, next_rank + take)))
        next_rank += take
    return ranks


# ---------------------------------------------------------------------- virtual clusters
@dataclass
class VirtualCluster:
    name: str
    subnet: str
    nodes: list[tuple[str, str]]  # (hostname, address)

    def address_of(self, host: str) -> str:
        """A node of THIS cluster by hostname or address; any other host is an error."""
        for hostname, address in self.nodes:
            if host in (hostname, address):
                return address
        raise LaunchError(f"virtual cluster {self.name} has no node '{host}' "
                          f"(nodes: {', '.join(f'{h}={a}' for h, a in self.nodes)})")


def load_vcluster(name: str, state: str) -> VirtualCluster:
    if not VCLUSTER_NAME.match(name):
        raise LaunchError(f"--vcluster wants a cluster's name (1-6 lower-case letters or digits), got '{name}'")
    try:
        raw = json.loads((Path(state) / f"{name}.json").read_text())
        cluster = VirtualCluster(name, str(ipaddress.ip_network(raw["subnet"])),
                                 [(str(n["hostname"]), str(n["address"])) for n in raw["nodes"]])
    except OSError:
        raise LaunchError(f"no virtual cluster named '{name}' in {state} "
                          f"(python -m hpcdl.tools.vcluster up --name {name})") from None
    except (ValueError, KeyError, TypeError):
        raise LaunchError(f"the state of virtual cluster '{name}' is unreadable: {state}/{name}.json") from None
    if not cluster.nodes:
        raise LaunchError(f"virtual cluster '{name}' has no nodes (it is being made or removed)")
    return cluster


# ---------------------------------------------------------------------- the parser
class _Formatter(argparse.RawDescriptionHelpFormatter):
    """argparse's help, its first line starting 'Usage:' as every launch script's does."""

    def add_usage(self, usage, actions, groups, prefix=None):  # noqa: ANN001, ANN201 - argparse's signature
        super().add_usage(usage, actions, groups, prefix="Usage: ")


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line and exit 2."""

    def error(self, message: str) -> NoReturn:
        needs = re.match(r"argument ([^/:]+)[^:]*: expected one argument", message)
        if needs:
            flag = needs.group(1)
            message = f"{flag} needs a value (see --help); a value that starts with '-' is written {flag}=VALUE"
        fail(message)


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


MPIRUN_USAGE = "launch/mpirun.sh [options] [--] [entry module options]"
MPIRUN_DESCRIPTION = """\
Runs one rank per GPU (or per slot on a CPU machine) with mpirun and the flags Horovod
recommends: -bind-to none -map-by slot, the environment exported to every rank, and
OMP_NUM_THREADS set so that the ranks of a host share its cores instead of fighting over them.

  launch/mpirun.sh -np 2                          # 2 ranks, digits, defaults of hpcdl.train
  launch/mpirun.sh -np 4 --epochs 5 --output-dir runs/try1
  launch/mpirun.sh -np 8 --hostfile hosts.txt --image hpcdl.sif -- --dataset cifar10
  launch/mpirun.sh -np 2 --entry hpcdl.doctor     # show which rank got which GPU

Which words are whose: everything after the first -- goes to the entry module (hpcdl.train
unless --entry says otherwise). Before it, an option below is the launcher's wherever it stands
(--epochs 5 -np 4: -np is mpirun's), and every other word goes, in order, to the entry module.
Options are matched whole, never abbreviated. To give the entry module a word that is also a
launcher option (its --help, say), put it after --. A value that starts with '-' is written
--mpi-args=-v. Each option is also read from the environment variable shown; a flag wins."""
MPIRUN_EPILOG = """\
HPCDL_OOB_KEEPALIVE (environment only): "TIME INTVL PROBES" of Open MPI's daemon keepalives
  (default "10 5 3": a cut node is noticed in 10-25 s; "" = Open MPI's 8 min)
HPCDL_VCLUSTER_STATE (environment only): where the virtual clusters are listed
  (default /run/hpcdl-vcluster)
PMIX_MCA_gds (environment only): PMIx's data store under Open MPI (default hash: the shared-memory
  store's lock can fail when two jobs start at the same moment on one machine)
HPCDL_JOIN_CT (environment only): ranks per host for ch-run --join where the launcher does not
  say it (set here for MPICH-family launchers; Open MPI and Slurm set variables ch-run reads)
HPCDL_ROOT (environment only) is the repository; it is found by itself, set it when the
  script cannot tell (a copy of the script submitted from elsewhere).
Host lists count slots as Open MPI does: HOST alone is one slot, a repeated host adds up
(-H a,a,b is two ranks' room on a, one on b); -np above the slots needs --oversubscribe."""


def mpirun_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = _Parser(prog="launch/mpirun.sh", usage=MPIRUN_USAGE, description=MPIRUN_DESCRIPTION,
                     epilog=MPIRUN_EPILOG, formatter_class=_Formatter, allow_abbrev=False, add_help=False)
    e = env.get
    mpi = parser.add_argument_group("where and how many (mpirun)")
    mpi.add_argument("-np", "-n", "--np", dest="np", metavar="N", default=e("HPCDL_NP", ""),
                     help="number of ranks (HPCDL_NP; default: the slots of -H, --hostfile or --vcluster; "
                          "SLURM_NTASKS inside a Slurm job; else the GPUs of this host, or 2 without GPUs)")
    mpi.add_argument("--hostfile", metavar="FILE", default=e("HPCDL_HOSTFILE", ""),
                     help="hostfile, one 'HOST slots=N' line per node (HPCDL_HOSTFILE)")
    mpi.add_argument("-H", "--host", dest="hosts", metavar="LIST", default=e("HPCDL_HOSTS", ""),
                     help="hosts as HOST:SLOTS,HOST:SLOTS (HPCDL_HOSTS). Neither -H nor --hostfile inside a "
                          "Slurm job: Open MPI uses the job's nodes, -np defaults to SLURM_NTASKS")
    mpi.add_argument("--iface", metavar="IF", default=e("HPCDL_IFACE", ""),
                     help="the network the job uses, an interface name (ib0, eth0) or a subnet (10.1.2.0/24) "
                          "(HPCDL_IFACE): Open MPI's TCP transport and its daemons' out-of-band channel "
                          "(btl_tcp_if_include, oob_tcp_if_include); a name also goes to Horovod's Gloo "
                          "(HOROVOD_GLOO_IFACE) and NCCL (NCCL_SOCKET_IFNAME)")
    mpi.add_argument("--vcluster", metavar="NAME", default=e("HPCDL_VCLUSTER", ""),
                     help="run on a virtual cluster (python -m hpcdl.tools.vcluster up) (HPCDL_VCLUSTER): its "
                          "nodes as hosts (-H may name them, with slots: node1:3,node2:1; default: -np spread "
                          "evenly), its subnet as --iface, launch/vcluster-rsh to reach them")
    mpi.add_argument("--abort-grace", metavar="S", default=e("HPCDL_ABORT_GRACE", "20"),
                     help="when a rank aborts the job (a lost node, a stall) and mpirun has not ended S seconds "
                          "later, kill it (HPCDL_ABORT_GRACE; default 20; 0 = no supervisor)")
    mpi.add_argument("--threads", metavar="N", default=e("OMP_NUM_THREADS", ""),
                     help="OpenMP threads per rank (OMP_NUM_THREADS; default: cores / ranks per host)")
    mpi.add_argument("--oversubscribe", action="store_const", const="1", default=e("HPCDL_OVERSUBSCRIBE", "0"),
                     help="allow more ranks than slots or cores (HPCDL_OVERSUBSCRIBE=1; added by itself when "
                          "-np exceeds the cores of this machine and there is no host list)")
    mpi.add_argument("--mpirun", metavar="CMD", default=e("HPCDL_MPIRUN", "mpirun"),
                     help="the mpirun to use (HPCDL_MPIRUN; default: mpirun on PATH)")
    mpi.add_argument("--mpi-args", metavar='"ARGS"', default=e("HPCDL_MPI_ARGS", ""),
                     help='extra words for mpirun, e.g. "-mca pml ob1 -mca btl ^openib" to force TCP when RDMA '
                          "misbehaves (HPCDL_MPI_ARGS)")
    mpi.add_argument("--export", metavar='"VARS"', default=e("HPCDL_EXPORT", ""),
                     help="more environment variables to pass to every rank (HPCDL_EXPORT)")
    add_common_options(parser, env)
    return parser


def add_common_options(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """The options every launch script takes (launch/common.sh reads the same variables)."""
    e = env.get
    common = parser.add_argument_group("what each rank runs")
    common.add_argument("--python", metavar="PATH", default=e("HPCDL_PYTHON", ""),
                        help="interpreter for the ranks (HPCDL_PYTHON; default: <repo>/.venv/bin/python, "
                             "'python' inside a container)")
    common.add_argument("--entry", metavar="MODULE", default=e("HPCDL_ENTRY", "") or "hpcdl.train",
                        help="Python module each rank runs (HPCDL_ENTRY; default: hpcdl.train; hpcdl.doctor shows "
                             "the rank -> GPU mapping)")
    common.add_argument("--image", metavar="IMAGE", default=e("HPCDL_IMAGE", ""),
                        help="run every rank inside this container image (HPCDL_IMAGE)")
    common.add_argument("--runtime", metavar="NAME", default=e("HPCDL_RUNTIME", ""),
                        help=f"the container runtime: {_one_of(RUNTIMES)} (HPCDL_RUNTIME; default: "
                             f"by the image's kind: charliecloud for a directory or .sqfs, else "
                             f"{' or '.join(AUTO_RUNTIMES)}, whichever is on PATH)")
    common.add_argument("--bind", metavar="LIST", default=e("HPCDL_BIND", ""),
                        help="extra container bind mounts, comma separated (HPCDL_BIND)")
    common.add_argument("--no-nv", dest="nv", action="store_const", const="0", default=e("HPCDL_NV", ""),
                        help="do not pass --nv to the container runtime (HPCDL_NV=0; default: --nv when "
                             "nvidia-smi exists)")
    common.add_argument("--dry-run", action="store_const", const="1", default=e("HPCDL_DRY_RUN", "0"),
                        help="print the command and stop (HPCDL_DRY_RUN=1)")
    common.add_argument("-h", "--help", action="store_true", help="this text")


def split_words(parser: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """(the launcher's options, the entry module's words), by the rule in the module docstring."""
    words = list(argv)
    cut = words.index("--") if "--" in words else len(words)
    options, others = parser.parse_known_args(words[:cut])
    return options, others + words[cut + 1:]


# ---------------------------------------------------------------------- decisions
@dataclass
class Machine:
    """What the decisions depend on besides the arguments (a test gives its own)."""
    env: Mapping[str, str]
    path: str  # the caller's PATH: a python3 shim (pyenv) may have changed ours
    cores: int
    root: str  # the repository (launch/vcluster-rsh lives there)
    gpus: int | None = None  # None: ask nvidia-smi

    def which(self, program: str) -> str | None:
        return shutil.which(program, path=self.path)

    def is_open_mpi(self, mpirun: str) -> bool:
        try:
            out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return False
        return "Open MPI" in out.stdout + out.stderr

    def gpu_count(self) -> int:
        if self.gpus is None:
            self.gpus = 0
            smi = self.which("nvidia-smi")
            if smi:
                try:
                    out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
                    self.gpus = sum(1 for line in out.splitlines() if line.startswith("GPU"))
                except (OSError, subprocess.SubprocessError):
                    pass
        return self.gpus


@dataclass
class MpirunLaunch:
    """Everything launch/mpirun.sh needs, decided and checked."""
    np: int
    hosts: str  # -H for mpirun (merged, vcluster nodes as addresses), or ""
    hostfile: str
    iface: str
    vcluster: str
    vcluster_state: str
    rsh_agent: str
    abort_grace: int
    threads: int
    ranks_per_host: int
    oversubscribe: bool
    mpirun: str
    open_mpi: bool
    mpi_args: list[str]
    export: list[str]
    keepalive: list[str]
    rank_map: str
    python: str
    entry: str
    image: str
    runtime: str
    bind: str
    nv: str
    dry_run: bool
    entry_args: list[str]
    notes: list[str] = field(default_factory=list)


def _flag01(value: str, what: str) -> bool:
    if value not in ("0", "1", ""):
        raise LaunchError(f"{what} must be 0 or 1, got '{value}'")
    return value == "1"


def _one_of(names: Iterable[str]) -> str:
    """'a, b or c'."""
    items = list(names)
    return ", ".join(items[:-1]) + " or " + items[-1] if len(items) > 1 else items[0]


def check_runtime(name: str, image: str, machine: Machine) -> str:
    """The container runtime to use ("" without an image): a known name whose program is on PATH."""
    if name and name not in RUNTIMES:
        raise LaunchError(f"--runtime must be {_one_of(RUNTIMES)}, got '{name}'")
    if not image:
        return name
    if not os.path.exists(image):
        raise LaunchError(f"container image not found: {image} (build it with: apptainer build hpcdl.sif "
                          "Singularity.def)")
    # No name: by the image's kind. A directory or SquashFS file is what `make image` writes for
    # Charliecloud (launch/common.sh); anything else is a SIF for Apptainer or Singularity.
    charliecloud_kind = os.path.isdir(image) or image.endswith((".sqfs", ".squashfs"))
    candidates = [name] if name else (["charliecloud"] if charliecloud_kind else list(AUTO_RUNTIMES))
    for candidate in candidates:
        if machine.which(RUNTIMES[candidate]):
            return candidate
    if charliecloud_kind and not name:
        name = "charliecloud"
    if name and RUNTIMES[name] != name:
        raise LaunchError(f"no container runtime found ({name}: {RUNTIMES[name]} is not on PATH)")
    raise LaunchError(f"no container runtime found ({name or _one_of(AUTO_RUNTIMES)} not on PATH); on TACC "
                      "systems: module load tacc-apptainer")


def check_iface(iface: str) -> None:
    for item in iface.split(","):
        if "/" in item:
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError:
                raise LaunchError(f"--iface: '{item}' is no subnet (10.1.2.0/24) or interface name (ib0)") from None
        elif not IFACE_NAME.match(item):
            raise LaunchError(f"--iface: '{item}' is no subnet (10.1.2.0/24) or interface name (ib0)")


def decide_mpirun(options: argparse.Namespace, entry_args: list[str], machine: Machine) -> MpirunLaunch:
    """Check every value and work out the rest (ranks, hosts, threads); raises LaunchError."""
    env = machine.env
    notes: list[str] = []

    np = _count(options.np, "-np") if options.np != "" else None
    threads = _count(options.threads, "--threads") if options.threads != "" else None
    if not WHOLE.match(options.abort_grace):
        raise LaunchError(f"--abort-grace must be a whole number of seconds, got '{options.abort_grace}'")
    oversubscribe = _flag01(options.oversubscribe, "HPCDL_OVERSUBSCRIBE")
    dry_run = _flag01(options.dry_run, "HPCDL_DRY_RUN")
    if options.nv not in ("", "0", "1"):
        raise LaunchError(f"HPCDL_NV must be 0 or 1, got '{options.nv}'")
    if options.hosts and options.hostfile:
        raise LaunchError("give -H or --hostfile, not both")
    if options.iface:
        check_iface(options.iface)
    try:
        mpi_args = shlex.split(options.mpi_args)
    except ValueError as err:
        raise LaunchError(f"--mpi-args: {err} in '{options.mpi_args}'") from None
    export = options.export.split()
    for name in export:
        if not ENV_NAME.match(name):
            raise LaunchError(f"--export wants variable names separated by spaces, got '{name}'")
    keepalive_text = env.get("HPCDL_OOB_KEEPALIVE", "10 5 3")
    keepalive = keepalive_text.split()
    if keepalive and (len(keepalive) > 3 or not all(WHOLE.match(w) for w in keepalive)):
        raise LaunchError(f"HPCDL_OOB_KEEPALIVE must be \"TIME INTVL PROBES\" in seconds, got '{keepalive_text}'")
    if keepalive:
        keepalive += ["5", "3"][len(keepalive) - 1:]

    # Hosts: -H, a hostfile, a virtual cluster's nodes.
    hosts = parse_host_list(options.hosts) if options.hosts else []
    file_hosts = parse_hostfile(options.hostfile) if options.hostfile else []
    iface, rsh_agent, vcluster_state = options.iface, "", env.get("HPCDL_VCLUSTER_STATE", "") or VCLUSTER_STATE
    if options.vcluster:
        cluster = load_vcluster(options.vcluster, vcluster_state)
        for host in file_hosts:
            cluster.address_of(host.name)
        if hosts:
            hosts = _merge([Host(cluster.address_of(h.name), h.slots) for h in hosts])
        elif not file_hosts:
            nodes = len(cluster.nodes)
            per_node = math.ceil(np / nodes) if np is not None else 2
            hosts = [Host(address, per_node) for _, address in cluster.nodes]
            np = np if np is not None else per_node * nodes
        iface = iface or cluster.subnet
        rsh_agent = str(Path(machine.root) / "launch" / "vcluster-rsh")
    listed = hosts or file_hosts
    slots = total_slots(listed) if listed else None

    in_job = bool(env.get("SLURM_NTASKS")) and not listed
    if np is None:
        if slots is not None:
            np = slots
        elif in_job:
            np = _count(env["SLURM_NTASKS"], "SLURM_NTASKS")
        else:
            np = machine.gpu_count() or 2
    if slots is not None and np > slots and not oversubscribe:
        where = f"-H {options.hosts}" if options.hosts else (f"--hostfile {options.hostfile}" if file_hosts
                                                            else f"--vcluster {options.vcluster}")
        raise LaunchError(f"-np {np} is more ranks than the {slots} slots of {where}: give more slots "
                          "(HOST:SLOTS) or --oversubscribe")

    # Ranks per host (for the threads) and which ranks each host gets (for the supervisor).
    placed = fill_slots(listed, np) if listed else None
    if placed is not None:
        ranks_per_host = max(len(r) for r in placed)
        rank_map = "".join(f"{h.name}={','.join(map(str, r))};" for h, r in zip(listed, placed, strict=True))
    else:
        rank_map = ""
        nodes_text = env.get("SLURM_JOB_NUM_NODES", "")
        if listed:
            ranks_per_host = math.ceil(np / len(listed))
        elif COUNT.match(nodes_text):  # inside a Slurm job, Open MPI takes its nodes
            ranks_per_host = math.ceil(np / int(nodes_text))
        else:
            ranks_per_host = np
            if np > machine.cores and not oversubscribe:
                notes.append(f"{np} ranks on {machine.cores} cores: adding --oversubscribe")
                oversubscribe = True
    threads = threads or max(1, machine.cores // ranks_per_host)

    mpirun = options.mpirun
    found = machine.which(mpirun)
    if not mpirun or not found:
        raise LaunchError(f"{mpirun} not found; load your MPI (e.g. module load openmpi) or pass --mpirun")
    runtime = check_runtime(options.runtime, options.image, machine)
    return MpirunLaunch(
        np=np, hosts=",".join(f"{h.name}:{h.slots}" for h in hosts), hostfile=options.hostfile, iface=iface,
        vcluster=options.vcluster, vcluster_state=vcluster_state, rsh_agent=rsh_agent,
        abort_grace=int(options.abort_grace), threads=threads, ranks_per_host=ranks_per_host,
        oversubscribe=oversubscribe, mpirun=mpirun, open_mpi=machine.is_open_mpi(found), mpi_args=mpi_args,
        export=export, keepalive=keepalive, rank_map=rank_map, python=options.python, entry=options.entry,
        image=options.image, runtime=runtime, bind=options.bind, nv=options.nv, dry_run=dry_run, entry_args=entry_args,
        notes=notes)


# ---------------------------------------------------------------------- shell output
def shell_assignments(values: Mapping[str, object]) -> str:
    """NAME=value lines for ``eval``: strings quoted, bools as 1/0, lists as arrays."""
    lines = []
    for name, value in values.items():
        if isinstance(value, bool):
            lines.append(f"{name}={int(value)}")
        elif isinstance(value, list):
            lines.append(f"{name}=({' '.join(shlex.quote(str(v)) for v in value)})")
        else:
            lines.append(f"{name}={shlex.quote(str(value))}")
    return "\n".join(lines) + "\n"


def mpirun_shell(launch: MpirunLaunch) -> str:
    return shell_assignments({
        "NP": launch.np, "HOSTS": launch.hosts, "HOSTFILE": launch.hostfile, "IFACE": launch.iface,
        "VCLUSTER": launch.vcluster, "VCLUSTER_STATE": launch.vcluster_state, "RSH_AGENT": launch.rsh_agent,
        "ABORT_GRACE": launch.abort_grace, "THREADS": launch.threads, "RANKS_PER_HOST": launch.ranks_per_host,
        "OVERSUBSCRIBE": launch.oversubscribe, "MPIRUN": launch.mpirun, "OPEN_MPI": launch.open_mpi,
        "MPI_WORDS": launch.mpi_args, "EXPORT_NAMES": launch.export, "OOB_KEEPALIVE": launch.keepalive,
        "RANK_MAP": launch.rank_map, "HPCDL_PYTHON": launch.python, "HPCDL_ENTRY": launch.entry,
        "HPCDL_IMAGE": launch.image, "HPCDL_RUNTIME": launch.runtime, "HPCDL_BIND": launch.bind,
        "HPCDL_NV": launch.nv, "HPCDL_DRY_RUN": launch.dry_run, "ENTRY_ARGS": launch.entry_args,
    })


def help_shell(parser: argparse.ArgumentParser) -> str:
    return f"printf '%s\\n' {shlex.quote(parser.format_help().rstrip())}\nexit 0\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[0] != "mpirun":
        fail("usage: launch_args.py mpirun REPO_ROOT ARGS...")
    env = dict(os.environ)
    parser = mpirun_parser(env)
    options, entry_args = split_words(parser, args[2:])
    if options.help:
        sys.stdout.write(help_shell(parser))
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    machine = Machine(env=env, path=env.get("LAUNCH_CALLER_PATH") or env.get("PATH", ""), cores=cores, root=args[1])
    try:
        launch = decide_mpirun(options, entry_args, machine)
    except LaunchError as err:
        fail(str(err))
    for note in launch.notes:
        print(f"[hpcdl] {note}", file=sys.stderr)
    sys.stdout.write(mpirun_shell(launch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
