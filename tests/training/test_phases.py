"""Where a step goes: the phase breakdown (hpcdl.training.phases) and ``--profile-steps`` traces.

A 2-rank K-FAC run traces steps 2-3 on every rank; the traces load as JSON with the named phases nested
inside their step, and the summary's per-phase seconds add up to the step on every rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hpcdl.runtime.errors import UsageError
from hpcdl.training.config import default_backend
from hpcdl.training.phases import PHASES, STEP, breakdown, parse_profile_steps
from tests.support.mpi_harness import error_lines, run_train

# The phases a K-FAC step on 2 ranks must show in its trace, each inside the step's range.
TRACED = ("hpcdl.forward", "hpcdl.backward", "hpcdl.allreduce", "hpcdl.kfac", "hpcdl.optimizer",
          "kfac.factor_reduction", "kfac.decompositions", "kfac.sharing", "kfac.precondition")


def test_profile_steps_parse_and_refuse_in_one_line() -> None:
    assert parse_profile_steps("3:5") == (3, 5) and parse_profile_steps("4") == (4, 4)
    for bad in ("0:2", "5:3", "a:b", ":", "2:"):
        with pytest.raises(UsageError, match="--profile-steps must be FIRST:LAST"):
            parse_profile_steps(bad)


class _OneRank:
    @staticmethod
    def allgather(value):
        return [value]


def test_breakdown_takes_medians_and_means_per_phase_and_names_the_slowest_rank() -> None:
    steps = np.arange(3 * (len(PHASES) + 1), dtype=float).reshape(3, -1)
    out = breakdown(steps, _OneRank()).to_json()
    assert out["steps"] == 3
    first = out["phases"][PHASES[0]]
    assert first["median_per_rank"] == [float(np.median(steps[:, 0]))] and first["slowest_rank"] == 0
    assert out["phases"]["step"]["mean_per_rank"] == [float(steps[:, -1].mean())]


def _events(trace: Path) -> list[dict]:
    return [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]


@pytest.mark.processes
def test_a_traced_two_rank_kfac_run_writes_nested_phases_per_rank_and_phases_add_up(tmp_path: Path) -> None:
    run = tmp_path / "run"
    result = run_train(2, run, "--kfac", "--kfac-inv-update-freq", "1", "--kfac-grad-worker-fraction", "0.5",
                       "--epochs", "1", "--max-steps", "4", "--profile-steps", "2:3", "--stall-timeout", "0")
    assert result.returncode == 0, result.stderr[-2000:]
    if default_backend() == "horovod":  # Horovod's timeline follows the same window (HOROVOD_TIMELINE=DYNAMIC)
        assert (run / "traces" / "horovod_timeline.json").stat().st_size > 0
    for rank in (0, 1):
        events = _events(run / "traces" / f"rank{rank}.json")
        steps = [e for e in events if e["name"] == STEP]
        assert len(steps) == 2, f"rank {rank}: {len(steps)} traced steps, expected 2 (steps 2 and 3)"
        for name in TRACED:
            inside = [e for e in events if e["name"] == name
                      and any(s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] for s in steps)]
            assert inside, f"rank {rank}: no {name} inside a traced step"
    summary = json.loads((run / "summary.json").read_text())
    phases = summary["step_phases"]["phases"]
    assert summary["step_phases"]["steps"] == 4
    for rank in (0, 1):
        named = sum(phases[p]["mean_per_rank"][rank] for p in PHASES)
        step = phases["step"]["mean_per_rank"][rank]
        # What is not named is the loop's bookkeeping between phases (learning rate, flags): a few per cent.
        assert 0.9 * step <= named <= step * 1.0001, f"rank {rank}: phases add up to {named:.4f} s of {step:.4f} s"
    assert phases["kfac.decompositions"]["median_slowest"] > 0 and phases["forward"]["median_fastest"] > 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step_phases"]["steps"] >= 1


@pytest.mark.processes
def test_bad_profile_steps_is_one_line_before_anything_starts(tmp_path: Path) -> None:
    result = run_train(2, tmp_path / "run", "--profile-steps", "5:2", timeout=60)
    assert result.returncode == 2 and len(error_lines(result.stderr)) >= 1, result.stderr[-1000:]
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()
