"""The command line of every launch script (launch/mpirun.sh, slurm.sbatch, frontera-rtx.sbatch): which
words are the launcher's, which the entry module's, the host lists, and one help text per script.

The rule for the words: everything after the first ``--`` is the entry module's; before it, a
launcher option is the launcher's wherever it stands (``--epochs 1 -np 2`` is -np for mpirun), and
every other word goes, in order, to the entry module. Options are matched whole: an abbreviation or another
spelling of one (``--dry``, ``--dryrun``, ``-np2``) is refused in one line rather than handed on,
and an option that takes a value takes the next word whatever it looks like (``--mpi-args -npernode``).
Each option is also read from an environment variable; a flag given on the command line wins, and a
host list given there (-H, --hostfile) replaces one given in the environment.
Host lists count slots as Open MPI does: ``HOST`` alone is one slot, a repeated host adds up
(``-H a,a,b`` is two slots on a). A virtual cluster (hpcdl.tools.vcluster) is read from its state
file ``<state>/<name>.json`` (``subnet`` and ``nodes[].hostname/address``), the format that tool writes.

Standard library only: ``python -m hpcdl.launch`` (launch/common.sh) runs it before a virtual
environment is known. :mod:`hpcdl.launching.plan` decides what the options mean.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from hpcdl.launching.rank_command import AUTO_RUNTIMES, RUNTIMES, LaunchError, one_of

VCLUSTER_STATE = "/run/hpcdl-vcluster"
VCLUSTER_NAME = re.compile(r"^[a-z0-9]{1,6}$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
IFACE_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,15}$")
COUNT = re.compile(r"^[1-9][0-9]*$")
WHOLE = re.compile(r"^[0-9]+$")


# ---------------------------------------------------------------------- host lists
@dataclass
class Host:
    name: str
    slots: int | None  # None: a hostfile line without slots= (Open MPI then counts the node's cores)


def positive_count(text: str, what: str) -> int:
    if not COUNT.match(text):
        raise LaunchError(f"{what} must be a positive whole number, got '{text}'")
    return int(text)


def merge_hosts(hosts: list[Host]) -> list[Host]:
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
    return merge_hosts(hosts)


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
            slots = positive_count(slots_text, f"the slots in {where}")
        for word in words[1:]:
            key, _, value = word.partition("=")
            if key == "slots":
                slots = positive_count(value, f"slots= in {where}")
            elif key in ("max_slots", "max-slots"):
                positive_count(value, f"{key}= in {where}")
            else:
                raise LaunchError(f"{where}: '{word}' is not 'slots=N' or 'max_slots=N'")
        if not name:
            raise LaunchError(f"{where} names no host")
        hosts.append(Host(name, slots))
    if not hosts:
        raise LaunchError(f"hostfile lists no hosts: {path}")
    return merge_hosts(hosts)


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
    """argparse's help, its first line starting 'Usage:' as every launch script's does; one layout whatever the
    terminal and the script's longest option, so that the options every script takes read the same in each."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=18, width=100)

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


WORDS_RULE = """\
Which words are whose: everything after the first -- goes to the entry module (hpcdl.train
unless --entry says otherwise). Before it, an option below is the launcher's wherever it stands
(--epochs 5 --threads 4: --threads is the launcher's), and every other word goes, in order, to the
entry module. Options are matched whole: an abbreviation or another spelling of one (--dry,
--dryrun, -np2) is an error, not a word for the entry module. An option's value is the next word,
whatever it starts with. To give the entry module a word that is also a launcher option (its
--help, say), put it after --. Each option is also read from the environment variable shown; a
flag wins."""
COMMON_EPILOG = """\
--  end of the launcher's options: every word after it goes to the entry module
HPCDL_JOIN_CT (environment only): ranks per host for ch-run --join where the launcher does not
  say it (set by mpirun.sh for MPICH-family launchers; Open MPI and Slurm set variables ch-run reads)
HPCDL_ROOT (environment only) is the repository; it is found by itself, set it when the
  script cannot tell (a copy of the script submitted from elsewhere).
Exit status: 2 for a bad option or setting (one 'error: ...' line, nothing started); else the job's."""

MPIRUN_DESCRIPTION = f"""\
Runs one rank per GPU (or per slot on a CPU machine) with mpirun and the flags Horovod
recommends: -bind-to none -map-by slot, the environment exported to every rank, and
OMP_NUM_THREADS set so that the ranks of a host share its cores instead of fighting over them.

  launch/mpirun.sh -np 2                          # 2 ranks, digits, defaults of hpcdl.train
  launch/mpirun.sh -np 4 --epochs 5 --output-dir runs/try1
  launch/mpirun.sh -np 8 --hostfile hosts.txt --image hpcdl.sif -- --dataset cifar10
  launch/mpirun.sh -np 2 --entry hpcdl.doctor     # show which rank got which GPU

{WORDS_RULE}"""
MPIRUN_EPILOG = f"""\
HPCDL_OOB_KEEPALIVE (environment only): "TIME INTVL PROBES" of Open MPI's daemon keepalives
  (default "10 5 3": a cut node is noticed in 10-25 s; "" = Open MPI's 8 min)
HPCDL_VCLUSTER_STATE (environment only): where the virtual clusters are listed
  (default /run/hpcdl-vcluster)
PMIX_MCA_gds (environment only): PMIx's data store under Open MPI (default hash: the shared-memory
  store's lock can fail when two jobs start at the same moment on one machine)
Host lists count slots as Open MPI does: HOST alone is one slot, a repeated host adds up
(-H a,a,b is two ranks' room on a, one on b); -np above the slots needs --oversubscribe.
{COMMON_EPILOG}"""

SLURM_DESCRIPTION = f"""\
Starts one rank per task with 'srun --mpi=pmix --kill-on-bad-exit=1', on the host or inside a
container, and trains with python -m hpcdl.train. Defaults (override with sbatch flags):
1 node, 4 tasks per node (= GPUs per node), 8 CPUs per task, --gres=gpu:4, 1 hour.

GPU placement: with --gres=gpu:N every rank sees all N GPUs and takes the one at its local
rank; with --gpus-per-task=1 each rank sees exactly one and uses it. Both work unchanged.

When the time limit is 120 s away Slurm signals this script (--signal=B:USR1@120); the ranks
checkpoint, the job is requeued, and the requeued job resumes (hpcdl.train --resume).

  sbatch launch/slurm.sbatch --epochs 10
  sbatch -N 2 --ntasks-per-node=4 launch/slurm.sbatch --image hpcdl.sif -- --dataset cifar10
  sbatch -n 2 launch/slurm.sbatch --entry hpcdl.doctor     # the rank -> GPU table

{WORDS_RULE} (sbatch passes the environment on.)"""

FRONTERA_DESCRIPTION = f"""\
For Frontera's rtx queue: 4 GPUs per node, so 4 tasks per node (-n = 4 x -N). Loads modules,
then starts the ranks with ibrun (TACC's MPI launcher; srun --mpi=pmix where ibrun is absent).
Every rank sees the node's 4 GPUs and takes the one at its local rank (ibrun sets
MPI_LOCALRANKID or MV2_COMM_WORLD_LOCAL_RANK); 'python -m hpcdl.doctor' shows the mapping.

With --image, each rank runs in the container (ibrun apptainer exec --nv hpcdl.sif ...): the
image's MPI must be of the same family as the host MPI that ibrun starts (see docs/cluster.md).

When the time limit is 120 s away the ranks checkpoint, the job is requeued and resumes.

  sbatch -A PROJ launch/frontera-rtx.sbatch --epochs 10
  sbatch -A PROJ -N 2 -n 8 launch/frontera-rtx.sbatch --image $SCRATCH/hpcdl.sif -- --dataset cifar10
  idev -N 1 -n 4 -p rtx, then: bash launch/frontera-rtx.sbatch --entry hpcdl.doctor

{WORDS_RULE} (sbatch passes the environment on.)"""


@dataclass(frozen=True)
class Script:
    """One launch script: its name in launch/, its usage line and help text."""

    name: str
    usage: str
    description: str
    epilog: str


SCRIPTS = {
    "mpirun": Script("launch/mpirun.sh", "launch/mpirun.sh [options] [--] [entry module options]",
                     MPIRUN_DESCRIPTION, MPIRUN_EPILOG),
    "slurm": Script("launch/slurm.sbatch",
                    "sbatch [sbatch options] launch/slurm.sbatch [options] [--] [hpcdl.train options]",
                    SLURM_DESCRIPTION, COMMON_EPILOG),
    "frontera-rtx": Script("launch/frontera-rtx.sbatch", "sbatch -A PROJECT [sbatch options] "
                           "launch/frontera-rtx.sbatch [options] [--] [hpcdl.train options]",
                           FRONTERA_DESCRIPTION, COMMON_EPILOG),
}


@dataclass(frozen=True)
class Option:
    """One launcher option: its flags, help, and the environment variable that gives its default."""

    flags: tuple[str, ...]
    help: str
    variable: str = ""
    default: str | None = ""  # when the variable is unset or empty; None: not given (a host list, the modules)
    metavar: str = ""  # "" for a switch, which stores ``const``
    const: str = "1"
    dest: str | None = None
    empty_is_a_value: bool = False  # HPCDL_MODULES='' loads none


def value(flags: str, metavar: str, text: str, variable: str = "", default: str | None = "", dest: str | None = None,
          empty_is_a_value: bool = False) -> Option:
    """An option that takes a value."""
    return Option(tuple(flags.split()), text, variable, default, metavar, dest=dest, empty_is_a_value=empty_is_a_value)


def switch(flags: str, text: str, variable: str, const: str, default: str, dest: str | None = None) -> Option:
    """An option that takes none: given, it stores ``const``."""
    return Option(tuple(flags.split()), text, variable, default, "", const, dest)


THREADS_HELP = "OpenMP threads per rank (OMP_NUM_THREADS; default: {})"
MPIRUN_OPTIONS = [
    value("-np -n --np", "N", "number of ranks (HPCDL_NP; default: the slots of -H, --hostfile or --vcluster; "
          "SLURM_NTASKS inside a Slurm job; else the GPUs of this host, or 2 without GPUs)", "HPCDL_NP", dest="np"),
    # No variable here: a host list on the command line replaces the environment's (split_words).
    value("--hostfile", "FILE", "hostfile, one 'HOST slots=N' line per node (HPCDL_HOSTFILE)", default=None),
    value("-H --host", "LIST", "hosts as HOST:SLOTS,HOST:SLOTS (HPCDL_HOSTS). Neither -H nor --hostfile inside a "
          "Slurm job: Open MPI uses the job's nodes, -np defaults to SLURM_NTASKS. Either on the command line "
          "replaces both variables", default=None, dest="hosts"),
    value("--iface", "IF", "the network the job uses, an interface name (ib0, eth0) or a subnet (10.1.2.0/24) "
          "(HPCDL_IFACE): Open MPI's TCP transport and its daemons' out-of-band channel (btl_tcp_if_include, "
          "oob_tcp_if_include) and torch.distributed's rendezvous address; a name also goes to Horovod's Gloo "
          "(HOROVOD_GLOO_IFACE), torch's Gloo (GLOO_SOCKET_IFNAME) and NCCL (NCCL_SOCKET_IFNAME)", "HPCDL_IFACE"),
    value("--vcluster", "NAME", "run on a virtual cluster (python -m hpcdl.tools.vcluster up) (HPCDL_VCLUSTER): its "
          "nodes as hosts (-H may name them, with slots: node1:3,node2:1; default: -np spread evenly), its subnet "
          "as --iface, launch/vcluster-rsh to reach them", "HPCDL_VCLUSTER"),
    value("--abort-grace", "S", "when a rank aborts the job (a lost node, a stall) and mpirun has not ended S "
          "seconds later, kill it (HPCDL_ABORT_GRACE; default 20; 0 = no supervisor)", "HPCDL_ABORT_GRACE", "20"),
    value("--threads", "N", THREADS_HELP.format("cores / ranks per host"), "OMP_NUM_THREADS"),
    switch("--oversubscribe", "allow more ranks than slots or cores (HPCDL_OVERSUBSCRIBE=1; added by itself when "
           "-np exceeds the cores of this machine and there is no host list)", "HPCDL_OVERSUBSCRIBE", "1", "0"),
    value("--mpirun", "CMD", "the mpirun to use (HPCDL_MPIRUN; default: mpirun on PATH)", "HPCDL_MPIRUN", "mpirun"),
    value("--mpi-args", '"ARGS"', 'extra words for mpirun, e.g. "-mca pml ob1 -mca btl ^openib" to force TCP when '
          "RDMA misbehaves (HPCDL_MPI_ARGS)", "HPCDL_MPI_ARGS"),
    value("--export", '"VARS"', "more environment variables to pass to every rank (HPCDL_EXPORT)", "HPCDL_EXPORT"),
]
SLURM_OPTIONS = [
    value("--mpi", "TYPE", "srun's --mpi plugin (HPCDL_SRUN_MPI; default: pmix)", "HPCDL_SRUN_MPI", "pmix"),
    value("--srun-args", '"ARGS"', "extra words for srun (HPCDL_SRUN_ARGS)", "HPCDL_SRUN_ARGS"),
    value("--threads", "N", THREADS_HELP.format("--cpus-per-task"), "OMP_NUM_THREADS"),
]
FRONTERA_OPTIONS = [
    value("--modules", '"LIST"', "modules to load first (HPCDL_MODULES; default: 'cuda' on the host, "
          "'tacc-apptainer' with --image; '' loads none)", "HPCDL_MODULES", None, empty_is_a_value=True),
    value("--launcher", "NAME", "ibrun, srun or image-mpirun (HPCDL_LAUNCHER; default: ibrun when present, else "
          "srun). image-mpirun: the image's own mpirun starts the ranks inside one container (one node only; no "
          "host MPI needed, so no MPI mismatch)", "HPCDL_LAUNCHER"),
    value("--threads", "N", THREADS_HELP.format("node cores / tasks per node"), "OMP_NUM_THREADS"),
]
BATCH_OPTIONS = [
    value("--output-dir", "DIR", "where hpcdl.train writes checkpoints and summary.json (HPCDL_OUTPUT_DIR; "
          "default: runs/<job name>-<job id>, kept across requeues)", "HPCDL_OUTPUT_DIR"),
    switch("--no-resume", "start a new run: no --resume for hpcdl.train, which then refuses an output folder "
           "holding an earlier run's checkpoints (HPCDL_RESUME=0). A requeued start of the job "
           "(SLURM_RESTART_COUNT > 0) resumes its own run all the same", "HPCDL_RESUME", "0", "1", "resume"),
    switch("--no-requeue", "do not requeue when the time limit is near (HPCDL_REQUEUE=0)", "HPCDL_REQUEUE", "0",
           "1", "requeue"),
]
COMMON_OPTIONS = [
    value("--python", "PATH", "interpreter for the ranks (HPCDL_PYTHON; default: <repo>/.venv/bin/python, "
          "'python' inside a container)", "HPCDL_PYTHON"),
    value("--entry", "MODULE", "Python module each rank runs (HPCDL_ENTRY; default: hpcdl.train; hpcdl.doctor "
          "shows the rank -> GPU mapping)", "HPCDL_ENTRY", "hpcdl.train"),
    value("--image", "IMAGE", "run every rank inside this image (HPCDL_IMAGE): a .sif (Apptainer/Singularity), or "
          "the directory or .sqfs that make image builds (Charliecloud's ch-run)", "HPCDL_IMAGE"),
    value("--runtime", "NAME", f"the container runtime: {one_of(RUNTIMES)} (HPCDL_RUNTIME; default: by the "
          f"image's kind: charliecloud for a directory or .sqfs, else {' or '.join(AUTO_RUNTIMES)}, whichever is "
          "on PATH)", "HPCDL_RUNTIME"),
    value("--bind", "LIST", "extra container bind mounts, comma separated SRC[:DST] (HPCDL_BIND)", "HPCDL_BIND"),
    switch("--no-nv", "do not pass --nv to the container runtime (HPCDL_NV=0; default: --nv when nvidia-smi "
           "exists)", "HPCDL_NV", "0", "", "nv"),
    switch("--dry-run", "print the command and stop (HPCDL_DRY_RUN=1)", "HPCDL_DRY_RUN", "1", "0"),
    switch("-h --help", "this text", "", "1", ""),
]
GROUPS = {
    "mpirun": [("where and how many (mpirun)", MPIRUN_OPTIONS)],
    "slurm": [("srun", SLURM_OPTIONS), ("the batch job", BATCH_OPTIONS)],
    "frontera-rtx": [("Frontera", FRONTERA_OPTIONS), ("the batch job", BATCH_OPTIONS)],
}


def parser_for(script: str, env: Mapping[str, str]) -> argparse.ArgumentParser:
    """The parser of one launch script ('mpirun', 'slurm' or 'frontera-rtx'); defaults from ``env``."""
    about = SCRIPTS[script]
    parser = _Parser(prog=about.name, usage=about.usage, description=about.description, epilog=about.epilog,
                     formatter_class=_Formatter, allow_abbrev=False, add_help=False)
    for title, options in [*GROUPS[script], ("what each rank runs (every launch script)", COMMON_OPTIONS)]:
        group = parser.add_argument_group(title)
        for option in options:
            given = env.get(option.variable) if option.variable else None
            default = given if given is not None and (given or option.empty_is_a_value) else option.default
            dest = option.dest or next(f for f in option.flags if f.startswith("--"))[2:].replace("-", "_")
            if option.metavar:
                group.add_argument(*option.flags, dest=dest, metavar=option.metavar, default=default, help=option.help)
            else:
                group.add_argument(*option.flags, dest=dest, action="store_const", const=option.const, default=default,
                                   help=option.help)
    return parser


def mpirun_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    return parser_for("mpirun", env)


def split_words(parser: argparse.ArgumentParser, argv: Sequence[str],
                env: Mapping[str, str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """(the launcher's options, the entry module's words), by the rule in the module docstring."""
    words = list(argv)
    cut = words.index("--") if "--" in words else len(words)
    # An option's value is the next word, even one that looks like an option (-npernode, -host):
    # joined as OPTION=VALUE, argparse takes it whole.
    takes_value = {option for action in parser._actions if isinstance(action, argparse._StoreAction)
                   for option in action.option_strings}
    mine: list[str] = []
    index = 0
    while index < cut:
        word = words[index]
        if word in takes_value and index + 1 < cut:
            mine.append(f"{word}={words[index + 1]}")
            index += 2
        else:
            mine.append(word)
            index += 1
    check_near_misses(parser, mine)
    options, others = parser.parse_known_args(mine)
    if hasattr(options, "hosts"):
        host_lists_from_environment(options, env or {})
    return options, others + words[cut + 1:]


def _letters(option: str) -> str:
    """An option's letters alone: --dry-run, --dryrun, -dry_run and --DRY-RUN are one name."""
    return option.lstrip("-").replace("-", "").replace("_", "").lower()


def check_near_misses(parser: argparse.ArgumentParser, words: Sequence[str]) -> None:
    """One line and exit 2 for a word before ``--`` that is meant as a launcher option but is not one: an
    abbreviation (--dry), another spelling (--dryrun, -threads) or -np glued to its count (-np2). Passed on, it
    would start the job and fail on every rank (or, abbreviated, be taken by the entry module's own parser)."""
    options = {option for action in parser._actions for option in action.option_strings}
    longs = sorted(option for option in options if option.startswith("--"))
    after = "options are matched whole; a word for the entry module that looks like one goes after --"
    for word in words:
        name = word.split("=", 1)[0]
        if not name.startswith("-") or name in options or name == "-":
            continue
        if "-np" in options and name.startswith("-np"):
            rest = name[3:]
            if rest.isdigit():
                parser.error(f"{word}: write the count as a word of its own, -np {rest} (mpirun does not read "
                             f"-np{rest} either)")
            parser.error(f"'{word}' is not an option of {parser.prog}; mpirun's own options go in "
                         f'--mpi-args "...", words for the entry module after --')
        meant = [option for option in sorted(options) if _letters(option) == _letters(name)]
        if not meant and name.startswith("--") and len(name) > 2:
            meant = [option for option in longs if option.startswith(name)]
        if meant:
            guess = meant[0] if len(meant) == 1 else " or ".join(meant)
            parser.error(f"'{name}' is not an option of {parser.prog}: did you mean {guess}? ({after})")


def host_lists_from_environment(options: argparse.Namespace, env: Mapping[str, str]) -> None:
    """-H and --hostfile: from the command line when either is there, else from HPCDL_HOSTS / HPCDL_HOSTFILE."""
    if options.hosts is None and options.hostfile is None:
        options.hosts, options.hostfile = env.get("HPCDL_HOSTS", ""), env.get("HPCDL_HOSTFILE", "")
    options.hosts, options.hostfile = options.hosts or "", options.hostfile or ""


def help_shell(parser: argparse.ArgumentParser) -> str:
    return f"printf '%s\\n' {shlex.quote(parser.format_help().rstrip())}\nexit 0\n"


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
