"""benchmarks/train_throughput.py's scaling part runs both backends side by side and reports each (no timing is
asserted: the figures are the lead's to take on a quiet machine)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.support.backends import needs_horovod
from tests.support.mpi_harness import PYTHON, REPO, mpi_env

pytestmark = pytest.mark.processes


@needs_horovod
@pytest.mark.timeout(900)
def test_scaling_of_both_backends_side_by_side(tmp_path: Path) -> None:
    result = subprocess.run([PYTHON, "benchmarks/train_throughput.py", "--modes", "--steps", "2", "--rounds", "1",
                             "--backends", "horovod", "torch", "--kfac", "--output", str(tmp_path / "tt")],
                            capture_output=True, text=True, cwd=REPO, env=mpi_env(), timeout=840)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "tt.json").read_text())
    assert set(report["backends"]) == {"horovod", "torch", "horovod+kfac", "torch+kfac"}
    for figures in report["backends"].values():
        assert figures["images_per_second_1_rank"] > 0 and figures["images_per_second_2_rank"] > 0
        assert len(figures["runs"]["1"]) == len(figures["runs"]["2"]) == 1
    torch, horovod = (report["backends"][b]["images_per_second_2_rank"] for b in ("torch", "horovod"))
    assert report["torch_over_horovod_2_ranks"] == pytest.approx(torch / horovod)
    assert report["images_per_second_2_rank"] == report["backends"]["horovod"]["images_per_second_2_rank"]
    assert "torch/horovod images/s at 2 ranks:" in result.stdout and "with K-FAC:" in result.stdout
    assert report["torch_over_horovod_2_ranks_kfac"] > 0
    assert (tmp_path / "tt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_virtual_cluster_that_does_not_exist_is_one_line_before_any_run(tmp_path: Path) -> None:
    result = subprocess.run([PYTHON, "benchmarks/train_throughput.py", "--modes", "--vcluster", "nosuch-w37",
                             "--output", str(tmp_path / "tt")], capture_output=True, text=True, cwd=REPO, env=mpi_env(),
                            timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].endswith(
        "no virtual cluster named 'nosuch-w37'; start one with .venv/bin/python -m hpcdl.tools.vcluster up --nodes 2 "
        "--name nosuch-w37"), result.stderr
    assert "Traceback" not in result.stderr and not list(tmp_path.iterdir())
