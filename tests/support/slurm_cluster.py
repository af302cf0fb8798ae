"""A real, single-node Slurm for the tests: munged, slurmctld and slurmd on localhost.

Everything lives in one temporary folder (configuration, munge key and socket, state, logs),
the daemons run in the foreground as children of the test process, and :meth:`SlurmCluster.stop`
cancels the jobs, ends the job-step processes it started, stops the daemons and removes the
folder (HPCDL_KEEP_SLURM_DIR=1 keeps it for a look at the logs), so nothing is left behind. The node claims 32 CPUs and 4 GPUs: the GPUs are character devices made with mknod,
which is all Slurm needs to hand out ``--gres=gpu:N`` and set CUDA_VISIBLE_DEVICES.

Requirements (Debian): ``bash scripts/install-slurm.sh`` (slurm-wlm and munge) and root.
:func:`missing_requirements` says what is missing, for a clear pytest skip.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from hpcdl.tools.vcluster import VCluster

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")
NODE_CPUS = 32  # enough for launch/slurm.sbatch as written: 4 tasks x 8 CPUs
NODE_GPUS = 4
VNODE_CPUS = 8  # a virtual node claims 8 CPUs (config_overrides): 2 tasks x 4 CPUs per node
PARTITIONS = ("debug", "rtx")  # rtx: the queue name the Frontera batch script asks for
FINISHED_STATES = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED",
}


def missing_requirements() -> str | None:
    """Why a local Slurm cannot be started here, or None when it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the Slurm tests need root (slurmd runs jobs as their user and needs mknod)"
    absent = [tool for tool in DAEMONS + CLIENTS if shutil.which(tool) is None]
    if absent:
        return f"Slurm/munge not installed (missing {', '.join(absent)}): run 'bash scripts/install-slurm.sh' as root"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class SlurmError(RuntimeError):
    """The local Slurm did not come up or a command failed; the message carries the logs."""


class SlurmCluster:
    """A one-node Slurm cluster in a temporary folder. Use as a context manager."""

    def __init__(self, root: Path | None = None, vcluster: VCluster | None = None) -> None:
        # With a virtual cluster: slurmctld here (on its bridge address), one slurmd per node,
        # started inside the node (nsenter: `ip netns exec` would hide /sys/fs/cgroup from slurmd).
        self.vcluster = vcluster
        self.owns_root = root is None  # a folder we made is removed again by stop()
        self.root = Path(root or tempfile.mkdtemp(prefix="hpcdl-slurm-"))
        # munged runs as the munge user and must be able to reach its files.
        self.root.chmod(0o755)
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.munge_dir = self.root / "munge"
        self.munge_socket = self.munge_dir / "munge.socket"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        # Settings inherited from an outer Slurm or MPI job would confuse ours.
        for key in list(self.env):
            if key.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and key != "SLURM_CONF":
                self.env.pop(key)

    # ------------------------------------------------------------ life cycle
    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 60) -> None:
        """Write the configuration, start the three daemons and wait for the node to be idle."""
        try:
            self._start_munge()
            self._write_config()
            self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-f", str(self.conf)])
            if self.vcluster is None:
                self._spawn("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", self.host])
            else:
                for node in self.vcluster.nodes:
                    conf = self._node_config(node.hostname)
                    self._spawn(f"slurmd-{node.hostname}",
                                self.vcluster.wrap(node, ["slurmd", "-D", "-f", str(conf), "-N", node.hostname]))
            self._wait_for_idle(timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Cancel every job, end the job-step processes of this cluster, stop the daemons."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.run(["scancel", "--full", f"--partition={','.join(PARTITIONS)}", "--user=root"], check=False)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and self.run(["squeue", "-h"], check=False).stdout.strip():
                time.sleep(0.5)
        slurmds = [name for name in self.procs if name.startswith("slurmd")]
        for name in (*slurmds, "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is not None:
                _terminate(proc)
        for pid in self._step_daemons():
            _kill_quietly(pid, signal.SIGKILL)
        if self.owns_root and os.environ.get("HPCDL_KEEP_SLURM_DIR") != "1":
            shutil.rmtree(self.root, ignore_errors=True)

    # ------------------------------------------------------------ commands
    def run(
        self, args: Sequence[str], timeout: float = 60, check: bool = True, env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command against this cluster (SLURM_CONF set), never past timeout."""
        full_env = dict(self.env, **(env or {}))
        try:
            result = subprocess.run(
                list(args), env=full_env, cwd=cwd, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired as err:
            raise SlurmError(f"{' '.join(args)} timed out after {timeout} s\n{self.logs()}") from err
        if check and result.returncode != 0:
            raise SlurmError(
                f"{' '.join(args)} exited {result.returncode}\nstdout: {result.stdout}\nstderr: {result.stderr}"
            )
        return result

    def sbatch(
        self, script: str | os.PathLike[str] | None, script_args: Sequence[str] = (), sbatch_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
    ) -> int:
        """Submit a batch script (None with --wrap in sbatch_args) and return its job id."""
        words = [] if script is None else [str(script), *script_args]
        result = self.run(["sbatch", "--parsable", *sbatch_args, *words], env=env, cwd=cwd)
        return int(result.stdout.strip().split(";")[0])

    def job_state(self, job_id: int) -> str:
        """The job's state as Slurm names it (PENDING, RUNNING, COMPLETED, FAILED, ...)."""
        out = self.run(["scontrol", "-o", "show", "job", str(job_id)], check=False).stdout
        found = re.search(r"\bJobState=(\S+)", out)
        return found.group(1) if found else "UNKNOWN"

    def wait_for_job(self, job_id: int, timeout: float) -> str:
        """Wait until the job has finished; return its final state (or raise on timeout)."""
        deadline = time.monotonic() + timeout
        state = "UNKNOWN"
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in FINISHED_STATES:
                return state
            time.sleep(1)
        self.run(["scancel", str(job_id)], check=False)
        raise SlurmError(f"job {job_id} still {state} after {timeout} s; cancelled\n{self.logs()}")

    def logs(self, lines: int = 25) -> str:
        """The last lines of every daemon log, for failure messages."""
        parts = []
        for log in sorted(self.root.glob("*.log")) + sorted(self.munge_dir.glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    # ------------------------------------------------------------ internals
    def _spawn(self, name: str, args: list[str], user: str | None = None) -> None:
        if user is not None:
            # setpriv execs the daemon itself (runuser would stay in between as its parent).
            args = ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", *args]
        log = open(self.root / f"{name}.out.log", "wb")  # noqa: SIM115 (kept open for the daemon's life)
        self.procs[name] = subprocess.Popen(
            args, env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        log.close()
        time.sleep(0.3)
        if self.procs[name].poll() is not None:
            raise SlurmError(f"{name} exited at once ({self.procs[name].returncode})\n{self.logs()}")

    def _start_munge(self) -> None:
        self.munge_dir.mkdir()
        self.munge_dir.chmod(0o755)  # clients need to reach the socket; only munge may write
        key = self.munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        try:
            munge = pwd.getpwnam("munge")
        except KeyError:
            munge = None
        if munge is not None:
            for path in (self.munge_dir, key):
                os.chown(path, munge.pw_uid, munge.pw_gid)
        args = [
            "munged", "--foreground", f"--socket={self.munge_socket}", f"--key-file={key}",
            f"--pid-file={self.munge_dir / 'munged.pid'}", f"--log-file={self.munge_dir / 'munged.log'}",
            f"--seed-file={self.munge_dir / 'munged.seed'}", "--num-threads=2",
        ]
        if munge is None:
            args.append("--force")  # no munge user: run it as root
        self._spawn("munged", args, user="munge" if munge else None)
        deadline = time.monotonic() + 15
        while not self.munge_socket.exists():
            if time.monotonic() > deadline or self.procs["munged"].poll() is not None:
                raise SlurmError(f"munged did not create its socket\n{self.logs()}")
            time.sleep(0.1)

    @property
    def node_names(self) -> list[str]:
        return [n.hostname for n in self.vcluster.nodes] if self.vcluster else [self.host]

    def _node_config(self, name: str) -> Path:
        """A slurmd's own copy of slurm.conf: its pid, log and TmpFS (PMIx needs a TmpFS of its own
        per node: with a shared one the second node fails on 'spmix_appdir_...: File exists').

        SlurmdSpoolDir stays the one %n template of the shared slurm.conf: a step's PMIx server
        sends the other nodes' slurmds its socket path *unexpanded* (<SlurmdSpoolDir>/stepd.slurm.pmix.J.S)
        and each slurmd fills in %n with its own node name. A literal per-node spool path would
        point every node at the sender's own socket, and the inter-node fence would loop back."""
        node_dir = self.root / name
        (node_dir / "tmp").mkdir(parents=True)
        (node_dir / "spool").mkdir()
        text = self.conf.read_text()
        text = re.sub(r"^SlurmdPidFile=.*$", f"SlurmdPidFile={node_dir}/slurmd.pid", text, flags=re.M)
        text = re.sub(r"^SlurmdLogFile=.*$", f"SlurmdLogFile={self.root}/slurmd-{name}.log", text, flags=re.M)
        conf = node_dir / "slurm.conf"
        conf.write_text(text + f"TmpFS={node_dir}/tmp\n")
        (node_dir / "gres.conf").write_text((self.root / "gres.conf").read_text())  # read beside slurm.conf
        return conf

    def _write_config(self) -> None:
        for sub in ("state", "spool", "dev"):
            (self.root / sub).mkdir()
        # Fake GPUs: gres.conf wants character devices; their numbers do not matter to Slurm.
        for index in range(NODE_GPUS):
            os.mknod(self.root / "dev" / f"nvidia{index}", 0o666 | 0o020000, os.makedev(195, index))
        (self.root / "gres.conf").write_text("AutoDetect=off\n" + "".join(
            f"NodeName={node} Name=gpu File={self.root}/dev/nvidia[0-{NODE_GPUS - 1}]\n" for node in self.node_names))
        r = self.root
        partitions = "\n".join(
            f"PartitionName={name} Nodes={','.join(self.node_names)} MaxTime=INFINITE State=UP"
            f"{' Default=YES' if name == 'debug' else ''}"
            for name in PARTITIONS
        )
        if self.vcluster is None:
            ctld_address = "127.0.0.1"
            addresses = {self.host: "127.0.0.1"}
            cpus = NODE_CPUS
        else:
            ctld_address = self.vcluster.bridge_address
            addresses = {n.hostname: n.address for n in self.vcluster.nodes}
            cpus = VNODE_CPUS
        node_lines = "\n".join(
            f"NodeName={name} NodeAddr={address} CPUs={cpus} Sockets=1 CoresPerSocket={cpus} ThreadsPerCore=1 "
            f"RealMemory=4000 Gres=gpu:{NODE_GPUS} State=UNKNOWN" for name, address in addresses.items())
        self.conf.write_text(
            f"""\
ClusterName=hpcdltest
SlurmctldHost={self.host}({ctld_address})
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket},cred_expire=10
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/{"%n/" if self.vcluster else ""}spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
KillWait=5
# A requeued job may start again cred_expire (10 s) after it ended, but only the main scheduling pass
# starts it, every 60 s by default: 2 s here, so a requeue test waits for the requeue, not the pass.
SchedulerParameters=sched_interval=2
InactiveLimit=0
GresTypes=gpu
{"DebugFlags=NO_CONF_HASH" if self.vcluster else ""}
{node_lines}
{partitions}
"""
        )

    def _wait_for_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise SlurmError(f"{name} exited ({proc.returncode}) while starting\n{self.logs()}")
            result = self.run(["sinfo", "-h", "-N", "-o", "%T"], check=False, timeout=10)
            state = result.stdout.strip()
            states = state.split()
            if result.returncode == 0 and len(states) >= len(self.node_names) and all(
                    s.startswith("idle") for s in states):
                return
            time.sleep(0.5)
        raise SlurmError(f"the node did not become idle in {timeout} s (state: {state!r})\n{self.logs()}")

    def _step_daemons(self) -> list[int]:
        """Process ids of slurmstepd processes that belong to this cluster (same SLURM_CONF)."""
        mine = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for proc_dir in Path("/proc").glob("[0-9]*"):
            try:
                if not (proc_dir / "cmdline").read_bytes().startswith(b"slurmstepd"):
                    continue
                if mine in (proc_dir / "environ").read_bytes().split(b"\0"):
                    pids.append(int(proc_dir.name))
            except OSError:
                continue
        return pids


def _terminate(proc: subprocess.Popen[bytes], grace: float = 10) -> None:
    """SIGTERM the daemon's session, then SIGKILL it if it is still there after `grace` seconds."""
    if proc.poll() is None:
        _kill_quietly(-proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            _kill_quietly(-proc.pid, signal.SIGKILL)
            proc.wait(timeout=grace)


def _kill_quietly(pid: int, sig: int) -> None:
    try:
        if pid < 0:
            os.killpg(-pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


PYTHON = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "python"


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    """A running single-node Slurm for one test module; skips (or fails under HPCDL_REQUIRE_SLURM=1)
    with the reason where the packages or root are missing."""
    reason = missing_requirements()
    if reason:
        if os.environ.get("HPCDL_REQUIRE_SLURM") == "1":
            pytest.fail(f"HPCDL_REQUIRE_SLURM=1 but {reason}")
        pytest.skip(reason)
    if not PYTHON.exists():
        pytest.skip(f"{PYTHON} missing: run bash scripts/setup.sh")
    with SlurmCluster() as cluster:
        yield cluster
