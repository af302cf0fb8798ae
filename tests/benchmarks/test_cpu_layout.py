"""benchmarks/cpu_layout.py runs both layouts side by side through hpcdl.train and reports their ratio (no timing is
asserted: the figures are taken on a quiet machine)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.support.mpi_harness import PYTHON, REPO, mpi_env

pytestmark = pytest.mark.processes


@pytest.mark.timeout(600)
def test_each_case_runs_nchw_and_nhwc_in_alternating_pairs(tmp_path: Path) -> None:
    result = subprocess.run([PYTHON, "benchmarks/cpu_layout.py", "--cases", "digits_cnn", "--pairs", "2", "--steps",
                             "2", "--output", str(tmp_path / "cl")], capture_output=True, text=True, cwd=REPO,
                            env=mpi_env(), timeout=540)
    assert result.returncode == 0, result.stderr[-3000:]
    [row] = json.loads((tmp_path / "cl.json").read_text())["rows"]
    assert row["case"] == "digits_cnn" and len(row["speedups"]) == 2
    for nchw, nhwc, speedup in zip(row["step_seconds_nchw"], row["step_seconds_nhwc"], row["speedups"], strict=True):
        assert nchw > 0 and nhwc > 0 and speedup == pytest.approx(nchw / nhwc)
    assert "digits_cnn, pair 1: NCHW" in result.stdout and "digits_cnn, pair 2: NCHW" in result.stdout


def test_an_unknown_case_is_one_line_before_any_run(tmp_path: Path) -> None:
    result = subprocess.run([PYTHON, "benchmarks/cpu_layout.py", "--cases", "vgg", "--output", str(tmp_path / "cl")],
                            capture_output=True, text=True, cwd=REPO, env=mpi_env(), timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "invalid choice: 'vgg'" in result.stderr.strip().splitlines()[-1] and not list(tmp_path.iterdir())
