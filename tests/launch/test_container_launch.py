"""The container line of the launch scripts, and every bad container input as one line before a start.

No image is built here: a directory laid out like the one `make image` writes (its labels, its mount
points) stands in, and `--dry-run` shows the command. That the line really runs ranks is
tests/cluster/test_container_runs.py's job.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes  # starts the launch scripts (bash): not in the fast tier

REPO = Path(__file__).resolve().parents[2]
SLURM_SBATCH = REPO / "launch" / "slurm.sbatch"
MPIRUN_SH = REPO / "launch" / "mpirun.sh"
BUILD = REPO / "containers" / "build.sh"


def fake_image(root: Path, family: str = "openmpi") -> Path:
    """A directory with what launch/common.sh reads of an hpcdl image: labels and the mount points
    `make image` run from this checkout makes (this repository's top folder among them)."""
    image = root / "hpcdl-cpu"
    for folder in ("opt/hpcdl", REPO.parts[1], "tmp", "mnt/0", "root"):
        (image / folder).mkdir(parents=True, exist_ok=True)
    (image / "opt/hpcdl/labels").write_text(f"hpcdl.mpi.family {family}\nhpcdl.torch 2.13.0\n")
    return image


def fake_chrun(root: Path) -> Path:
    """A folder with a `ch-run` that only exists: dry runs never call it."""
    bin_dir = root / "bin"
    bin_dir.mkdir(exist_ok=True)
    chrun = bin_dir / "ch-run"
    chrun.write_text("#!/bin/sh\nexit 0\n")
    chrun.chmod(0o755)
    return bin_dir


def path_without(root: Path, program: str) -> Path:
    """A folder of links to every program on this PATH except one: a machine that lacks it."""
    folder = root / f"no-{program}"
    folder.mkdir()
    for directory in reversed(os.environ["PATH"].split(":")):
        if os.path.isdir(directory):
            for entry in os.scandir(directory):
                if entry.name != program:
                    link = folder / entry.name
                    link.unlink(missing_ok=True)
                    link.symlink_to(entry.path)
    return folder


def env_with(path_first: Path | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPCDL_", "SLURM_", "OMPI_"))}
    if path_first is not None:
        env["PATH"] = f"{path_first}:{env['PATH']}"
    env.update(extra)
    return env


def sbatch_dry(*args: str, env: dict[str, str], cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SLURM_SBATCH), "--dry-run", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=60)


def shown_command(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("[hpcdl] srun ")]
    assert lines, result.stderr
    return lines[-1]


def one_error_line(result: subprocess.CompletedProcess[str], expected: str) -> None:
    assert result.returncode != 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr


def test_a_directory_image_runs_under_chrun_with_what_charliecloud_needs(tmp_path: Path) -> None:
    image = fake_image(tmp_path)
    work = REPO  # under /work (or wherever the repository is): its top folder is bound
    result = sbatch_dry("--image", str(image), "--", "--epochs", "1", env=env_with(fake_chrun(tmp_path)), cwd=work)
    assert result.returncode == 0, result.stderr
    line = shown_command(result)
    top = "/" + str(work.resolve()).split("/")[1]
    assert "ch-run --join --set-env --home" in line
    for leak in ("VIRTUAL_ENV", "PYTHONPATH", "PIP_*", "LD_LIBRARY_PATH"):
        assert f"--unset-env={leak}" in shlex.split(line.removeprefix("[hpcdl] ")), line  # as words: quoting may vary
    bind = "" if top == "/tmp" else f"-b {top}:{top} "  # ch-run shares the host's /tmp by itself
    assert f"{bind}--cd {work.resolve()} {image} -- python -m hpcdl.train" in line, line
    assert "apptainer" not in line


def test_a_sif_keeps_the_apptainer_line_that_docs_show(tmp_path: Path) -> None:
    sif = tmp_path / "hpcdl.sif"
    sif.write_text("")
    bin_dir = fake_chrun(tmp_path)
    (bin_dir / "apptainer").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "apptainer").chmod(0o755)
    result = sbatch_dry("--image", str(sif), "--no-nv", "--bind", str(tmp_path), env=env_with(bin_dir))
    assert result.returncode == 0, result.stderr
    assert f"apptainer exec --bind {tmp_path} {sif} python -m hpcdl.train" in shown_command(result)


def test_runtime_charliecloud_and_a_bind_to_mnt(tmp_path: Path) -> None:
    image = fake_image(tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    result = sbatch_dry("--image", str(image), "--runtime", "charliecloud", "--bind", f"{data}:/mnt/0",
                        env=env_with(fake_chrun(tmp_path)), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    line = shown_command(result)
    assert f"-b {data}:/mnt/0 --cd {tmp_path.resolve()} {image} --" in line, line  # under /tmp: no bind of it


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing image", "container image not found: "),
        ("wrong kind", "not a container image: "),
        ("sif under charliecloud", "Charliecloud cannot run a SIF"),
        ("unknown runtime", "--runtime must be apptainer, singularity or charliecloud, got 'docker'"),
        ("runtime missing", "no container runtime found (ch-run, Charliecloud's, is not on PATH)"),
        ("bind source missing", "bind source not found: /nonexistent/data"),
        ("bind destination missing", "bind destination /nonexistent does not exist in the image"),
        ("launcher of the other family", "the image's MPI is mpich but the launcher is srun --mpi=pmix"),
        ("system folder as working directory", "is the image's own"),
        ("working directory with no mount point", "has no /srv to bind the working directory /srv onto"),
    ],
)
def test_bad_container_input_is_one_line(case: str, expected: str, tmp_path: Path) -> None:
    image = fake_image(tmp_path)
    chrun_path = fake_chrun(tmp_path)
    args: list[str] = ["--image", str(image)]
    env = env_with(chrun_path)
    cwd = tmp_path
    if case == "missing image":
        args = ["--image", str(tmp_path / "absent.sif")]
    elif case == "wrong kind":
        other = tmp_path / "image.tar"
        other.write_text("")
        args = ["--image", str(other)]
    elif case == "sif under charliecloud":
        sif = tmp_path / "x.sif"
        sif.write_text("")
        args = ["--image", str(sif), "--runtime", "charliecloud"]
    elif case == "unknown runtime":
        args += ["--runtime", "docker"]
    elif case == "runtime missing":
        env = env_with(None, PATH=str(path_without(tmp_path, "ch-run")))
    elif case == "bind source missing":
        args += ["--bind", "/nonexistent/data"]
    elif case == "bind destination missing":
        args += ["--bind", f"{tmp_path}:/nonexistent"]
    elif case == "launcher of the other family":
        args = ["--image", str(fake_image(tmp_path / "m", family="mpich"))]
    elif case == "system folder as working directory":
        cwd = Path("/usr/share")
    elif case == "working directory with no mount point":
        cwd = Path("/srv")  # a host folder the image (made for this checkout) has no mount point for
        if not cwd.is_dir():
            pytest.skip("this machine has no /srv")
    one_error_line(sbatch_dry(*args, env=env, cwd=cwd), expected)


def test_build_without_a_wheelhouse_is_one_line(tmp_path: Path) -> None:
    if os.geteuid() != 0 or subprocess.run(["bash", str(REPO / "containers/prereqs.sh"), "--check"],
                                           capture_output=True).returncode != 0:
        pytest.skip("the build reaches its wheelhouse check only as root with the build tools installed")
    result = subprocess.run(["bash", str(BUILD)], capture_output=True, text=True, timeout=60,
                            env=dict(os.environ, HPCDL_WHEELHOUSE=str(tmp_path / "none"), HPCDL_IMAGES=str(tmp_path)))
    one_error_line(result, f"no wheelhouse at {tmp_path / 'none'}")
    assert "make wheelhouse DIR=" in result.stderr


def test_build_without_root_is_one_line(tmp_path: Path) -> None:
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root to drop to another user (setpriv)")
    result = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bash", str(BUILD)],
                            capture_output=True, text=True, timeout=60, cwd="/",
                            env=dict(os.environ, HOME=str(tmp_path)))
    one_error_line(result, "building the image needs root")


def test_unknown_build_option_and_family_are_one_line() -> None:
    one_error_line(subprocess.run(["bash", str(BUILD), "--mpi", "lam"], capture_output=True, text=True, timeout=60),
                   "--mpi must be openmpi or mpich (got 'lam')")
    one_error_line(subprocess.run(["bash", str(BUILD), "--frobnicate"], capture_output=True, text=True, timeout=60),
                   "unknown option --frobnicate")
    one_error_line(subprocess.run(["bash", str(BUILD)], capture_output=True, text=True, timeout=60,
                                  env=dict(os.environ, HPCDL_MOUNT_POINTS="/check,data")),
                   "HPCDL_MOUNT_POINTS holds absolute paths, comma-separated (got 'data')")


# ------------------------------------------------------------------------- launch/mpirun.sh

def mpirun_dry(*args: str, env: dict[str, str], cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(MPIRUN_SH), "--dry-run", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=60)


def fake_hydra(bin_dir: Path) -> Path:
    """An MPICH-family mpiexec as far as --version goes (what the parser and the family check read)."""
    hydra = bin_dir / "mpiexec.hydra"
    hydra.write_text("#!/bin/sh\nprintf 'HYDRA build details:\\n    Version:    4.0.2\\n'\n")
    hydra.chmod(0o755)
    return hydra


def test_mpirun_sh_picks_chrun_for_a_directory_image(tmp_path: Path) -> None:
    image = fake_image(tmp_path)
    result = mpirun_dry("-np", "2", "--image", str(image), env=env_with(fake_chrun(tmp_path)))
    assert result.returncode == 0, result.stderr
    assert "ch-run --join --set-env --home" in result.stderr and f"{image} -- python -m hpcdl.train" in result.stderr
    assert "-x HPCDL_HOST_MPI" in result.stderr  # the doctor inside names the launcher


@pytest.mark.parametrize("family, launcher", [("mpich", "open-mpi"), ("openmpi", "hydra")])
def test_mpirun_sh_refuses_a_launcher_of_the_other_family(family: str, launcher: str, tmp_path: Path) -> None:
    image = fake_image(tmp_path, family=family)
    bin_dir = fake_chrun(tmp_path)
    args = ["-np", "2", "--image", str(image)]
    if launcher == "hydra":
        args += ["--mpirun", str(fake_hydra(bin_dir))]
    result = mpirun_dry(*args, env=env_with(bin_dir))
    other = "openmpi" if family == "mpich" else "mpich"
    one_error_line(result, f"the image's MPI is {family} but the launcher is")
    assert f"({other} family)" in result.stderr


def test_the_documented_container_commands_are_the_ones_the_tests_run() -> None:
    """docs/cluster.md's Charliecloud commands, checked against what tests/cluster/test_container_runs.py runs."""
    docs = (REPO / "docs" / "cluster.md").read_text()
    runs = (REPO / "tests" / "cluster" / "test_container_runs.py").read_text()
    block = docs[docs.index("IMG=$(make -s image | tail -n 1)"):]
    block = block[:block.index("```")]
    commands = [line.split("#")[0].strip() for line in block.splitlines()[1:] if line.strip()]
    assert commands == ["launch/mpirun.sh -np 4 --image $IMG --entry hpcdl.doctor",
                        "launch/mpirun.sh -np 2 --image $IMG -- --epochs 2",
                        "sbatch launch/slurm.sbatch --image $IMG -- --epochs 30"], commands
    # The same launchers and flags in the tests (the image comes from the same build: make image = build.sh).
    assert '"-np", "4", "--image", str(hpcdl_image), "--entry", "hpcdl.doctor"' in runs
    assert '"-np", "2", *image, "--", *TRAIN, *extra, "--epochs", "2"' in runs and '"--image", str(hpcdl_image)' in runs
    assert 'REPO / "launch" / "slurm.sbatch"' in runs
    assert '"--image", str(hpcdl_image), "--", *TRAIN, "--epochs", str(epochs)' in runs
    assert "epochs = 30" in runs
    make = subprocess.run(["make", "-n", "-s", "image"], capture_output=True, text=True, cwd=REPO)
    assert make.stdout.strip() == "bash containers/build.sh", make.stdout
