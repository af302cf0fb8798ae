"""The launch commands README.md and docs/cluster.md show (and the scripts' --help examples) print, with
--dry-run, the lines recorded in documented_commands.json: what they printed on the tree before the
launchers moved onto one parser (issue 36), so that the move changed no launch.

Each command runs on a made-up machine so the lines are the same everywhere: one core (taskset), no GPU,
stand-ins for mpirun (Open MPI's, or MPICH's mpiexec.hydra), srun, ibrun, module, scontrol, apptainer and
ch-run first on PATH, the Slurm job's variables as sbatch would set them. The command line is compared as
words (shell quoting may differ); paths of this machine are written <repo>, <work> and <fakes>.

Regenerate (only when a launch is meant to change): .venv/bin/python -m tests.launch.test_documented_commands
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
from typing import Any

import pytest

pytestmark = pytest.mark.processes

REPO = Path(__file__).resolve().parents[2]
RECORDED = Path(__file__).with_name("documented_commands.json")

# A Slurm job as `sbatch [-N N] [-n N | --ntasks-per-node N] ...` sets it up.
JOB = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "hpcdl", "SLURM_JOB_NODELIST": "c001", "SLURM_SUBMIT_DIR": "<work>"}
SLURM_GENERIC = {**JOB, "SLURM_NTASKS": "4", "SLURM_JOB_NUM_NODES": "1", "SLURM_CPUS_PER_TASK": "8",
                 "SLURM_CPUS_ON_NODE": "32"}
FRONTERA = {**JOB, "SLURM_NTASKS": "4", "SLURM_JOB_NUM_NODES": "1", "SLURM_CPUS_ON_NODE": "16"}

# (where it is shown, script, its arguments, the job's variables). <work> is the working folder, which
# holds hosts.txt, hpcdl.sif, images/hpcdl-cpu (Open MPI inside) and images/hpcdl-mpich.
IMG = "images/hpcdl-cpu"
COMMANDS: list[tuple[str, str, list[str], dict[str, str]]] = [
    ("README, docs/cluster.md", "mpirun.sh", ["-np", "2"], {}),
    ("docs/cluster.md, --help", "mpirun.sh", ["-np", "4", "--epochs", "5", "--output-dir", "runs/try1"], {}),
    ("docs/cluster.md, --help", "mpirun.sh", ["-np", "2", "--entry", "hpcdl.doctor"], {}),
    ("README", "mpirun.sh", ["-np", "8", "-H", "node1:4,node2:4", "--iface", "ib0", "--", "--epochs", "90"], {}),
    ("docs/cluster.md", "mpirun.sh", ["-H", "node1:4,node2:4", "--iface", "ib0"], {}),
    ("docs/cluster.md", "mpirun.sh", ["-np", "8", "--hostfile", "hosts.txt", "--iface", "10.1.2.0/24"], {}),
    ("docs/cluster.md", "mpirun.sh", ["-np", "8", "--hostfile", "hosts.txt"], {}),
    ("docs/cluster.md (salloc -N 2 --ntasks-per-node 4)", "mpirun.sh", [],
     {**JOB, "SLURM_NTASKS": "8", "SLURM_JOB_NUM_NODES": "2"}),
    ("docs/cluster.md", "mpirun.sh", ["-H", "node1:4,node2:4", "--entry", "hpcdl.doctor"], {}),
    ("docs/cluster.md", "mpirun.sh", ["--vcluster", "demo", "-np", "4", "--epochs", "3", "--stall-timeout", "20",
                                      "--output-dir", "runs/vc"], {}),
    ("README, docs/cluster.md", "mpirun.sh", ["-np", "4", "--image", IMG, "--entry", "hpcdl.doctor"], {}),
    ("README, docs/cluster.md", "mpirun.sh", ["-np", "2", "--image", IMG, "--", "--epochs", "2"], {}),
    ("docs/cluster.md", "mpirun.sh", ["-np", "2", "--mpirun", "mpiexec.hydra", "--image", "images/hpcdl-mpich",
                                      "--entry", "hpcdl.doctor"], {}),
    ("--help", "mpirun.sh", ["-np", "8", "--hostfile", "hosts.txt", "--image", "hpcdl.sif", "--", "--dataset",
                             "cifar10"], {}),
    ("README, docs/cluster.md", "slurm.sbatch", ["--epochs", "90"], SLURM_GENERIC),
    ("README", "slurm.sbatch", ["--image", IMG, "--", "--epochs", "4"], SLURM_GENERIC),
    ("docs/cluster.md", "slurm.sbatch", ["--image", IMG, "--", "--epochs", "30"], SLURM_GENERIC),
    ("--help (sbatch -N 2 --ntasks-per-node=4)", "slurm.sbatch", ["--image", "hpcdl.sif", "--", "--dataset",
                                                                  "cifar10"],
     {**SLURM_GENERIC, "SLURM_NTASKS": "8", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "c[001-002]"}),
    ("--help (sbatch -n 2)", "slurm.sbatch", ["--entry", "hpcdl.doctor"], {**SLURM_GENERIC, "SLURM_NTASKS": "2"}),
    ("docs/cluster.md (sbatch -N 2 --ntasks-per-node=8 --gres=gpu:8)", "slurm.sbatch", ["--epochs", "90"],
     {**SLURM_GENERIC, "SLURM_NTASKS": "16", "SLURM_JOB_NUM_NODES": "2"}),
    ("README, docs/cluster.md", "frontera-rtx.sbatch", ["--epochs", "90"], FRONTERA),
    ("docs/cluster.md, --help", "frontera-rtx.sbatch", ["--entry", "hpcdl.doctor"], FRONTERA),
    ("docs/cluster.md", "frontera-rtx.sbatch", ["--epochs", "90", "--dataset", "cifar10", "--data-dir",
                                                "/scratch/cifar10"], FRONTERA),
    ("docs/cluster.md (-N 4 -n 16)", "frontera-rtx.sbatch", ["--dataset", "cifar10"],
     {**FRONTERA, "SLURM_NTASKS": "16", "SLURM_JOB_NUM_NODES": "4"}),
    ("docs/cluster.md", "frontera-rtx.sbatch", ["--image", "hpcdl.sif", "--launcher", "image-mpirun", "--",
                                                "--epochs", "5"], FRONTERA),
    ("--help (-N 2 -n 8)", "frontera-rtx.sbatch", ["--image", "hpcdl.sif", "--", "--dataset", "cifar10"],
     {**FRONTERA, "SLURM_NTASKS": "8", "SLURM_JOB_NUM_NODES": "2"}),
]

LOG_TOOL = '#!/bin/sh\necho "$(basename "$0") $*" >>"$FAKE_LOG"\n'
FAKES = {
    "mpirun": "#!/bin/sh\necho 'mpirun (Open MPI) 4.1.4'\n",
    "mpiexec.hydra": "#!/bin/sh\necho 'HYDRA build details:'\necho '    Version:                                 4.0.2'\n",
    "srun": LOG_TOOL, "ibrun": LOG_TOOL, "module": LOG_TOOL, "apptainer": LOG_TOOL, "ch-run": LOG_TOOL,
    "scontrol": "#!/bin/sh\nexit 1\n", "nvidia-smi": "#!/bin/sh\nexit 0\n",  # no GPU here
}


def machine(root: Path) -> tuple[Path, Path]:
    """(the working folder, the folder of stand-ins) of the made-up machine, under root."""
    work, fakes = root / "work", root / "fakes"
    fakes.mkdir(parents=True)
    for name, text in FAKES.items():
        (fakes / name).write_text(text)
        (fakes / name).chmod(0o755)
    (work / "runs").mkdir(parents=True)
    (work / "hosts.txt").write_text("node1 slots=4\nnode2 slots=4\n")
    (work / "hpcdl.sif").write_text("not a real image\n")
    for image, family in (("hpcdl-cpu", "openmpi"), ("hpcdl-mpich", "mpich")):
        (work / "images" / image / "opt" / "hpcdl").mkdir(parents=True)
        (work / "images" / image / "opt" / "hpcdl" / "labels").write_text(f"hpcdl.mpi.family {family}\n")
    state = root / "vcluster"
    state.mkdir()
    (state / "demo.json").write_text(json.dumps({"name": "demo", "subnet": "10.200.7.0/24", "nodes": [
        {"hostname": f"node{i}", "address": f"10.200.7.{i}"} for i in (1, 2)]}))
    return work, fakes


def dry_run(root: Path, script: str, args: list[str], job: dict[str, str]) -> list[str]:
    """What the script prints with --dry-run: notes as they are, the command as its words; paths made generic."""
    work, fakes = root / "work", root / "fakes"
    env = {"PATH": f"{fakes}:/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"),
           "USER": "hpcdl", "LANG": "C.UTF-8", "HPCDL_DRY_RUN": "1", "FAKE_LOG": str(root / "calls.log"),
           "HPCDL_VCLUSTER_STATE": str(root / "vcluster")}
    env.update({name: value.replace("<work>", str(work)) for name, value in job.items()})
    done = subprocess.run(["taskset", "-c", "0", "bash", str(REPO / "launch" / script), *args], cwd=work, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    last = max(i for i, line in enumerate(lines) if line.startswith("[hpcdl] "))  # the command; notes before it
    words = [w for w in shlex.split(lines[last][len("[hpcdl] "):]) if w != "--allow-run-as-root"]  # root or not
    lines[last] = re.sub(r"--join-tag hpcdl-4242-\d+", "--join-tag hpcdl-4242-<pid>", " ".join(words))
    lines = [line.replace(str(work), "<work>").replace(str(fakes), "<fakes>").replace(str(REPO), "<repo>")
             .replace(str(root), "<root>") for line in lines]
    return lines


@pytest.fixture(scope="module")
def made_up_machine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("taskset") is None:
        pytest.skip("taskset (util-linux) is not installed: the lines depend on the cores")
    root = tmp_path_factory.mktemp("machine")
    machine(root)
    return root


def recorded() -> list[dict[str, Any]]:
    return json.loads(RECORDED.read_text())


def test_every_documented_command_is_recorded() -> None:
    assert [(c["script"], c["args"]) for c in recorded()] == [(s, a) for _, s, a, _ in COMMANDS]


@pytest.mark.parametrize("number", range(len(COMMANDS)), ids=lambda n: f"{COMMANDS[n][1]}-{n}")
def test_documented_command_prints_the_recorded_lines(number: int, made_up_machine: Path) -> None:
    _, script, args, job = COMMANDS[number]
    assert dry_run(made_up_machine, script, args, job) == recorded()[number]["lines"]


def record() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        machine(root)
        RECORDED.write_text(json.dumps([{"shown in": where, "script": script, "args": args, "job": job,
                                         "lines": dry_run(root, script, args, job)}
                                        for where, script, args, job in COMMANDS], indent=1) + "\n")


if __name__ == "__main__":
    record()
    sys.exit(0)
