"""A failing rank under ``srun`` ends the whole job step promptly (a real one-node Slurm, tests/support/slurm_cluster.py).

mpirun ends a job whose rank dies; srun does so only when asked (``--kill-on-bad-exit=1``, which
the batch scripts in launch/ pass). A rank that raises calls MPI_Abort itself (hpcdl.errors), so
either way the other rank is not left waiting in the allreduce. Skips only where the fixture
cannot run (no Slurm/munge, not root); HPCDL_REQUIRE_SLURM=1 turns that skip into a failure.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from tests.support.backends import backend_param
from tests.support.reliability_runs import FAULT_LINE
from tests.support.slurm_cluster import (
    SlurmCluster,
    slurm,  # noqa: F401 - the shared fixture
)

pytestmark = pytest.mark.processes  # starts processes: not in the fast tier


REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv" / "bin" / "python"


SRUN_TASK_ERROR = re.compile(r"srun: error: \S+: tasks? ([\d,\-]+): (?:Exited with exit code \d+|Killed)")


def failed_tasks(output: str) -> set[int]:
    """Task ids srun reports as failed; it writes ``task 1`` or, when it killed the step, ``tasks 0-1``."""
    tasks: set[int] = set()
    for listed in SRUN_TASK_ERROR.findall(output):
        for part in listed.split(","):
            first, _, last = part.partition("-")
            tasks.update(range(int(first), int(last or first) + 1))
    return tasks


@pytest.mark.parametrize(
    "line, expected",
    [
        ("srun: error: vm: task 1: Exited with exit code 1", {1}),
        ("srun: error: vm: tasks 0-1: Killed", {0, 1}),
        ("srun: error: node7: tasks 0,2-3: Killed", {0, 2, 3}),
        ("srun: error: vm: task 0: Exited with exit code 1", {0}),
        ("srun: Job step aborted: Waiting up to 7 seconds", set()),
    ],
)
def test_failed_tasks_reads_both_forms_of_srun_report(line: str, expected: set[int]) -> None:
    assert failed_tasks(line) == expected


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind, backend", [backend_param("exception", "horovod", id="exception"),
                                           backend_param("kill", "horovod", id="kill"),
                                           backend_param("kill", "torch", id="kill-torch")])
def test_failing_rank_under_srun_ends_the_job_within_60_seconds(slurm: SlurmCluster, tmp_path: Path, kind: str,
                                                                backend: str) -> None:
    env = {key: "" for key in os.environ if key.startswith("HPCDL_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HPCDL_FAULT=f"1:5:{kind}")
    result = slurm.run(
        ["srun", "-n", "2", "--mpi=pmix", "--kill-on-bad-exit=1", str(PYTHON), "-m", "hpcdl.train",
         "--output-dir", str(tmp_path / "run"), "--no-progress", "--epochs", "1", "--backend", backend],
        check=False, timeout=200, env=env, cwd=REPO,
    )
    ended = time.time()
    output = result.stdout + result.stderr
    faults = FAULT_LINE.findall(output)
    assert faults, output[-3000:]
    seconds = ended - float(faults[0][3])
    print(f"\n[srun {kind}] job ended {seconds:.1f} s after the fault")
    assert result.returncode != 0, output[-3000:]
    assert seconds < 60, output[-3000:]
    assert 1 in failed_tasks(output), output[-3000:]
    if kind == "exception":
        assert "hpcdl.train: rank 1 failed with RuntimeError: injected fault on rank 1 at step 5" in output
