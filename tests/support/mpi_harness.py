"""Helpers for tests that involve MPI: launching jobs safely and collective verdicts.

Two kinds of MPI tests live in this suite:
- in-process collective tests, marked ``@pytest.mark.mpi(min_size=2)``, run by
  ``mpiexec -n 4 python -m pytest --with-mpi``; they use :func:`assert_all_ranks`;
- tests that start a whole job with :func:`run_mpi` (a subprocess ``mpirun`` under a timeout).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from hpcdl.runtime.processes import descendants

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


def mpi_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for an Open MPI job here: root allowed, more ranks than cores allowed."""
    env = dict(os.environ)
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_rmaps_base_oversubscribe="1",
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
        PYTHONUNBUFFERED="1",
    )
    # A job started from inside a pytest-mpi rank must not inherit that rank's MPI identity.
    for key in list(env):
        if key.startswith(("OMPI_COMM_WORLD", "PMIX_", "OMPI_MCA_ess", "OMPI_MCA_orte", "OMPI_MCA_pmix")):
            env.pop(key)
    # Set by tests/conftest.py for the collective session; jobs get Horovod's default unless asked.
    env.pop("HOROVOD_DYNAMIC_PROCESS_SETS", None)
    env.update(extra or {})
    return env


def no_launcher_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without any launcher's or MPI's identity (nor hpcdl's settings): what a job a launcher
    other than mpirun starts (torchrun, plain srun) must be handed, one thread per rank, this checkout importable."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PMI_", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_", "TORCHELASTIC",
                                "HPCDL_"))}
    env.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(extra or {})})
    return env


def run_mpi(
    nprocs: int,
    args: Sequence[str],
    timeout: float = 180,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``mpirun -np N python ARGS...`` and return its result; never hangs past ``timeout``.

    On timeout the whole process group is killed and the returned result has returncode 124
    and the output gathered so far, so a hang shows up as a failed assertion, not a stuck suite.
    """
    mpirun = shutil.which("mpirun") or "mpirun"
    cmd = [mpirun, "-np", str(nprocs), "--bind-to", "none", PYTHON, *args]
    return run_bounded(cmd, timeout, mpi_env(env), cwd or REPO, "run_mpi")


def run_bounded(cmd: Sequence[str], timeout: float, env: dict[str, str], cwd: str | os.PathLike[str],
                who: str) -> subprocess.CompletedProcess[str]:
    """``cmd`` in a session of its own; past ``timeout`` its whole tree is killed (returncode 124, and the output
    gathered so far ends with a line naming ``who``)."""
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        return subprocess.CompletedProcess(list(cmd), 124, out, err + f"\n[{who}] killed after {timeout} s\n")


def kill_tree(pid: int) -> None:
    """SIGKILL a launcher and every process below it.

    Killing mpirun's process group is not enough: Open MPI starts each rank in a process group of
    its own, so the ranks of a hung job would survive mpirun, keep the output pipes open (the
    test then waits on them) and load the machine for the tests after it.
    """
    for victim in [pid, *descendants(pid)]:  # found before any is killed: orphans lose their parent
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(victim, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def assert_all_ranks(ok: bool, message: str = "") -> None:
    """Collective verdict: every rank fails if any rank failed, so no rank is left waiting."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    verdicts = comm.allgather((bool(ok), message))
    failed = [(rank, msg) for rank, (good, msg) in enumerate(verdicts) if not good]
    assert not failed, "failed on ranks: " + "; ".join(f"{r}: {m}" for r, m in failed)


def run_train(nprocs: int, output_dir: os.PathLike[str] | str, *flags: str, timeout: float = 240,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``mpirun -np N python -m hpcdl.train --output-dir DIR --no-progress FLAGS...``."""
    args = ["-m", "hpcdl.train", "--output-dir", str(output_dir), "--no-progress", *flags]
    return run_mpi(nprocs, args, timeout=timeout, env=env)


def error_lines(stderr: str) -> list[str]:
    """The one-line errors hpcdl printed (``<program>: error: ...``)."""
    return [line for line in stderr.splitlines() if ": error: " in line]


def epochs_to_resume_to(run_dir: os.PathLike[str] | str) -> int:
    """An --epochs for resuming a run that was cut short which is sure to train again: two more than it logged (its
    newest checkpoint may be one epoch past its last metrics row). A fixed small number races a fast machine, which
    can finish those epochs before the fault lands."""
    metrics = Path(run_dir) / "metrics.jsonl"
    logged = [line for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    return len(logged) + 2
