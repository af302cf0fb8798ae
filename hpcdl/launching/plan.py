"""What a launch script's options mean on this machine, and the command it runs: every decision of
launch/mpirun.sh, slurm.sbatch and frontera-rtx.sbatch (ranks, hosts, threads, the container, the MPI
family, the batch job's output folder and requeueing), each value checked before anything starts.

:func:`plan` turns a script's parsed options (:mod:`hpcdl.launching.args`) into a :class:`Launch`:
the words to run, what to export first, the notes to show, and how the shell runs it (``exec``, or as a
batch step that requeues near the time limit). Standard library only.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import shlex
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from hpcdl.launching.args import (
    COUNT,
    ENV_NAME,
    IFACE_NAME,
    VCLUSTER_STATE,
    WHOLE,
    Host,
    fill_slots,
    load_vcluster,
    merge_hosts,
    parse_host_list,
    parse_hostfile,
    positive_count,
    shell_assignments,
    total_slots,
)
from hpcdl.launching.cores import CoreShare
from hpcdl.launching.rank_command import (
    RUNTIMES,
    LaunchError,
    RankSettings,
    check_image_mpi,
    one_of,
    rank_command,
)

# What every rank is sent by mpirun -x (local ranks inherit the whole environment; -x reaches other hosts).
MPIRUN_EXPORTS = ("OMP_NUM_THREADS", "PYTHONUNBUFFERED", "PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "PMIX_MCA_gds")
EXPORT_PREFIXES = ("NCCL_", "HOROVOD_", "HPCDL_", "UCX_", "GLOO_")


@dataclass
class Machine:
    """What the decisions depend on besides the arguments (a test gives its own)."""

    env: Mapping[str, str]
    path: str  # the caller's PATH: a python3 shim (pyenv) may have changed ours
    cores: int  # this process may run on (hpcdl.launching.cores.usable_cores)
    root: str  # the repository (launch/vcluster-rsh lives there)
    gpus: int | None = None  # None: ask nvidia-smi
    versions: dict[str, str] = field(default_factory=dict)

    def which(self, program: str) -> str | None:
        return shutil.which(program, path=self.path)

    def mpi_version(self, mpirun: str) -> str:
        """What ``mpirun --version`` says (asked once per program)."""
        if mpirun not in self.versions:
            try:
                done = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=60)
                self.versions[mpirun] = done.stdout + done.stderr
            except (OSError, subprocess.SubprocessError):
                self.versions[mpirun] = ""
        return self.versions[mpirun]

    def mpi_version_line(self, mpirun: str) -> str:
        """Its first line that says something (for the doctor inside an image)."""
        lines = [line for line in self.mpi_version(mpirun).splitlines() if line.strip() and not line.startswith("[")]
        return lines[0] if lines else ""

    def is_open_mpi(self, mpirun: str) -> bool:
        return "Open MPI" in self.mpi_version(mpirun)

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
class Launch:
    """What the shell does: export, show, then run ``words`` (``how``: exec, step = a batch job step that
    requeues near the time limit, or dry-run = stop after showing)."""

    words: list[str]
    shown: list[str]  # the command as shown (without a supervisor in front)
    how: str
    exports: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    requeue: bool = False


def check_runtime_name(name: str) -> None:
    if name and name not in RUNTIMES and name != "ch-run":
        raise LaunchError(f"--runtime must be {one_of(RUNTIMES)}, got '{name}'")


def rank_settings(options: argparse.Namespace) -> RankSettings:
    if options.nv not in ("", "0", "1"):
        raise LaunchError(f"HPCDL_NV must be 0 or 1, got '{options.nv}'")
    check_runtime_name(options.runtime)
    return RankSettings(python=options.python, entry=options.entry, image=options.image, runtime=options.runtime,
                        bind=options.bind, nv=options.nv)


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

    np = positive_count(options.np, "-np") if options.np != "" else None
    threads = positive_count(options.threads, "--threads") if options.threads != "" else None
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
            hosts = merge_hosts([Host(cluster.address_of(h.name), h.slots) for h in hosts])
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
            np = positive_count(env["SLURM_NTASKS"], "SLURM_NTASKS")
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
    threads = CoreShare(machine.cores, ranks_per_host).threads(threads)

    mpirun = options.mpirun
    found = machine.which(mpirun)
    if not mpirun or not found:
        raise LaunchError(f"{mpirun} not found; load your MPI (e.g. module load openmpi) or pass --mpirun")
    check_runtime_name(options.runtime)
    return MpirunLaunch(
        np=np, hosts=",".join(f"{h.name}:{h.slots}" for h in hosts), hostfile=options.hostfile, iface=iface,
        vcluster=options.vcluster, vcluster_state=vcluster_state, rsh_agent=rsh_agent,
        abort_grace=int(options.abort_grace), threads=threads, ranks_per_host=ranks_per_host,
        oversubscribe=oversubscribe, mpirun=mpirun, open_mpi=machine.is_open_mpi(found), mpi_args=mpi_args,
        export=export, keepalive=keepalive, rank_map=rank_map, python=options.python, entry=options.entry,
        image=options.image, runtime=options.runtime, bind=options.bind, nv=options.nv, dry_run=dry_run,
        entry_args=entry_args, notes=notes)



# ---------------------------------------------------------------------- the commands
def mpirun_command(launch: MpirunLaunch, settings: RankSettings, machine: Machine) -> Launch:
    """launch/mpirun.sh's command: mpirun (Open MPI's or an MPICH-family one) in front of each rank's words."""
    env = machine.env
    exports = {"OMP_NUM_THREADS": str(launch.threads), "PYTHONUNBUFFERED": "1"}
    if launch.vcluster:  # launch/vcluster-rsh looks hosts up in this cluster only
        exports.update(HPCDL_VCLUSTER=launch.vcluster, HPCDL_VCLUSTER_STATE=launch.vcluster_state)
    # ch-run --join learns the ranks per host from Open MPI's variables; MPICH's Hydra sets none it reads.
    join_count = "" if launch.open_mpi else str(launch.ranks_per_host)
    rank = rank_command(settings, machine.root, env, machine.which, join_count=join_count)
    exports.update(rank.exports)
    if settings.image:
        # The image's MPI must be this launcher's family; the doctor inside names the launcher's version.
        check_image_mpi(settings.image, "openmpi" if launch.open_mpi else "mpich", launch.mpirun)
        exports["HPCDL_HOST_MPI"] = machine.mpi_version_line(machine.which(launch.mpirun) or launch.mpirun)
    words = [launch.mpirun]
    if launch.open_mpi:
        # PMIx's shared-memory store (gds ds21) takes a lock that two jobs starting at the same moment on one
        # machine can fail in ("PMIX ERROR ... gds_ds21_lock_pthread.c"); its hash store takes none.
        exports["PMIX_MCA_gds"] = env.get("PMIX_MCA_gds") or "hash"
        words += ["-np", str(launch.np), "-bind-to", "none", "-map-by", "slot"]
        if launch.hostfile:
            words += ["--hostfile", launch.hostfile]
        if launch.hosts:
            words += ["-H", launch.hosts]
        if launch.rsh_agent:
            words += ["--mca", "plm_rsh_agent", launch.rsh_agent, "--mca", "btl", "tcp,self,vader"]
        if launch.iface:
            # One network for everything: ranks' TCP traffic and the daemons' control channel.
            words += ["--mca", "btl_tcp_if_include", launch.iface, "--mca", "oob_tcp_if_include", launch.iface]
            # torch.distributed's rendezvous takes rank 0's address on it (hpcdl.runtime.rendezvous.root_address).
            exports["HPCDL_IFACE"] = launch.iface
            if "/" not in launch.iface:  # Gloo's and NCCL's variables take interface names only
                exports.update(HOROVOD_GLOO_IFACE=launch.iface, NCCL_SOCKET_IFNAME=launch.iface,
                               GLOO_SOCKET_IFNAME=launch.iface)
        if len(launch.keepalive) == 3:
            time, interval, probes = launch.keepalive
            words += ["--mca", "oob_tcp_keepalive_time", time, "--mca", "oob_tcp_keepalive_intvl", interval,
                      "--mca", "oob_tcp_keepalive_probes", probes]
        if launch.oversubscribe:
            words.append("--oversubscribe")
        if os.geteuid() == 0:
            words.append("--allow-run-as-root")
        # Local ranks inherit the whole environment; -x also sends these to the other hosts.
        present = {**env, **exports}
        names = list(MPIRUN_EXPORTS) + sorted(n for n in present if n.startswith(EXPORT_PREFIXES)) + launch.export
        for name in dict.fromkeys(names):
            if name in present:
                words += ["-x", name]
    else:
        # MPICH-family launchers (MPICH, Intel MPI, MVAPICH2) pass the whole environment by default.
        words += ["-n", str(launch.np)]
        if launch.hostfile:
            words += ["-f", launch.hostfile]
        if launch.hosts:
            words += ["-hosts", launch.hosts]
        words += ["-genv", "OMP_NUM_THREADS", str(launch.threads)]
    shown = words + launch.mpi_args + rank.words + launch.entry_args
    notes = launch.notes + [f"{launch.np} ranks, {launch.ranks_per_host} per host, {launch.threads} threads each"]
    result = Launch(shown, shown, "dry-run" if launch.dry_run else "exec", exports, notes)
    if launch.abort_grace and launch.open_mpi and not launch.dry_run and machine.which("python3"):
        # RANK_MAP: which ranks each host gets, for the supervisor's "node X lost (ranks ...)" line. The job must
        # see this PATH, not the one a python3 shim (pyenv) sets up for the supervisor itself.
        result.words = ["python3", str(Path(machine.root) / "launch" / "supervise.py"), "--grace",
                        str(launch.abort_grace), "--map", launch.rank_map, "--", *shown]
        result.exports["HPCDL_JOB_PATH"] = machine.path
    return result


def check_batch_job(options: argparse.Namespace, env: Mapping[str, str], how_to_submit: str) -> None:
    """What a batch script refuses before anything else: a run outside a Slurm job (dry runs excepted), bad
    values of its own options."""
    if not env.get("SLURM_JOB_ID") and options.dry_run != "1":
        raise LaunchError(f"not inside a Slurm job: {how_to_submit} (or add --dry-run to see the command)")
    if options.threads and not COUNT.match(options.threads):
        raise LaunchError(f"--threads must be a positive whole number, got '{options.threads}'")
    _flag01(options.dry_run, "HPCDL_DRY_RUN")
    _flag01(options.resume, "HPCDL_RESUME")
    _flag01(options.requeue, "HPCDL_REQUEUE")


def batch_entry_args(options: argparse.Namespace, env: Mapping[str, str]) -> list[str]:
    """What a batch job adds for hpcdl.train: the output folder and --resume, so that a requeued job continues
    from its checkpoint. They come before the user's own arguments, so the same flag given by the user wins.
    --no-resume is about the job's first start (a new run, not an earlier one's folder); a requeued start is
    the same job, whose own checkpoints are the ones in the folder, so it resumes whatever the first start was
    told."""
    if options.entry != "hpcdl.train":
        return []
    output = options.output_dir or f"runs/{env.get('SLURM_JOB_NAME') or 'hpcdl'}-{env.get('SLURM_JOB_ID') or 'local'}"
    resume = options.resume == "1" or (env.get("SLURM_RESTART_COUNT") or "0") != "0"
    return ["--output-dir", output] + (["--resume"] if resume else [])


def batch_launch(words: list[str], options: argparse.Namespace, exports: dict[str, str], note: str) -> Launch:
    requeue = options.requeue == "1"
    return Launch(words, words, "dry-run" if options.dry_run == "1" else "step", exports,
                  [f"{note}, requeue near the limit: {'on' if requeue else 'off'}"], requeue)


def check_srun_mpi(plugin: str, tasks: str) -> None:
    """srun --mpi=none gives the ranks no MPI wiring: each task would start a world of its own, rank 0 of 1, and
    train alone. Refused unless the job has exactly one task (in a dry run outside a job the count is unknown)."""
    if plugin == "none" and tasks != "1":
        count = f"the {tasks} tasks" if tasks else "the tasks"
        raise LaunchError(f"--mpi none: srun would start {count} without MPI's wiring, each alone as rank 0 of 1; "
                          "use pmix (Open MPI, the default) or pmi2 (MPICH family)")


def slurm_command(options: argparse.Namespace, entry_args: list[str], machine: Machine) -> Launch:
    """launch/slurm.sbatch's command: srun in front of each rank's words."""
    env = machine.env
    settings = rank_settings(options)
    check_batch_job(options, env, "submit with 'sbatch launch/slurm.sbatch ...'")
    # srun does not pass the job's --cpus-per-task on to the step by itself (Slurm >= 22.05): say it.
    cpus = env.get("SLURM_CPUS_PER_TASK", "")
    threads = options.threads or cpus or "1"
    check_srun_mpi(options.mpi, env.get("SLURM_NTASKS", ""))
    rank = rank_command(settings, machine.root, env, machine.which)
    # srun's PMIx starts Open MPI ranks; its PMI-2 is what MPICH-family builds speak.
    if options.mpi.startswith("pmix"):
        check_image_mpi(settings.image, "openmpi", f"srun --mpi={options.mpi}")
    elif options.mpi in ("pmi2", "pmi1", "pmi"):
        check_image_mpi(settings.image, "mpich", f"srun --mpi={options.mpi}")
    words = ["srun", f"--mpi={options.mpi}", "--kill-on-bad-exit=1"] + ([f"--cpus-per-task={cpus}"] if cpus else [])
    words += options.srun_args.split() + rank.words + batch_entry_args(options, env) + entry_args
    note = (f"job {env.get('SLURM_JOB_ID') or '(dry run)'} on {env.get('SLURM_JOB_NODELIST') or '?'}: "
            f"{env.get('SLURM_NTASKS') or '?'} tasks, {threads} threads each, GPUs visible: "
            f"{env.get('CUDA_VISIBLE_DEVICES') or 'none'}")
    return batch_launch(words, options, {"OMP_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1", **rank.exports}, note)


FRONTERA_LAUNCHERS = ("ibrun", "srun", "image-mpirun")


def frontera_modules(options: argparse.Namespace) -> str:
    """The modules frontera-rtx.sbatch loads before anything else: the runtime's with an image, else CUDA."""
    if options.modules is not None:
        return str(options.modules)
    return "tacc-apptainer" if options.image else "cuda"


def frontera_command(options: argparse.Namespace, entry_args: list[str], machine: Machine) -> Launch:
    """launch/frontera-rtx.sbatch's command (after its modules are loaded): ibrun, srun, or the image's own
    mpirun inside one container."""
    env = machine.env
    settings = rank_settings(options)
    nodes = positive_count(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1", "SLURM_JOB_NUM_NODES")
    tasks = positive_count(env.get("SLURM_NTASKS") or "4", "SLURM_NTASKS")
    per_node = math.ceil(tasks / nodes)
    cores_text = env.get("SLURM_CPUS_ON_NODE") or str(machine.cores)
    cores = int(cores_text) if COUNT.match(cores_text) else 1
    threads = options.threads or str(CoreShare(cores, per_node).per_rank)
    notes = [f"warning: {per_node} tasks per node but an rtx node has 4 GPUs; use -n = 4 x -N"] if per_node > 4 else []
    launcher = options.launcher or ("ibrun" if machine.which("ibrun") else "srun")
    inner: list[str] = []  # a launcher that runs inside the image
    if launcher == "ibrun":
        words = ["ibrun"]
    elif launcher == "srun":
        words = ["srun", "--mpi=pmix", "--kill-on-bad-exit=1"]
    elif launcher == "image-mpirun":
        # The image's own Open MPI starts the ranks: no host MPI involved, so no MPI mismatch, but one node only.
        if not settings.image:
            raise LaunchError("--launcher image-mpirun needs --image")
        if nodes != 1:
            raise LaunchError(f"--launcher image-mpirun works on one node only (this job has {nodes}); see "
                              "docs/cluster.md for more")
        words = []
        inner = ["mpirun", "-np", str(tasks), "-bind-to", "none", "-map-by", "slot", "-x", "OMP_NUM_THREADS",
                 "-x", "PYTHONUNBUFFERED"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    else:
        raise LaunchError(f"--launcher must be {one_of(FRONTERA_LAUNCHERS)}, got '{launcher}'")
    if words and options.dry_run != "1" and not machine.which(words[0]):
        raise LaunchError(f"{launcher} not found on PATH")
    rank = rank_command(settings, machine.root, env, machine.which, inner_launcher=inner)
    # ibrun is Frontera's MPICH-family launcher (Intel MPI, MVAPICH2); srun's PMIx starts Open MPI.
    if launcher == "ibrun":
        check_image_mpi(settings.image, "mpich", "ibrun")
    elif launcher == "srun":
        check_image_mpi(settings.image, "openmpi", "srun --mpi=pmix")
    words += rank.words + batch_entry_args(options, env) + entry_args
    note = (f"job {env.get('SLURM_JOB_ID') or '(dry run)'} on {env.get('SLURM_JOB_NODELIST') or '?'}: {tasks} tasks "
            f"on {nodes} node(s), {threads} threads each, launcher {launcher}")
    launch = batch_launch(words, options, {"OMP_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1", **rank.exports}, note)
    launch.notes[:0] = notes
    return launch


def modules_to_load(script: str, options: argparse.Namespace, env: Mapping[str, str]) -> str:
    """The first step of every launch: the checks that need nothing loaded, and the modules to load."""
    if script == "slurm":
        check_batch_job(options, env, "submit with 'sbatch launch/slurm.sbatch ...'")
        check_srun_mpi(options.mpi, env.get("SLURM_NTASKS", ""))
    elif script == "frontera-rtx":
        check_batch_job(options, env, "submit with 'sbatch -A PROJECT launch/frontera-rtx.sbatch ...' or run it "
                                      "inside idev")
        return frontera_modules(options)
    return ""


def plan(script: str, options: argparse.Namespace, entry_args: list[str], machine: Machine) -> Launch:
    """The command one launch script runs, every value checked; raises LaunchError."""
    if script == "mpirun":
        settings = rank_settings(options)
        return mpirun_command(decide_mpirun(options, entry_args, machine), settings, machine)
    if script == "slurm":
        return slurm_command(options, entry_args, machine)
    return frontera_command(options, entry_args, machine)


def launch_shell(launch: Launch) -> str:
    """The shell launch/common.sh evals: the exports, then the words and how to run them."""
    lines = [f"export {name}={shlex.quote(value)}" for name, value in launch.exports.items()]
    return "\n".join(lines) + "\n" + shell_assignments({
        "LAUNCH_WORDS": launch.words, "LAUNCH_HOW": launch.how, "LAUNCH_REQUEUE": launch.requeue})
