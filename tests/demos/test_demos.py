"""The hello and collectives demos, run as users run them: under mpirun, in a subprocess with a timeout."""

from __future__ import annotations

import re

import pytest
import torch
from mpi4py import MPI

from hpcdl.demos.collectives import tour
from tests.support.mpi_harness import error_lines, run_mpi

pytestmark = pytest.mark.processes  # starts processes: not in the fast tier


def test_hello_reports_every_rank_in_rank_order() -> None:
    result = run_mpi(3, ["-m", "hpcdl.demos.hello"], timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [int(m) for m in re.findall(r"^rank\s+(\d+) of 3 ", result.stdout, flags=re.M)]
    assert ranks == [0, 1, 2], result.stdout
    assert re.findall(r"horovod rank (\d+)", result.stdout) == ["0", "1", "2"]
    assert "local rank 2 of 3" in result.stdout and "device cpu" in result.stdout
    assert result.stdout.startswith("3 rank(s) on 1 host(s)")


def test_hello_bad_option_is_one_line_on_rank_zero() -> None:
    result = run_mpi(2, ["-m", "hpcdl.demos.hello", "--no-such-option"], timeout=120)
    assert result.returncode != 0
    assert result.stderr.count("error:") == 1 and "Traceback" not in result.stderr, result.stderr


def test_collectives_demo_checks_everything_on_four_ranks() -> None:
    result = run_mpi(4, ["-m", "hpcdl.demos.collectives"], timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    names = ["Bcast", "Scatter", "Gather", "Reduce", "Allreduce", "Allgather", "Alltoall", "Reduce_scatter"]
    for name in names:
        assert len(re.findall(rf"^  {name}\s+ok ", result.stdout, flags=re.M)) == 2, (name, result.stdout)
    assert "all collectives correct" in result.stdout
    assert "100 200 300]" in result.stdout  # alltoall: rank 0 receives 100 j from rank j


def test_tour_on_one_rank_numpy_and_torch() -> None:
    for make in (lambda a: a, torch.from_numpy):
        steps = tour(MPI.COMM_SELF, make)
        assert [name for name, _, _ in steps][:2] == ["Bcast", "Scatter"] and len(steps) == 8
        assert all(ok for _, ok, _ in steps), steps


def test_stop_demo_runs_to_the_end_without_a_signal() -> None:
    """hpcdl.demos.stop (signals are tested in tests/runtime/test_signals.py): no signal, every rank exits 0."""
    result = run_mpi(2, ["-m", "hpcdl.demos.stop", "--steps", "3", "--step-seconds", "0"], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(re.findall(r"^rank (\d) exits 0$", result.stdout, flags=re.M)) == ["0", "1"], result.stdout


def test_stop_demo_bad_value_is_one_line() -> None:
    result = run_mpi(2, ["-m", "hpcdl.demos.stop", "--steps", "0"], timeout=120)
    assert result.returncode == 2
    assert error_lines(result.stderr) == ["hpcdl.demos.stop: error: argument --steps: must be an integer >= 1 "
                                          "(got 0) (see --help)"]
