"""Against a real Slurm (munged + slurmctld + slurmd on this machine, tests/support/slurm_cluster.py).

What is checked: the batch scripts pass ``sbatch --test-only``; ``srun --mpi=pmix`` starts a real
MPI job (the doctor's per-rank table); Slurm's GPU variables lead every rank to a GPU of its own
with --gres and with --gpus-per-task; mpirun inside a job gets local ranks right although Slurm
tells every rank SLURM_LOCALID=0; launch/slurm.sbatch trains on 2 tasks end to end; and a job
warned of its time limit checkpoints, requeues itself and resumes to the end (also one submitted
with --no-resume).

Skips only where Slurm/munge or root are missing (scripts/install-slurm.sh installs them); set
HPCDL_REQUIRE_SLURM=1 to turn that skip into a failure, as CI should.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from hpcdl.runtime.launcher import local_rank_from_env
from hpcdl.runtime.world import choose_device
from tests.support.slurm_cluster import (
    NODE_GPUS,
    SlurmCluster,
    slurm,  # noqa: F401 - the shared fixture
)

pytestmark = pytest.mark.processes  # starts processes: not in the fast tier


REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv" / "bin" / "python"
# A task that reports what its launcher told it, without importing anything heavy.
# Short lines: srun forwards output in chunks, and long lines of parallel tasks can interleave.
REPORTED = ("SLURM_PROCID", "SLURM_LOCALID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "CUDA_VISIBLE_DEVICES")
REPORT_ENV = (
    "import json, os; print('ENV ' + json.dumps({k: os.environ[k] for k in %r if k in os.environ}), flush=True)"
    % (REPORTED,)
)


def job_env(**extra: str) -> dict[str, str]:
    """Environment for submitting: no launch settings from the caller's shell."""
    env = {key: "" for key in os.environ if key.startswith("HPCDL_")}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def reports(output: str) -> list[dict[str, str]]:
    """The environments REPORT_ENV printed, in task order."""
    # Found by pattern, not by line: mpirun's forwarding inside a job may run two ranks' lines together.
    found = [json.loads(match) for match in re.findall(r"ENV (\{[^{}]*\})", output)]
    return sorted(found, key=lambda env: int(env.get("OMPI_COMM_WORLD_RANK", env.get("SLURM_PROCID", "0"))))


# ------------------------------------------------------------------ the scripts against the controller


@pytest.mark.parametrize("script", ["launch/slurm.sbatch", "launch/frontera-rtx.sbatch"])
def test_sbatch_test_only_accepts_the_batch_scripts(slurm: SlurmCluster, script: str) -> None:
    result = slurm.run(["sbatch", "--test-only", str(REPO / script)], check=False, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert "to start at" in result.stderr


def test_sbatch_test_only_really_checks(slurm: SlurmCluster) -> None:
    """The same script asking for more GPUs than the node has is refused: --test-only is not a rubber stamp."""
    result = slurm.run(["sbatch", "--test-only", f"--gres=gpu:{NODE_GPUS + 4}", str(REPO / "launch/slurm.sbatch")],
                       check=False, cwd=REPO)
    assert result.returncode != 0
    assert "Requested node configuration is not available" in result.stderr


# ------------------------------------------------------------------ srun and placement


@pytest.mark.timeout(240)
def test_srun_pmix_runs_the_doctor_on_two_ranks(slurm: SlurmCluster) -> None:
    result = slurm.run(["srun", "-n", "2", "--mpi=pmix", "--kill-on-bad-exit=1", str(PYTHON), "-m", "hpcdl.doctor"],
                       check=False, timeout=200, env=job_env())
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert re.search(r"world size\s+2\b", result.stdout)
    rows = re.findall(r"^\s+(\S+)\s+(\d+)\s+(\d+)\s+(\d+)\s+cpu\b", result.stdout, re.M)
    assert sorted((rank, local_rank, local_size) for _, rank, local_rank, local_size in rows) == [
        ("0", "0", "2"), ("1", "1", "2")
    ], result.stdout
    assert "ok: this environment can run hpcdl" in result.stdout


def test_srun_without_pmix_cannot_start_open_mpi(slurm: SlurmCluster) -> None:
    """The troubleshooting entry in docs/cluster.md: without --mpi=pmix Open MPI refuses to start."""
    code = "from mpi4py import MPI; print('size', MPI.COMM_WORLD.Get_size())"
    result = slurm.run(["srun", "-n", "2", "--mpi=none", str(PYTHON), "-c", code], check=False, timeout=120, env=job_env())
    assert result.returncode != 0
    assert "PMI" in result.stdout + result.stderr


@pytest.mark.parametrize("request_gpus", ["--gres=gpu:4", "--gpus-per-task=1"])
def test_each_rank_gets_its_own_gpu(slurm: SlurmCluster, request_gpus: str) -> None:
    """What Slurm really sets, fed to hpcdl.world: four tasks must drive four different GPUs."""
    result = slurm.run(["srun", "-n", "4", request_gpus, str(PYTHON), "-c", REPORT_ENV], timeout=120, env=job_env())
    tasks = reports(result.stdout)
    assert len(tasks) == 4, result.stdout
    physical = []
    for env in tasks:
        visible = env["CUDA_VISIBLE_DEVICES"].split(",")
        device = choose_device(local_rank_from_env(env), len(visible))
        physical.append(visible[device.index])
        if request_gpus.startswith("--gres"):
            assert len(visible) == NODE_GPUS  # everyone sees all four and picks by local rank
        else:
            assert len(visible) == 1 and device.index == 0  # one visible: use it
    assert sorted(physical) == [str(i) for i in range(NODE_GPUS)]


def test_mpirun_inside_a_job_gets_local_ranks_from_open_mpi(slurm: SlurmCluster, tmp_path: Path) -> None:
    """Under mpirun in an allocation, Slurm says SLURM_LOCALID=0 to every rank; Open MPI's variable must win."""
    wrap = (f"OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 120 "
            f"mpirun -np 2 --bind-to none {PYTHON} -c \"{REPORT_ENV}\"")
    out = tmp_path / "job.out"
    job = slurm.sbatch(None, sbatch_args=["-n", "2", "-o", str(out), "--wrap", wrap], env=job_env(), cwd=tmp_path)
    assert slurm.wait_for_job(job, timeout=150) == "COMPLETED", out.read_text()
    tasks = reports(out.read_text())
    assert [env["SLURM_LOCALID"] for env in tasks] == ["0", "0"]  # the trap
    assert [local_rank_from_env(env) for env in tasks] == [0, 1]


# ------------------------------------------------------------------ the batch script end to end


def submit_training(slurm: SlurmCluster, workdir: Path, *train_args: str) -> int:
    """launch/slurm.sbatch on 2 tasks, submitted from a folder outside the repository."""
    return slurm.sbatch(
        REPO / "launch" / "slurm.sbatch",
        script_args=[*train_args, "--no-progress"],
        sbatch_args=["--ntasks-per-node=2", "--cpus-per-task=1", "--gres=gpu:2", "--time=10"],
        env=job_env(),
        cwd=workdir,
    )


def job_field(slurm: SlurmCluster, job: int, field: str) -> str:
    found = re.search(rf"\b{field}=(\S+)", slurm.run(["scontrol", "-o", "show", "job", str(job)]).stdout)
    assert found, field
    return found.group(1)


@pytest.mark.timeout(300)
def test_generic_batch_script_trains_on_two_tasks(slurm: SlurmCluster, tmp_path: Path) -> None:
    job = submit_training(slurm, tmp_path, "--epochs", "1")
    state = slurm.wait_for_job(job, timeout=280)
    log = (tmp_path / f"hpcdl-{job}.out").read_text()
    assert state == "COMPLETED", log[-4000:]
    assert job_field(slurm, job, "ExitCode") == "0:0"
    assert "srun --mpi=pmix --kill-on-bad-exit=1 --cpus-per-task=1" in log
    assert re.search(r"epoch\s+1/1 \| train loss", log), log[-4000:]
    summary = json.loads((tmp_path / "runs" / f"hpcdl-{job}" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["epochs"] == 1
    assert summary["final_accuracy"] > 0.2  # chance is 0.1


@pytest.mark.timeout(420)
@pytest.mark.parametrize("script_args", [[], ["--no-resume"]], ids=["default", "no-resume"])
def test_time_limit_signal_checkpoints_requeues_and_resumes(slurm: SlurmCluster, tmp_path: Path,
                                                            script_args: list[str]) -> None:
    """What --signal=B:USR1@120 sets off, with the signal sent by hand once the first epoch is done.

    With --no-resume too: that says the first start is a new run; the requeued start is the same job
    and resumes its own checkpoint (it used to refuse its own folder and end FAILED)."""
    # Long after the first epoch, where the signal is sent: a fast machine ran 4 in 0.5 s, so 15 more leave it
    # about 2 s for the signal to reach the ranks (a 2-core CI machine: about 15 s).
    epochs = 16
    job = submit_training(slurm, tmp_path, *script_args, "--epochs", str(epochs))
    metrics = tmp_path / "runs" / f"hpcdl-{job}" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().strip()):
        assert time.monotonic() < deadline, "the first epoch never finished"
        assert slurm.job_state(job) in ("PENDING", "RUNNING", "CONFIGURING"), slurm.job_state(job)
        time.sleep(0.1)
    slurm.run(["scancel", "--batch", "--signal=USR1", str(job)])

    state = slurm.wait_for_job(job, timeout=300)
    log = (tmp_path / f"hpcdl-{job}.out").read_text()
    assert state == "COMPLETED", log[-4000:]
    assert job_field(slurm, job, "Restarts") == "1", log[-4000:]
    assert "time limit near" in log and "requeueing job" in log
    assert "SIGUSR1 received" in log
    assert "resuming from" in log
    starts = [line.split() for line in re.findall(r"(?m)^\[hpcdl\] srun .*-m hpcdl\.train (.*)$", log)]
    assert len(starts) == 2 and "--resume" in starts[1], starts
    assert ("--resume" in starts[0]) == (not script_args), starts  # --no-resume: the first start was a new run
    # Resumed, not restarted: every epoch is logged once, in order.
    logged = [json.loads(line)["epoch"] for line in metrics.read_text().splitlines() if line.strip()]
    assert logged == list(range(1, epochs + 1)), logged
    summary = json.loads(metrics.with_name("summary.json").read_text())
    assert summary["epochs"] == epochs and summary["world_size"] == 2
