"""The environment doctor: healthy here, and a one-line diagnosis for each broken case."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from hpcdl.tools import doctor
from tests.support.backends import needs_horovod
from tests.support.mpi_harness import PYTHON, REPO, mpi_env, run_mpi

pytestmark = pytest.mark.processes  # starts processes: not in the fast tier



def run_doctor(extra_path: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = mpi_env()
    if extra_path is not None:
        env["PYTHONPATH"] = f"{extra_path}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return subprocess.run([PYTHON, "-m", "hpcdl.doctor"], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)


@pytest.fixture(scope="module")
def plain_doctor() -> subprocess.CompletedProcess[str]:
    """``python -m hpcdl.doctor`` in this environment, run once: the tests below read its one report."""
    return run_doctor()


@needs_horovod
def test_healthy_environment_passes_and_reports_builds(plain_doctor: subprocess.CompletedProcess[str]) -> None:
    result = plain_doctor
    assert result.returncode == 0, result.stderr
    for expected in ("torch", "torchvision", "horovod tensor ops", "MPI thread level", "MULTIPLE", "same MPI", "yes"):
        assert expected in result.stdout
    assert "MPI, Gloo" in result.stdout


def test_under_mpirun_rank_0_prints_one_row_per_rank() -> None:
    result = run_mpi(3, ["-m", "hpcdl.doctor"], timeout=120)
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.strip().split()[:1] and line.split()[-2:-1]]
    rank_rows = [r for r in rows if len(r) >= 6 and r[1].isdigit() and r[4] == "cpu"]
    assert sorted(int(r[1]) for r in rank_rows) == [0, 1, 2]
    assert {int(r[3]) for r in rank_rows} == {3}  # local size
    assert result.stdout.count("hpcdl environment") == 1  # rank 0 only
    assert "gloo: allreduce over 3 rank(s) ok" in result.stdout  # --backend torch's process group, from MPI's ranks


WITHOUT_HOROVOD = ("import importlib.util as u, sys; real = u.find_spec; "
                   "u.find_spec = lambda name, *a: None if name.split('.')[0] == 'horovod' else real(name, *a); "
                   "from hpcdl.tools.doctor import main; sys.exit(main())")


def test_an_environment_without_horovod_passes_for_the_torch_backend() -> None:
    """A setup with HPCDL_HOROVOD=0: Horovod's rows say so, the torch backend is checked, and the doctor passes."""
    result = run_mpi(2, ["-c", WITHOUT_HOROVOD], timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "not installed (hpcdl.train --backend torch only" in result.stdout
    assert "horovod tensor ops" not in result.stdout
    assert "gloo: allreduce over 2 rank(s) ok" in result.stdout


@needs_horovod
def test_hidden_horovod_extension_is_diagnosed(tmp_path: Path) -> None:
    """A copy of the horovod package without its compiled libraries: the silent 'MPI libs are missing' case."""
    import horovod

    source = Path(horovod.__file__).parent
    shutil.copytree(source, tmp_path / "horovod", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    result = run_doctor(tmp_path)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("doctor:")]
    assert len(lines) == 1 and "extension is missing" in lines[0] and "fix:" in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_missing_mpi4py_is_diagnosed(tmp_path: Path) -> None:
    (tmp_path / "mpi4py").mkdir()
    (tmp_path / "mpi4py" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'mpi4py'\", name='mpi4py')\n"
    )
    result = run_doctor(tmp_path)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("doctor:")]
    assert len(lines) == 1 and "mpi4py is missing" in lines[0] and "fix:" in lines[0], result.stderr


def test_different_mpi_libraries_are_a_problem() -> None:
    with pytest.raises(doctor.Problem, match="Horovod uses .* but mpi4py uses"):
        doctor.check_same_mpi({"horovod": "/opt/mpich/lib/libmpi.so.12", "mpi4py": "/usr/lib/libmpi.so.40"})
    doctor.check_same_mpi({"horovod": "/usr/lib/libmpi.so.40", "mpi4py": "/usr/lib/libmpi.so.40"})


def test_two_ranks_on_one_pretend_gpu_fail_the_doctor_with_one_line() -> None:
    """hpcdl.placement decides (its own tests cover every case); the doctor must say it once and fail everywhere."""
    result = run_mpi(2, ["-m", "hpcdl.doctor"], timeout=120, env={"HPCDL_FAKE_GPU_UUIDS": "GPU-fake-0"})
    assert result.returncode not in (0, 124), result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("doctor:")]
    assert len(lines) == 1 and "ranks 0 and 1 on" in lines[0] and "share one GPU" in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    ok = run_mpi(2, ["-m", "hpcdl.doctor"], timeout=120, env={"HPCDL_FAKE_GPU_UUIDS": "GPU-fake-0,GPU-fake-1"})
    assert ok.returncode == 0, ok.stderr


def test_reports_which_torch_cuda_and_nccl(plain_doctor: subprocess.CompletedProcess[str]) -> None:
    import torch

    result = plain_doctor
    assert result.returncode == 0, result.stderr
    torch_line = next(line for line in result.stdout.splitlines() if line.strip().startswith("torch "))
    assert torch.__version__ in torch_line and str(Path(torch.__file__).parent) in torch_line
    assert "torch CUDA" in result.stdout and "NCCL (torch)" in result.stdout and "NCCL (horovod)" in result.stdout
    if torch.version.cuda:
        assert ".".join(map(str, torch.cuda.nccl.version())) in result.stdout


def test_nccl_version_codes() -> None:
    assert doctor.nccl_code_version(22907) == "2.29.7"
    assert doctor.nccl_code_version(2804) == "2.8.4"
    assert doctor.nccl_code_version(0) == "not built"


def test_expect_gpu_on_this_cpu_machine_fails_with_one_line() -> None:
    env = mpi_env({"HPCDL_EXPECT_GPU": "1"})
    result = subprocess.run([PYTHON, "-m", "hpcdl.doctor"], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("doctor:")]
    assert len(lines) == 1 and "see no GPU" in lines[0], result.stderr


def test_every_rank_alone_is_diagnosed() -> None:
    with pytest.raises(doctor.Problem, match="started 4 tasks .* world of 1"):
        doctor.check_launcher_agrees(1, {"PMI_SIZE": "4"})
    doctor.check_launcher_agrees(4, {"PMI_SIZE": "4", "SLURM_STEP_NUM_TASKS": "4"})
    doctor.check_launcher_agrees(1, {"SLURM_STEP_NUM_TASKS": "1"})
