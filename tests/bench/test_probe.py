"""hpcdl.bench.probe on 2 local ranks: every pattern times the asked number of calls, bad input is one line."""

from __future__ import annotations

import json

import pytest

from tests.support.mpi_harness import error_lines, run_mpi

pytestmark = pytest.mark.processes  # starts mpirun


@pytest.mark.parametrize("pattern", ["allreduce", "oneway", "sendrecv"])
def test_each_pattern_prints_one_json_line_with_every_call(pattern: str) -> None:
    result = run_mpi(2, ["-m", "hpcdl.bench.probe", "--size", "64K", "--calls", "3", "--pattern", pattern,
                         "--label", "t"], timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # rank 0 only
    row = json.loads(lines[0])
    assert (row["pattern"], row["ranks"], row["bytes"], row["label"]) == (pattern, 2, 65536, "t")
    assert len(row["seconds"]) == len(row["cpu_seconds"]) == 3
    assert all(t > 0 for t in row["seconds"])
    assert row["median_busbw_GBps"] == pytest.approx(65536 / row["median_seconds"] / 1e9)


def test_point_to_point_on_three_ranks_is_a_one_line_error() -> None:
    result = run_mpi(3, ["-m", "hpcdl.bench.probe", "--size", "4K", "--pattern", "sendrecv"], timeout=120)
    assert result.returncode == 2
    assert error_lines(result.stderr) == ["hpcdl.bench.probe: error: --pattern sendrecv needs exactly 2 ranks, got 3"]
