"""The launch scripts: clean shell, helpful --help, every setting overridable, bad input refused.

Most tests use --dry-run, which prints the exact command a script would run. Stand-ins for tools
this machine lacks (apptainer, singularity, ibrun, module, nvidia-smi) are small shell scripts on
PATH; the apptainer stand-in really runs the command it is given, so the container launch line is
also exercised end to end under mpirun. The acceptance run, `launch/mpirun.sh -np 2`, trains on
digits for real.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpcdl.launching import args as launch_args

pytestmark = pytest.mark.processes  # starts processes: not in the fast tier


REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch"
MPIRUN_SH = LAUNCH / "mpirun.sh"
SLURM_SBATCH = LAUNCH / "slurm.sbatch"
FRONTERA_SBATCH = LAUNCH / "frontera-rtx.sbatch"
SCRIPTS = [MPIRUN_SH, SLURM_SBATCH, FRONTERA_SBATCH]
SHELL_FILES = SCRIPTS + [LAUNCH / "common.sh", LAUNCH / "vcluster-rsh", REPO / "scripts" / "install-slurm.sh",
                         REPO / "scripts" / "test.sh", REPO / "scripts" / "fresh_caches.sh"]
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0

FAKE_CONTAINER = r"""#!/bin/sh
# Stand-in for apptainer/singularity: drops "exec [--nv] [--bind LIST] IMAGE" and runs the rest.
echo "$(basename "$0") $*" >>"${FAKE_LOG:-/dev/null}"
[ "$1" = exec ] || { echo "fake runtime: only 'exec' is supported" >&2; exit 64; }
shift
while [ "$#" -gt 0 ]; do
  case "$1" in
    --nv) shift ;;
    --bind) shift 2 ;;
    *) break ;;
  esac
done
[ -e "$1" ] || { echo "fake runtime: no image $1" >&2; exit 65; }
shift
exec "$@"
"""


@pytest.fixture()
def fakes(tmp_path: Path) -> Path:
    """A folder of stand-in tools; put it first on PATH with env(fakes=...)."""
    folder = tmp_path / "fakebin"
    folder.mkdir()
    tools = {
        "apptainer": FAKE_CONTAINER,
        "singularity": FAKE_CONTAINER,
        "ibrun": '#!/bin/sh\necho "ibrun $*" >>"${FAKE_LOG:-/dev/null}"\n',
        "module": '#!/bin/sh\necho "module $*" >>"${FAKE_LOG:-/dev/null}"\n',
        "fake-mpirun": "#!/bin/sh\necho 'mpirun (Open MPI) 4.1.4'\n",
    }
    for name, text in tools.items():
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    # What the image's %environment does: its python first on PATH (a wrapper, not a symlink,
    # so that the virtual environment is still found).
    (folder / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (folder / "python").chmod(0o755)
    (tmp_path / "image.sif").write_text("not a real image\n")
    return folder


def add_fake_gpus(fakes: Path) -> None:
    """An nvidia-smi that lists four GPUs (the scripts count GPUs with it)."""
    tool = fakes / "nvidia-smi"
    tool.write_text('#!/bin/sh\nfor i in 0 1 2 3; do echo "GPU $i: Fake GPU (UUID: GPU-$i)"; done\n')
    tool.chmod(0o755)


def clean_env(extra: dict[str, str] | None = None, fakes: Path | None = None) -> dict[str, str]:
    """The environment without launch settings or job variables, so defaults are what is tested."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("HPCDL_", "SLURM_", "SBATCH_", "OMPI_", "PMIX_", "OMP_NUM_THREADS"))
    }
    if fakes is not None:
        env["PATH"] = f"{fakes}:{env.get('PATH', '/usr/bin:/bin')}"
    env.update(extra or {})
    return env


def run(script: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(script), *args], env=env if env is not None else clean_env(), capture_output=True, text=True,
        timeout=timeout, cwd=REPO,
    )


def command_of(result: subprocess.CompletedProcess[str]) -> str:
    """The command a --dry-run printed (the last '[hpcdl] ' line of stderr), unquoted, words joined by spaces."""
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("[hpcdl] ")]
    assert lines, result.stderr
    return " ".join(shlex.split(lines[-1][len("[hpcdl] "):]))


def shellcheck() -> str:
    beside = Path(sys.executable).with_name("shellcheck")
    found = str(beside) if beside.exists() else shutil.which("shellcheck")
    assert found, "shellcheck missing: it comes with the test extra (pip install -e .[test])"
    return found


# ------------------------------------------------------------------ static checks


def test_shellcheck_clean() -> None:
    result = subprocess.run([shellcheck(), "-x", *map(str, SHELL_FILES)], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda p: p.name)
def test_bash_syntax(path: Path) -> None:
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("path", SCRIPTS + [REPO / "scripts" / "install-slurm.sh"], ids=lambda p: p.name)
def test_strict_mode_and_executable(path: Path) -> None:
    text = path.read_text()
    assert re.search(r"(?m)^set -euo pipefail$", text), f"{path.name} must 'set -euo pipefail'"
    assert text.startswith("#!/usr/bin/env bash\n")
    assert os.access(path, os.X_OK), f"{path.name} is not executable"


class Recorder(dict[str, str]):
    """An empty environment that remembers which variables were asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: set[str] = set()

    def get(self, key: str, default: str | None = None) -> str | None:  # type: ignore[override]
        self.asked.add(key)
        return default


# Read outside the parsers: by every script (rank_command), or by mpirun.sh's decisions alone.
ENVIRONMENT_ONLY = {"HPCDL_JOIN_CT", "HPCDL_ROOT"}
MPIRUN_ENVIRONMENT_ONLY = {"HPCDL_OOB_KEEPALIVE", "HPCDL_VCLUSTER_STATE", "HPCDL_HOSTS", "HPCDL_HOSTFILE"}
SCRIPT_NAMES = {MPIRUN_SH: "mpirun", SLURM_SBATCH: "slurm", FRONTERA_SBATCH: "frontera-rtx"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help(script: Path) -> None:
    result = run(script, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Usage:")
    # Every setting the script's parser or the decisions read from the environment is documented.
    env = Recorder()
    launch_args.parser_for(SCRIPT_NAMES[script], env)
    settings = {name for name in env.asked if name.startswith("HPCDL_")} | ENVIRONMENT_ONLY
    settings |= MPIRUN_ENVIRONMENT_ONLY if script == MPIRUN_SH else set()
    undocumented = sorted(name for name in settings if name not in result.stdout)
    assert not undocumented, f"--help of {script.name} does not mention {undocumented}"


def test_every_setting_read_is_one_some_help_shows() -> None:
    sources = "".join((REPO / "hpcdl" / "launching" / name).read_text()
                      for name in ("args.py", "plan.py", "rank_command.py"))
    read = set(re.findall(r'env\.get\("(HPCDL_[A-Z_]+)"', sources)) | set(re.findall(r'e\("(HPCDL_[A-Z_]+)"', sources))
    helps = "".join(run(script, "--help").stdout for script in SCRIPTS)
    assert read and not sorted(name for name in read if name not in helps)


def sbatch_directives(script: Path) -> list[str]:
    return re.findall(r"(?m)^#SBATCH\s+(.*?)\s*$", script.read_text())


@pytest.mark.parametrize("script", [SLURM_SBATCH, FRONTERA_SBATCH], ids=lambda p: p.name)
def test_batch_scripts_ask_for_the_time_limit_signal_and_requeue(script: Path) -> None:
    directives = sbatch_directives(script)
    signal = [d for d in directives if d.startswith("--signal=")]
    assert signal and re.fullmatch(r"--signal=B:USR1@\d+", signal[0]), signal
    assert "--requeue" in directives
    assert "--open-mode=append" in directives  # a requeued job appends to the same log


def test_generic_batch_script_runs_one_task_per_gpu() -> None:
    directives = dict(d.split("=", 1) for d in sbatch_directives(SLURM_SBATCH) if "=" in d)
    assert directives["--gres"] == f"gpu:{directives['--ntasks-per-node']}"
    assert int(directives["--cpus-per-task"]) >= 1


def test_frontera_batch_script_fills_rtx_nodes() -> None:
    directives = sbatch_directives(FRONTERA_SBATCH)
    options = {d.split()[0]: d.split()[1] for d in directives if d.startswith("-") and len(d.split()) == 2}
    assert options["-p"] == "rtx"
    assert int(options["-n"]) == 4 * int(options["-N"])


# ------------------------------------------------------------------ mpirun.sh


def test_mpirun_defaults_follow_horovod() -> None:
    cmd = command_of(run(MPIRUN_SH, "--dry-run", "-np", "2", "--epochs", "1"))
    assert "-np 2 -bind-to none -map-by slot" in cmd
    for name in ("OMP_NUM_THREADS", "PYTHONUNBUFFERED", "PATH"):
        assert f"-x {name}" in cmd
    assert cmd.endswith(f"{REPO}/.venv/bin/python -m hpcdl.train --epochs 1") or cmd.endswith(
        "python3 -m hpcdl.train --epochs 1"
    )
    assert ("--allow-run-as-root" in cmd) == IS_ROOT


def test_mpirun_on_hosts_sets_one_interface_everywhere() -> None:
    cmd = command_of(run(MPIRUN_SH, "--dry-run", "-H", "a:2,b:2", "--iface", "ib0"))
    assert "-np 4 " in cmd and "-H a:2,b:2" in cmd  # -np from the slots
    assert "--mca btl_tcp_if_include ib0 --mca oob_tcp_if_include ib0" in cmd
    assert "-x HOROVOD_GLOO_IFACE" in cmd and "-x NCCL_SOCKET_IFNAME" in cmd
    assert "-x GLOO_SOCKET_IFNAME" in cmd and "-x HPCDL_IFACE" in cmd  # torch's Gloo, torch's rendezvous address
    # A subnet suits Open MPI but not Gloo/NCCL, which want a name; torch's rendezvous takes an address in it.
    cmd = command_of(run(MPIRUN_SH, "--dry-run", "-H", "a:1,b:1", "--iface", "10.1.2.0/24"))
    assert "--mca btl_tcp_if_include 10.1.2.0/24 --mca oob_tcp_if_include 10.1.2.0/24" in cmd
    assert "HOROVOD_GLOO_IFACE" not in cmd and "NCCL_SOCKET_IFNAME" not in cmd and "GLOO_SOCKET_IFNAME" not in cmd
    assert "-x HPCDL_IFACE" in cmd


def test_mpirun_sets_short_daemon_keepalives_unless_told_not_to() -> None:
    cmd = command_of(run(MPIRUN_SH, "--dry-run", "-np", "2"))
    assert ("--mca oob_tcp_keepalive_time 10 --mca oob_tcp_keepalive_intvl 5 --mca oob_tcp_keepalive_probes 3"
            in cmd)
    cmd = command_of(run(MPIRUN_SH, "--dry-run", "-np", "2", env=clean_env({"HPCDL_OOB_KEEPALIVE": ""})))
    assert "keepalive" not in cmd


@pytest.mark.parametrize(("args", "message"), [
    (["-H", "a:2", "--hostfile", "/etc/hostname"], "give -H or --hostfile, not both"),
    (["-H", "a:x"], "-H wants HOST:SLOTS"),
    (["--abort-grace", "soon"], "--abort-grace must be a whole number"),
    (["--vcluster", "nosuch"], "no virtual cluster named 'nosuch'"),
    (["-H", "a:2,,b:2"], "-H wants HOST:SLOTS"),
    (["-H", "a:2,b:2", "-np", "5"], "-np 5 is more ranks than the 4 slots of -H a:2,b:2"),
    (["--epochs", "1", "-np", "0"], "-np must be a positive whole number, got '0'"),
    (["--runtime", "docker"], "--runtime must be apptainer, singularity or charliecloud, got 'docker'"),
], ids=["both-host-lists", "bad-slots", "bad-grace", "no-vcluster", "empty-host", "np-over-slots",
        "after-a-training-flag", "unknown-runtime"])
def test_mpirun_multi_node_flags_refuse_bad_input(args: list[str], message: str) -> None:
    result = run(MPIRUN_SH, "--dry-run", *args, env=clean_env({"HPCDL_VCLUSTER_STATE": "/nonexistent"}))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [f"error: {result.stderr.strip()[7:]}"]
    assert message in result.stderr


def test_mpirun_arguments_pass_through_to_train() -> None:
    cmd = command_of(run(MPIRUN_SH, "--dry-run", "-np", "2", "--", "--epochs", "3", "--np", "x"))
    assert cmd.endswith("-m hpcdl.train --epochs 3 --np x")  # after --, even launcher-like words go to train
    cmd = command_of(run(MPIRUN_SH, "--dry-run", "--epochs", "2", "--batch-size", "16"))
    assert cmd.endswith("-m hpcdl.train --epochs 2 --batch-size 16")


def test_mpirun_launcher_flags_after_a_training_flag_are_the_launchers() -> None:
    result = run(MPIRUN_SH, "--epochs", "1", "-np", "3", "--oversubscribe", "--batch-size", "16", "--threads", "1",
                 env=clean_env({"HPCDL_DRY_RUN": "1"}))
    cmd = command_of(result)
    assert "-np 3 " in cmd and " --oversubscribe " in cmd and "3 ranks, 3 per host, 1 threads each" in result.stderr
    assert cmd.endswith("-m hpcdl.train --epochs 1 --batch-size 16")


@pytest.mark.parametrize(("hosts", "np", "given", "per_host"), [
    ("a:2,b,a", 4, "a:3,b:1", 3),  # a repeated host adds its slots, as in Open MPI's -H aa,aa,bb
    ("a:2, b:2", 4, "a:2,b:2", 2),
    ("a,b,c", 3, "a:1,b:1,c:1", 1),
])
def test_mpirun_counts_host_lists_like_open_mpi(hosts: str, np: int, given: str, per_host: int) -> None:
    result = run(MPIRUN_SH, "--dry-run", "-H", hosts)
    cmd = command_of(result)
    assert f"-np {np} " in cmd and f" -H {given} " in cmd, cmd
    assert f"{np} ranks, {per_host} per host" in result.stderr


def test_mpirun_vcluster_keeps_the_given_slots(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "demo.json").write_text(json.dumps({"name": "demo", "subnet": "10.200.7.0/24", "nodes": [
        {"hostname": f"node{i}", "address": f"10.200.7.{i}"} for i in (1, 2)]}))
    env = clean_env({"HPCDL_VCLUSTER_STATE": str(state)})
    cmd = command_of(run(MPIRUN_SH, "--dry-run", "--vcluster", "demo", "-H", "node1:3,node2:1", env=env))
    assert "-np 4 " in cmd and " -H 10.200.7.1:3,10.200.7.2:1 " in cmd, cmd
    assert f"--mca plm_rsh_agent {LAUNCH}/vcluster-rsh" in cmd and "--mca btl_tcp_if_include 10.200.7.0/24" in cmd
    assert "-x HPCDL_VCLUSTER " in cmd and "-x HPCDL_VCLUSTER_STATE " in cmd  # the agent looks in this cluster only
    cmd = command_of(run(MPIRUN_SH, "--dry-run", "--vcluster", "demo", "-np", "3", env=env))
    assert "-np 3 " in cmd and " -H 10.200.7.1:2,10.200.7.2:2 " in cmd, cmd
    result = run(MPIRUN_SH, "--dry-run", "--vcluster", "demo", "-H", "node3:1", env=env)
    assert result.returncode == 2 and result.stderr.startswith("error: virtual cluster demo has no node 'node3'")


def test_mpirun_ranks_use_pmix_hash_store(fakes: Path) -> None:
    """PMIx's shared-memory store takes a lock two jobs starting at once can fail in; the hash store takes none."""
    cmd = command_of(run(MPIRUN_SH, "--dry-run", "-np", "2"))
    assert " -x PMIX_MCA_gds " in cmd  # to the ranks on other hosts too
    show = fakes / "show-gds"
    show.write_text('#!/bin/sh\necho "gds=$PMIX_MCA_gds"\n')  # stands in for python: started by the real mpirun
    show.chmod(0o755)
    result = run(MPIRUN_SH, "-np", "2", "--python", str(show), env=clean_env({"HPCDL_ABORT_GRACE": "0"}), timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["gds=hash", "gds=hash"], result.stdout
    result = run(MPIRUN_SH, "-np", "1", "--python", str(show), env=clean_env({"PMIX_MCA_gds": "ds21,hash"}),
                 timeout=120)
    assert result.stdout.split() == ["gds=ds21,hash"], result.stdout + result.stderr  # a user's choice stays


@pytest.mark.timeout(280)
def test_mpi_jobs_started_at_the_same_moment_all_run() -> None:
    """Jobs on a shared node start together all the time; each must run, and no PMIx error may show."""
    env = clean_env({"HPCDL_OVERSUBSCRIBE": "1", "OMP_NUM_THREADS": "1"})
    jobs = [subprocess.Popen(["bash", str(MPIRUN_SH), "-np", "2", "--entry", "mpi4py.bench", "--", "helloworld"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
            for _ in range(4)]
    try:
        outputs = [job.communicate(timeout=240)[0] for job in jobs]
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
                job.wait(timeout=30)
    for job, output in zip(jobs, outputs, strict=True):
        assert job.returncode == 0 and "PMIX ERROR" not in output, output[-3000:]
        assert sorted(re.findall(r"I am process (\d+) of 2", output)) == ["0", "1"], output[-3000:]


def nproc() -> int:
    return int(subprocess.run(["nproc"], capture_output=True, text=True, check=True, env=clean_env()).stdout)


def test_mpirun_threads_share_the_cores() -> None:
    cores = nproc()
    assert f"1 ranks, 1 per host, {cores} threads each" in run(MPIRUN_SH, "--dry-run", "-np", "1").stderr
    ranks = cores + 1  # more ranks than cores: one thread each, never zero
    assert f"{ranks} ranks, {ranks} per host, 1 threads each" in run(MPIRUN_SH, "--dry-run", "-np", str(ranks)).stderr


def test_mpirun_oversubscribes_only_when_needed() -> None:
    cores = nproc()
    assert "--oversubscribe" not in command_of(run(MPIRUN_SH, "--dry-run", "-np", "1"))
    assert "--oversubscribe" in command_of(run(MPIRUN_SH, "--dry-run", "-np", str(cores + 1)))


def test_mpirun_default_ranks_is_the_gpu_count(fakes: Path) -> None:
    assert "-np 2 " in command_of(run(MPIRUN_SH, "--dry-run", env=clean_env(fakes=fakes)))
    add_fake_gpus(fakes)
    assert "-np 4 " in command_of(run(MPIRUN_SH, "--dry-run", env=clean_env(fakes=fakes)))


def test_mpirun_hostfile_divides_ranks_between_hosts(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("# two nodes\nnode1 slots=4\nnode2 slots=4\n\n")
    result = run(MPIRUN_SH, "--dry-run", "-np", "8", "--hostfile", str(hosts))
    assert f"--hostfile {hosts}" in command_of(result)
    assert "8 ranks, 4 per host" in result.stderr
    assert "--oversubscribe" not in command_of(result)


def mpirun_settings(tmp: Path, fakes: Path) -> list[tuple[list[str], dict[str, str], str]]:
    """(flag words, environment, what the command must then contain) for every mpirun.sh setting."""
    hosts = tmp / "hosts"
    hosts.write_text("localhost slots=8\n")
    image = str(tmp / "image.sif")
    fake_mpirun = str(fakes / "fake-mpirun")
    binds = f"{tmp},{fakes}"  # folders that exist, as /scratch and /work would on a cluster
    return [
        (["-np", "3"], {"HPCDL_NP": "3"}, "-np 3 "),
        (["--hostfile", str(hosts)], {"HPCDL_HOSTFILE": str(hosts)}, f"--hostfile {hosts}"),
        (["--oversubscribe"], {"HPCDL_OVERSUBSCRIBE": "1"}, "--oversubscribe"),
        (["--mpirun", fake_mpirun], {"HPCDL_MPIRUN": fake_mpirun}, f"{fake_mpirun} -np"),
        (["--mpi-args", "-mca pml ob1"], {"HPCDL_MPI_ARGS": "-mca pml ob1"}, "-mca pml ob1 "),
        (["--export", "MY_SETTING"], {"HPCDL_EXPORT": "MY_SETTING"}, "-x MY_SETTING "),
        (["--python", "/bin/true"], {"HPCDL_PYTHON": "/bin/true"}, " /bin/true -m hpcdl.train"),
        (["--entry", "hpcdl.doctor"], {"HPCDL_ENTRY": "hpcdl.doctor"}, "-m hpcdl.doctor"),
        (["--image", image], {"HPCDL_IMAGE": image}, f"apptainer exec {image} python -m hpcdl.train"),
        (["--image", image, "--runtime", "singularity"], {"HPCDL_IMAGE": image, "HPCDL_RUNTIME": "singularity"},
         f"singularity exec {image} python"),
        (["--image", image, "--bind", binds], {"HPCDL_IMAGE": image, "HPCDL_BIND": binds}, f"exec --bind {binds} {image}"),
    ]


def test_every_mpirun_setting_works_as_flag_and_as_environment(tmp_path: Path, fakes: Path) -> None:
    for flags, environment, expected in mpirun_settings(tmp_path, fakes):
        base = clean_env({"MY_SETTING": "1"}, fakes=fakes)
        by_flag = command_of(run(MPIRUN_SH, "--dry-run", *flags, env=base))
        by_env = command_of(run(MPIRUN_SH, "--dry-run", env=dict(base, **environment)))
        assert expected in by_flag, (flags, by_flag)
        assert expected in by_env, (environment, by_env)
    threads = run(MPIRUN_SH, "--dry-run", "-np", "2", "--threads", "3", env=clean_env())
    assert "3 threads each" in threads.stderr
    threads = run(MPIRUN_SH, "--dry-run", "-np", "2", env=clean_env({"OMP_NUM_THREADS": "3"}))
    assert "3 threads each" in threads.stderr


def test_container_gets_nv_where_there_are_gpus(tmp_path: Path, fakes: Path) -> None:
    image = str(tmp_path / "image.sif")
    env = clean_env(fakes=fakes)
    assert "--nv" not in command_of(run(MPIRUN_SH, "--dry-run", "--image", image, env=env))
    assert "--nv" in command_of(run(MPIRUN_SH, "--dry-run", "--image", image, env=dict(env, HPCDL_NV="1")))
    add_fake_gpus(fakes)
    assert f"exec --nv {image}" in command_of(run(MPIRUN_SH, "--dry-run", "--image", image, env=env))
    assert "--nv" not in command_of(run(MPIRUN_SH, "--dry-run", "--image", image, "--no-nv", env=env))
    assert "--nv" not in command_of(run(MPIRUN_SH, "--dry-run", "--image", image, env=dict(env, HPCDL_NV="0")))


def test_apptainer_is_preferred_to_singularity(tmp_path: Path, fakes: Path) -> None:
    image = str(tmp_path / "image.sif")
    assert "apptainer exec" in command_of(run(MPIRUN_SH, "--dry-run", "--image", image, env=clean_env(fakes=fakes)))
    (fakes / "apptainer").unlink()
    assert "singularity exec" in command_of(run(MPIRUN_SH, "--dry-run", "--image", image, env=clean_env(fakes=fakes)))


@pytest.mark.parametrize(
    "args, message",
    [
        (["-np", "0"], "-np must be a positive whole number, got '0'"),
        (["-np", "two"], "-np must be a positive whole number, got 'two'"),
        (["-np"], "-np needs a value"),
        (["--threads", "0"], "--threads must be a positive whole number"),
        (["--hostfile", "/nonexistent/hosts"], "hostfile not readable: /nonexistent/hosts"),
        (["--image", "/nonexistent/hpcdl.sif"], "container image not found: /nonexistent/hpcdl.sif"),
        (["--mpirun", "/nonexistent/mpirun"], "/nonexistent/mpirun not found"),
        (["--python", "/nonexistent/python"], "python not found: /nonexistent/python"),
    ],
)
def test_mpirun_bad_input_is_one_clear_line(args: list[str], message: str) -> None:
    result = run(MPIRUN_SH, *args)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr


def test_missing_container_runtime_is_a_clear_error(tmp_path: Path, fakes: Path) -> None:
    image = tmp_path / "image.sif"
    image.write_text("")
    result = run(MPIRUN_SH, "--image", str(image), env=clean_env({"HPCDL_RUNTIME": "no-such-runtime"}))
    assert result.returncode == 2
    assert result.stderr == ("error: --runtime must be apptainer, singularity or charliecloud, "
                             "got 'no-such-runtime'\n")
    # A runtime it knows but cannot run here: refused before mpirun starts (tests/launch/test_launch_args.py
    # checks every runtime with a PATH of its own; here, what this machine lacks).
    for runtime, program in (("singularity", "singularity"), ("charliecloud", "ch-run")):
        (fakes / program).unlink(missing_ok=True)
        if shutil.which(program):
            continue
        image = tmp_path if runtime == "charliecloud" else image  # ch-run runs an image directory
        result = run(MPIRUN_SH, "--dry-run", "--image", str(image), "--runtime", runtime, env=clean_env(fakes=fakes))
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith(f"error: no container runtime found ({runtime}"), result.stderr
        assert len(result.stderr.splitlines()) == 1 and program in result.stderr


# ------------------------------------------------------------------ the batch scripts (dry runs)


def job_env(fakes: Path | None = None, **extra: str) -> dict[str, str]:
    """What Slurm would set inside a 2-task job."""
    values = {
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "hpcdl", "SLURM_NTASKS": "2", "SLURM_JOB_NUM_NODES": "1",
        "SLURM_CPUS_PER_TASK": "8", "SLURM_CPUS_ON_NODE": "16", "SLURM_JOB_NODELIST": "c001",
    }
    values.update(extra)
    return clean_env(values, fakes=fakes)


def test_generic_batch_command() -> None:
    cmd = command_of(run(SLURM_SBATCH, "--epochs", "1", env=dict(job_env(), HPCDL_DRY_RUN="1")))
    assert cmd.startswith("srun --mpi=pmix --kill-on-bad-exit=1 --cpus-per-task=8 ")
    # The job's own output folder and --resume come first; the user's flags after them win.
    assert cmd.endswith("-m hpcdl.train --output-dir runs/hpcdl-4242 --resume --epochs 1")


def test_generic_batch_threads_follow_cpus_per_task() -> None:
    result = run(SLURM_SBATCH, "--dry-run", env=job_env())
    assert "8 threads each" in result.stderr


def batch_settings(tmp: Path) -> list[tuple[list[str], dict[str, str], str, bool]]:
    """(flags, environment, text, whether the text must be present) for the batch-script settings."""
    image = str(tmp / "image.sif")
    return [
        (["--output-dir", "out/x"], {"HPCDL_OUTPUT_DIR": "out/x"}, "--output-dir out/x --resume", True),
        (["--no-resume"], {"HPCDL_RESUME": "0"}, "--resume", False),
        (["--no-requeue"], {"HPCDL_REQUEUE": "0"}, "requeue near the limit: off", True),
        (["--threads", "3"], {"OMP_NUM_THREADS": "3"}, "3 threads each", True),
        (["--entry", "hpcdl.doctor"], {"HPCDL_ENTRY": "hpcdl.doctor"}, "-m hpcdl.doctor", True),
        (["--entry", "hpcdl.doctor"], {"HPCDL_ENTRY": "hpcdl.doctor"}, "--resume", False),
        (["--image", image], {"HPCDL_IMAGE": image}, f"apptainer exec {image} python -m hpcdl.train", True),
        (["--python", "/bin/true"], {"HPCDL_PYTHON": "/bin/true"}, "/bin/true -m hpcdl.train", True),
    ]


@pytest.mark.parametrize("script", [SLURM_SBATCH, FRONTERA_SBATCH], ids=lambda p: p.name)
def test_every_batch_setting_works_as_flag_and_as_environment(script: Path, tmp_path: Path, fakes: Path) -> None:
    for flags, environment, text, present in batch_settings(tmp_path):
        by_flag = run(script, "--dry-run", *flags, env=job_env(fakes))
        by_env = run(script, "--dry-run", env=dict(job_env(fakes), **environment))
        for result in (by_flag, by_env):
            assert result.returncode == 0, result.stderr
            assert (text in result.stderr) == present, (flags, environment, result.stderr)


@pytest.mark.parametrize("script", [SLURM_SBATCH, FRONTERA_SBATCH], ids=lambda p: p.name)
def test_requeued_job_resumes_its_own_run_after_no_resume(script: Path, fakes: Path) -> None:
    """--no-resume is about the first start; a requeued start (SLURM_RESTART_COUNT > 0) is the same job and must
    resume its own checkpoints, or hpcdl.train refuses the folder and the job ends FAILED (test_slurm.py runs it)."""
    for restarts, resumes in (("0", False), ("1", True), ("3", True)):
        for flags, extra in ((["--no-resume"], {}), ([], {"HPCDL_RESUME": "0"})):
            env = dict(job_env(fakes, SLURM_RESTART_COUNT=restarts), **extra)
            cmd = command_of(run(script, "--dry-run", *flags, "--epochs", "2", env=env))
            assert ("--output-dir runs/hpcdl-4242 --resume --epochs 2" in cmd) == resumes, (restarts, flags, cmd)
            assert ("--resume" in cmd) == resumes


def test_generic_batch_srun_settings() -> None:
    for flags, environment, expected in (
        (["--mpi", "pmi2"], {"HPCDL_SRUN_MPI": "pmi2"}, "srun --mpi=pmi2 "),
        (["--srun-args", "--cpu-bind=cores"], {"HPCDL_SRUN_ARGS": "--cpu-bind=cores"}, "--cpus-per-task=8 --cpu-bind=cores "),
    ):
        for result in (run(SLURM_SBATCH, "--dry-run", *flags, env=job_env()),
                       run(SLURM_SBATCH, "--dry-run", env=dict(job_env(), **environment))):
            assert expected in command_of(result)


def test_frontera_uses_ibrun_and_modules(fakes: Path) -> None:
    log = fakes.parent / "calls.log"
    env = dict(job_env(fakes, SLURM_NTASKS="4"), FAKE_LOG=str(log))
    result = run(FRONTERA_SBATCH, "--dry-run", "--epochs", "1", env=env)
    cmd = command_of(result)
    assert cmd.startswith("ibrun ") and cmd.endswith("-m hpcdl.train --output-dir runs/hpcdl-4242 --resume --epochs 1")
    assert "4 threads each" in result.stderr  # 16 cores / 4 tasks on the node
    assert log.read_text().splitlines() == ["module load cuda"]


def test_frontera_settings(tmp_path: Path, fakes: Path) -> None:
    image = str(tmp_path / "image.sif")
    log = fakes.parent / "calls.log"
    for flags, environment, expected_cmd, expected_modules in (
        (["--launcher", "srun"], {"HPCDL_LAUNCHER": "srun"}, "srun --mpi=pmix --kill-on-bad-exit=1 ", "module load cuda"),
        (["--modules", "gcc cuda/12.2"], {"HPCDL_MODULES": "gcc cuda/12.2"}, "ibrun ", "module load gcc cuda/12.2"),
        (["--modules", ""], {"HPCDL_MODULES": ""}, "ibrun ", None),
        (["--image", image], {"HPCDL_IMAGE": image}, f"ibrun apptainer exec {image} python", "module load tacc-apptainer"),
        (["--image", image, "--launcher", "image-mpirun"], {"HPCDL_IMAGE": image, "HPCDL_LAUNCHER": "image-mpirun"},
         f"apptainer exec {image} mpirun -np 2 -bind-to none -map-by slot", "module load tacc-apptainer"),
    ):
        for args, extra in ((flags, {}), ([], environment)):
            if log.exists():
                log.unlink()
            env = dict(job_env(fakes), FAKE_LOG=str(log), **extra)
            cmd = command_of(run(FRONTERA_SBATCH, "--dry-run", *args, env=env))
            assert cmd.startswith(expected_cmd), (args, extra, cmd)
            calls = log.read_text().splitlines() if log.exists() else []
            assert calls == ([expected_modules] if expected_modules else []), (args, extra, calls)


@pytest.mark.parametrize(
    "script, args, extra, message",
    [
        (SLURM_SBATCH, [], {}, "not inside a Slurm job: submit with 'sbatch launch/slurm.sbatch ...'"),
        (FRONTERA_SBATCH, [], {}, "not inside a Slurm job"),
        (SLURM_SBATCH, ["--threads", "many"], {"SLURM_JOB_ID": "1"}, "--threads must be a positive whole number"),
        (FRONTERA_SBATCH, ["--launcher", "mpiexec"], {"SLURM_JOB_ID": "1"}, "--launcher must be ibrun, srun or image-mpirun"),
        (FRONTERA_SBATCH, ["--launcher", "image-mpirun"], {"SLURM_JOB_ID": "1"}, "--launcher image-mpirun needs --image"),
        (SLURM_SBATCH, ["--output-dir"], {"SLURM_JOB_ID": "1"}, "--output-dir needs a value"),
    ],
)
def test_batch_bad_input_is_one_clear_line(script: Path, args: list[str], extra: dict[str, str], message: str) -> None:
    result = run(script, *args, env=clean_env(dict(extra, HPCDL_MODULES="")))
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], result.stderr


def test_image_mpirun_refuses_several_nodes(tmp_path: Path, fakes: Path) -> None:
    env = job_env(fakes, SLURM_JOB_NUM_NODES="2", SLURM_NTASKS="8")
    result = run(FRONTERA_SBATCH, "--dry-run", "--image", str(tmp_path / "image.sif"), "--launcher", "image-mpirun", env=env)
    assert result.returncode == 2
    assert "works on one node only (this job has 2)" in result.stderr


# ------------------------------------------------------------------ real runs under mpirun


def test_container_launch_line_really_starts_distinct_ranks(tmp_path: Path, fakes: Path) -> None:
    """mpirun -> (stand-in) apptainer exec IMAGE -> python: every rank must know its own rank.

    The symptom of a broken hybrid launch is every rank saying "process 0 of 1".
    """
    log = tmp_path / "container.log"
    env = clean_env({"FAKE_LOG": str(log), "HPCDL_OVERSUBSCRIBE": "1"}, fakes=fakes)
    result = run(MPIRUN_SH, "-np", "2", "--image", str(tmp_path / "image.sif"), "--entry", "mpi4py.bench", "--",
                 "helloworld", env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    greetings = sorted(re.findall(r"I am process (\d+) of (\d+)", result.stdout))
    assert greetings == [("0", "2"), ("1", "2")], result.stdout
    assert log.read_text().count(f"apptainer exec {tmp_path / 'image.sif'} python -m mpi4py.bench helloworld") == 2


def test_mpirun_sh_trains_on_digits(tmp_path: Path) -> None:
    """The acceptance run: launch/mpirun.sh -np 2 trains one epoch on the embedded digits."""
    out = tmp_path / "run"
    result = run(MPIRUN_SH, "-np", "2", "--epochs", "1", "--output-dir", str(out), "--no-progress", timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["epochs"] == 1
    assert summary["config"]["dataset"] == "digits"
    # Ten classes: chance is 0.1. One epoch of the small CNN gets well past it.
    assert summary["final_accuracy"] > 0.2, summary


# ------------------------------------------------------------------ one parser for every script


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_decide_nothing_themselves(script: Path) -> None:
    """No flag loop or decision in bash: a script finds the repository and hands its words to hpcdl.launch."""
    code = [line.strip() for line in script.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert not [line for line in code if re.match(r"(while|case|if|shift)\b", line)], code
    assert code[-1] == f"hpcdl_launch {SCRIPT_NAMES[script]} \"$@\""


@pytest.mark.parametrize("script", [SLURM_SBATCH, FRONTERA_SBATCH], ids=lambda p: p.name)
def test_batch_launcher_flags_after_a_training_flag_are_the_launchers(script: Path, fakes: Path) -> None:
    result = run(script, "--epochs", "1", "--no-requeue", "--threads", "2", "--output-dir", "out/x", "--batch-size",
                 "16", "--dry-run", env=job_env(fakes))
    cmd = command_of(result)
    assert "2 threads each" in result.stderr and "requeue near the limit: off" in result.stderr
    assert cmd.endswith("-m hpcdl.train --output-dir out/x --resume --epochs 1 --batch-size 16"), cmd


@pytest.mark.parametrize(("script", "args", "extra", "message"), [
    (MPIRUN_SH, ["--threads"], {}, "--threads needs a value"),
    (MPIRUN_SH, ["--image", "/nonexistent.sif"], {}, "container image not found"),
    (SLURM_SBATCH, [], {}, "not inside a Slurm job"),
    (SLURM_SBATCH, ["--dry-run", "--mpi"], {}, "--mpi needs a value"),
    (FRONTERA_SBATCH, ["--launcher", "mpiexec"], {"SLURM_JOB_ID": "1", "HPCDL_MODULES": ""}, "--launcher must be"),
    (FRONTERA_SBATCH, ["--modules", "nosuch"], {"SLURM_JOB_ID": "1"}, "module load nosuch failed"),
], ids=["no-value", "no-image", "outside-a-job", "batch-no-value", "bad-launcher", "module-load-fails"])
def test_every_launch_error_exits_2_in_one_line(script: Path, args: list[str], extra: dict[str, str], message: str,
                                                fakes: Path) -> None:
    (fakes / "module").write_text('#!/bin/sh\nexit 1\n')  # a site whose module system has none of it
    result = run(script, *args, env=clean_env(extra, fakes=fakes))
    errors = [line for line in result.stderr.splitlines() if not line.startswith("[hpcdl] ")]
    assert result.returncode == 2 and len(errors) == 1 and errors[0].startswith("error: ") and message in errors[0], (
        result.returncode, result.stderr)


def test_a_copy_away_from_the_repository_says_where_to_point_it(tmp_path: Path) -> None:
    copy = tmp_path / "slurm.sbatch"
    shutil.copy(SLURM_SBATCH, copy)
    result = subprocess.run(["bash", str(copy), "--dry-run"], env=clean_env(), cwd=tmp_path, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.startswith("error: cannot find the hpcdl repository; set HPCDL_ROOT")
    result = subprocess.run(["bash", str(copy), "--dry-run"], env=clean_env({"HPCDL_ROOT": str(REPO), "SLURM_JOB_ID": "7"}),
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "-m hpcdl.train --output-dir runs/hpcdl-7 --resume" in result.stderr


def test_a_spooled_copy_finds_the_repository_from_the_path_sbatch_was_given(tmp_path: Path, fakes: Path) -> None:
    """Under sbatch the script runs from a copy in Slurm's spool folder, submitted from anywhere: scontrol names
    the file sbatch was given, and the repository is the one it lies in."""
    spool, elsewhere = tmp_path / "spool" / "job00007", tmp_path / "home"
    spool.mkdir(parents=True)
    elsewhere.mkdir()
    shutil.copy(SLURM_SBATCH, spool / "slurm_script")
    (fakes / "scontrol").write_text(f'#!/bin/sh\necho "JobId=7 JobName=hpcdl"\necho "   Command={SLURM_SBATCH} --epochs 1"\n')
    (fakes / "scontrol").chmod(0o755)
    env = clean_env({"SLURM_JOB_ID": "7", "SLURM_SUBMIT_DIR": str(elsewhere)}, fakes=fakes)
    result = subprocess.run(["bash", str(spool / "slurm_script"), "--dry-run", "--epochs", "1"], env=env,
                            cwd=elsewhere, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert command_of(result).endswith(f"{REPO}/.venv/bin/python -m hpcdl.train --output-dir runs/hpcdl-7 --resume "
                                       "--epochs 1") or "python3 -m hpcdl.train" in command_of(result)


@pytest.mark.parametrize(("script", "args", "extra", "message"), [
    (MPIRUN_SH, ["--dryrun", "-np", "2"], {},
     "'--dryrun' is not an option of launch/mpirun.sh: did you mean --dry-run?"),
    (MPIRUN_SH, ["-np2"], {}, "-np2: write the count as a word of its own, -np 2"),
    (MPIRUN_SH, ["--thread", "2"], {}, "did you mean --threads?"),
    (SLURM_SBATCH, ["--mpi", "none"], {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2"}, "--mpi none: srun would start the 2"),
    (SLURM_SBATCH, ["--dry", "--mpi", "pmix"], {"SLURM_JOB_ID": "7"}, "did you mean --dry-run?"),
], ids=["dryrun", "np2", "thread", "mpi-none", "batch-abbreviation"])
def test_a_mistyped_launcher_option_starts_nothing(script: Path, args: list[str], extra: dict[str, str], message: str,
                                                   fakes: Path, tmp_path: Path) -> None:
    """Handed on to hpcdl.train, these started the job (issue 46): now one line, exit 2, and no launcher runs."""
    started = tmp_path / "started"
    for launcher in ("mpirun", "srun"):
        (fakes / launcher).write_text(f'#!/bin/sh\necho "mpirun (Open MPI) 4.1.4"; echo "$0 $*" >>{started}\n')
        (fakes / launcher).chmod(0o755)
    result = run(script, *args, env=clean_env(extra, fakes=fakes))
    errors = [line for line in result.stderr.splitlines() if not line.startswith("[hpcdl] ")]
    assert result.returncode == 2 and len(errors) == 1 and message in errors[0], (result.returncode, result.stderr)
    assert not started.exists() or "--version" in started.read_text() and " -np " not in started.read_text()
