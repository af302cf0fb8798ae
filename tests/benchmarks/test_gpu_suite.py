"""benchmarks/gpu_suite.sh: its --dry-run (every command, flag and file of the real run, checked on the
CPU) passes, catches a renamed flag, and the steps' planned seconds fit the budget of one device call."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes  # runs the suite's dry run (python --help of each tool, pytest --collect-only)

REPO = Path(__file__).resolve().parents[2]
SUITE = REPO / "benchmarks" / "gpu_suite.sh"


def dry_run(root: Path, out: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OUT": str(out), "PYTHON": str(REPO / ".venv" / "bin" / "python")}
    return subprocess.run(["bash", str(root / "benchmarks" / "gpu_suite.sh"), "--dry-run"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)


def test_dry_run_checks_every_step_and_passes(tmp_path: Path) -> None:
    result = dry_run(REPO, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    summary = (tmp_path / "summary.txt").read_text()
    for step in ("1 Open MPI", "2 setup.sh", "3 doctor", "4 CUDA tests", "5a train", "5b", "5c", "6a", "6b", "6c",
                 "6d"):
        assert re.search(rf"{re.escape(step)}.*dry-run ok", summary), step
    count = int(re.search(r"4 CUDA tests \((\d+)\)", summary).group(1))  # type: ignore[union-attr]
    assert count >= 8  # the nvJPEG tests among them: selected by their skip on CUDA, not by their names
    assert (tmp_path / "results.tar.gz").is_file()


def test_dry_run_fails_on_a_flag_a_tool_does_not_have(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    (root / "benchmarks").mkdir(parents=True)
    for name in ("hpcdl", "kfac", "scripts", "tests", ".venv"):
        (root / name).symlink_to(REPO / name)
    for script in (REPO / "benchmarks").glob("*.py"):
        (root / "benchmarks" / script.name).symlink_to(script)
    (root / "benchmarks" / "make_gpu_wheelhouse.sh").symlink_to(REPO / "benchmarks" / "make_gpu_wheelhouse.sh")
    text = SUITE.read_text()
    assert "--no-memory" in text
    (root / "benchmarks" / "gpu_suite.sh").write_text(text.replace("--no-memory", "--skip-memory"))
    result = dry_run(root, tmp_path / "out")
    assert result.returncode != 0
    assert re.search(r"6c kfac_overhead.*DRY-RUN FAILED.*--skip-memory", (tmp_path / "out" / "summary.txt").read_text())


def test_each_call_fits_the_device_limit_and_two_calls_cover_the_plan() -> None:
    """One device call may run 600 s: the suite stops starting steps at its budget, under that with room to
    hand its files back; the steps' planned seconds, setup's longer limit (a Horovod build) included, fit in
    two calls on the warm machine, as the header tells the user to make."""
    text = SUITE.read_text()
    budget = int(re.search(r'BUDGET="\$\{HPCDL_GPU_SUITE_BUDGET:-(\d+)\}"', text).group(1))  # type: ignore[union-attr]
    setup = max(int(m) for m in re.findall(r"SETUP_LIMIT=(\d+)", text))
    planned = [int(m.group(1)) for m in re.finditer(r'run_step "[^"]+" \S+ (\d+)', text)]
    assert 'run_step "2 setup.sh (GPU, existing torch)" setup.log "$SETUP_LIMIT"' in text
    assert len(planned) == 13 and budget <= 570 and setup + sum(planned) <= 2 * budget
