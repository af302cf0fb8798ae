"""A failing rank under ``srun`` ends the whole job step promptly (a real one-node Slurm, tests/slurm_cluster.py).

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
from typing import Iterator

import pytest

from reliability_runs import FAULT_LINE
from slurm_cluster import slurm  # noqa: F401 - the shared fixture
from slurm_cluster import SlurmCluster, missing_requirements

REPO = Path(__file__).resolve().parents[1]
PYTHON = REPO / ".venv" / "bin" / "python"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["exception", "kill"])
def test_failing_rank_under_srun_ends_the_job_within_60_seconds(slurm: SlurmCluster, tmp_path: Path, kind: str) -> None:
    env = {key: "" for key in os.environ if key.startswith("HPCDL_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HPCDL_FAULT=f"1:5:{kind}")
    result = slurm.run(
        ["srun", "-n", "2", "--mpi=pmix", "--kill-on-bad-exit=1", str(PYTHON), "-m", "hpcdl.train",
         "--output-dir", str(tmp_path / "run"), "--no-progress", "--epochs", "1"],
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
    assert re.search(r"srun: error: \S+: task 1: (Exited with exit code 1|Killed)", output), output[-3000:]
    if kind == "exception":
        assert "hpcdl.train: rank 1 failed with RuntimeError: injected fault on rank 1 at step 5" in output
