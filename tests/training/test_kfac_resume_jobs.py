"""A K-FAC run stopped between two inverse updates and resumed ends bit-identical to the run never stopped.

K-FAC's checkpoint holds the factors its decompositions came from, so the resumed steps precondition with the
decompositions the stopped run had, not ones recomputed from later factors (docs/reliability.md). Each case is a
real ``mpirun`` job on the embedded digits: stopped by SIGTERM mid-epoch at a step that is not a multiple of
``--kfac-inv-update-freq``, resumed, and compared with an uninterrupted run at the same final step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.reliability_runs import checkpoint_steps, load_checkpoint, run_job, same_weights

pytestmark = [pytest.mark.processes, pytest.mark.slow]

FINAL = 14
FLAGS = ("--kfac", "--kfac-inv-update-freq", "4", "--epochs", "1", "--max-steps", str(FINAL), "--seed", "5",
         "--log-every", "1", "--stall-timeout", "0")
CASES = {
    "1 rank": (1, ()),
    "2 ranks horovod, fraction 1/2": (2, ("--backend", "horovod", "--kfac-grad-worker-fraction", "0.5")),
    "2 ranks torch, a task": (2, ("--backend", "torch", "--task", "tests.support.tasks:digits_task")),
}


@pytest.mark.parametrize("case", CASES)
def test_a_kfac_run_stopped_between_inverse_updates_resumes_bit_identically(case: str, tmp_path: Path) -> None:
    ranks, extra = CASES[case]
    flags = (*FLAGS, *extra)
    whole = run_job(ranks, tmp_path / "whole", *flags, timeout=300)
    assert whole.rc == 0, whole.tail()

    run_dir = tmp_path / "stopped"
    stopped = run_job(ranks, run_dir, *flags, fault="0:9:term", timeout=300)
    assert stopped.rc == 0, stopped.tail()
    stop = checkpoint_steps(run_dir)[-1]
    assert stop < FINAL and stop % 4 != 0, (stop, stopped.tail())  # between inverse updates
    resumed = run_job(ranks, run_dir, *flags, "--resume", timeout=300)
    assert resumed.rc == 0, resumed.tail()
    assert f"hpcdl: finished: --max-steps {FINAL} reached at step {FINAL}; best " in resumed.out, resumed.tail()
    assert f"summary in {run_dir / 'summary.json'}" in resumed.out

    final, expected = load_checkpoint(run_dir, FINAL), load_checkpoint(tmp_path / "whole", FINAL)
    assert same_weights(final["model"], expected["model"]), case
    for side in ("a_factors", "g_factors"):
        assert all(torch.equal(a, b) for a, b in zip(final["kfac"][side], expected["kfac"][side], strict=True))
