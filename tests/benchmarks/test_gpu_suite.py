"""benchmarks/gpu_suite.sh: its --dry-run (every command, flag and file of each run, checked on the CPU) passes,
catches a renamed flag and a plan over its budget, and each run fits one device call of under 5 minutes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes  # runs the suite's dry run (python --help of each tool, pytest --collect-only)

REPO = Path(__file__).resolve().parents[2]
SUITE = REPO / "benchmarks" / "gpu_suite.sh"
GUIDE = REPO / "docs" / "gpu.md"


@pytest.fixture(scope="module")
def help_texts(tmp_path_factory) -> Path:
    """One folder of the programs' --help texts for all the dry runs here: each program's imports once, not per run
    (the copies link the same programs; the suite's own text, what the tests vary, is read anew each run)."""
    return tmp_path_factory.mktemp("help")


def dry_run(root: Path, out: Path, *args: str, env: dict[str, str] | None = None,
            help_cache: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OUT": str(out), "PYTHON": str(REPO / ".venv" / "bin" / "python"), **(env or {}),
           **({"HPCDL_GPU_SUITE_HELP_CACHE": str(help_cache)} if help_cache else {})}
    return subprocess.run(["bash", str(root / "benchmarks" / "gpu_suite.sh"), "--dry-run", *args], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)


def linked_copy(tmp_path: Path, suite_text: str | None = None) -> Path:
    """A repository whose files are the real ones (links), with the suite's text replaced where given."""
    root = tmp_path / "repo"
    (root / "benchmarks").mkdir(parents=True)
    for name in ("hpcdl", "kfac", "scripts", "tests", "examples", ".venv"):
        (root / name).symlink_to(REPO / name)
    for script in [*(REPO / "benchmarks").glob("*.py"), REPO / "benchmarks" / "make_gpu_wheelhouse.sh"]:
        (root / "benchmarks" / script.name).symlink_to(script)
    (root / "benchmarks" / "gpu_suite.sh").write_text(suite_text if suite_text is not None else SUITE.read_text())
    return root


def test_dry_run_checks_every_step_of_every_run_and_passes(tmp_path: Path, help_texts: Path) -> None:
    result = dry_run(REPO, tmp_path, help_cache=help_texts)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    summary = (tmp_path / "summary.txt").read_text()
    for step in ("A0 carried wheels", "A0 Open MPI", "A0 mpi4py", "A1 loop fp32 / amp / amp+cl", "A2 --amp auto",
                 "A4 loader", "B1 Horovod with NCCL", "B2 train", "B3 K-FAC", "B4 allreduce",
                 "B5 Horovod+NCCL vs NCCL DDP",
                 "C1 doctor", "C2 CUDA tests", "C3 2 ranks on 1 GPU", "C4 1 rank bound", "C5 loop --compile"):
        assert re.search(rf"{re.escape(step)}.*dry-run ok", summary), step
    count = int(re.search(r"C2 CUDA tests \((\d+)\)", summary).group(1))  # type: ignore[union-attr]
    assert count >= 8  # the nvJPEG tests among them: selected by their skip on CUDA, not by their names
    for run in "ABC":
        assert re.search(rf"run {run}: the plan, \d+ s of steps in a \d+ s budget", result.stdout)
    assert "(from the H200 runs of 2026-11-27/28)" in result.stdout and "(estimated)" in result.stdout
    steps = json.loads((tmp_path / "summary.json").read_text())["steps"]
    assert len(steps) >= 20 and all(set(step) == {"step", "status", "seconds", "limit"} for step in steps)
    assert (tmp_path / "results.tar.gz").is_file()
    assert any(help_texts.glob("help-*")) and any(help_texts.glob("collect-*"))  # what the next dry runs reuse


def test_the_session_s_first_call_is_k_fac_s_benchmark_with_a_budget_its_plan_fits(tmp_path: Path) -> None:
    """K-FAC's step (issue 44) is the first device call, benchmarks/kfac_gpu.sh as docs/gpu.md prints it, and its
    budget holds its plan with kfac-pytorch carried (the dry run fails on a budget too small)."""
    first = re.search(r"\| 1 \| `bash benchmarks/kfac_gpu.sh --out \$OUT/kfac_gpu --budget (\d+)` \| (\d+) \|",
                      GUIDE.read_text())
    assert first, "docs/gpu.md's first call is benchmarks/kfac_gpu.sh"
    budget, timeout = int(first.group(1)), int(first.group(2))
    assert budget + 20 <= timeout <= 600
    fake = tmp_path / ".kfac-pytorch" / "kfac"
    fake.mkdir(parents=True)
    for name in ("preconditioner.py", "base_preconditioner.py"):  # what the adapter checks for; never imported here
        (fake / name).write_text("")
    printed = []
    for seconds, code in ((budget, 0), (100, 2)):
        result = subprocess.run(["bash", "benchmarks/kfac_gpu.sh", "--out", str(tmp_path / "out"), "--budget",
                                 str(seconds), "--dry-run", "--kfac-pytorch", str(fake.parent)], cwd=REPO,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == code, result.stdout[-1500:] + result.stderr[-1500:]
        printed.append(result.stdout)
    assert "--kfac-method newton" in printed[0] and "kfac-pytorch" in printed[0]


def test_dry_run_fails_on_a_flag_a_tool_does_not_have(tmp_path: Path, help_texts: Path) -> None:
    text = SUITE.read_text()
    assert "--warmup 5" in text
    root = linked_copy(tmp_path, text.replace("--warmup 5", "--warm-up 5"))
    result = dry_run(root, tmp_path / "out", "--run", "A", help_cache=help_texts)
    assert result.returncode != 0
    assert re.search(r"A2 --amp auto.*DRY-RUN FAILED.*--warm-up", (tmp_path / "out" / "summary.txt").read_text())


def test_a_plan_over_its_budget_fails_and_says_so(tmp_path: Path, help_texts: Path) -> None:
    result = dry_run(REPO, tmp_path, "--run", "C", env={"HPCDL_GPU_SUITE_BUDGET": "100"}, help_cache=help_texts)
    assert result.returncode != 0
    assert re.search(r"run C: its steps' limits add up to \d+ s, over its 100 s budget", result.stdout)


def test_a_bad_run_is_one_line() -> None:
    result = subprocess.run(["bash", str(SUITE), "--run", "D"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.strip() == "error: --run takes A, B or C (got 'D')"


def test_each_run_fits_a_device_call_and_the_guide_gives_each_call_room() -> None:
    """A run is under 5 minutes of device time with the machine's start (a minute, first call only); docs/gpu.md's
    timeout_s for it leaves room to hand the files back, inside the tool's 600 s a command, and the next
    session's three calls (K-FAC's benchmark, runs B and C) fit its 15 minutes; run A takes the one after."""
    budgets = {run: int(seconds) for run, seconds in re.findall(r"\[([ABC])\]=(\d+)", SUITE.read_text())}
    guide = GUIDE.read_text()
    calls = {run: int(seconds) for run, seconds in
             re.findall(r"\| (?:\d|next) \| `bash benchmarks/gpu_suite.sh --run ([ABC])` \| (\d+) \|", guide)}
    assert set(budgets) == set(calls) == set("ABC")
    for run, budget in budgets.items():
        assert budget <= 300 and budget + 20 <= calls[run] <= 600, run
    first = re.findall(r"\| \d \| `[^`]+` \| (\d+) \|", guide)
    assert len(first) == 3 and "| next | `bash benchmarks/gpu_suite.sh --run A`" in guide
    assert 60 + sum(int(seconds) for seconds in first) <= 15 * 60


def test_a_real_run_records_each_step_stops_at_its_budget_and_says_what_is_missing(tmp_path: Path) -> None:
    """The real run's bookkeeping, on this CPU machine: no wheelhouse (said in one line), the benchmarks fail
    (no GPU) and are recorded with their logs, the steps past the budget are skipped, and every file the device
    tool hands back is there and readable after the run."""
    out, scratch, empty = tmp_path / "out", tmp_path / "scratch", tmp_path / "whl"
    empty.mkdir()
    env = {**os.environ, "OUT": str(out), "PYTHON": str(REPO / ".venv" / "bin" / "python"), "HPCDL_GPU_SCRATCH":
           str(scratch), "HPCDL_WHEELHOUSE": str(empty), "HPCDL_GPU_SUITE_BUDGET": "12"}  # A4 past it however fast
    result = subprocess.run(["bash", str(SUITE), "--run", "A"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode != 0
    steps = {s["step"]: s["status"] for s in json.loads((out / "summary.json").read_text())["steps"]}
    assert steps["A0 carried wheels"].startswith(f"FAILED: no wheelhouse in {empty}")
    assert steps["A4 loader, nvJPEG vs libjpeg-turbo"] == "skipped (budget spent)"
    failed = [status for status in steps.values() if status.startswith("FAILED rc=")]
    assert failed and all(re.search(r"; logs/\w+\.log\)$", status) for status in failed), failed
    with tarfile.open(out / "results.tar.gz") as tar:
        assert "logs/setup.log" in tar.getnames()
    assert re.search(r"run A: its steps' limits add up to \d+ s, over its 12 s budget", result.stdout)


def test_a_wheel_handed_back_in_parts_joins_into_the_cache_of_its_key(tmp_path: Path) -> None:
    """Run B hands a new Horovod wheel back as 15 MB parts and its key in key.txt (the key's '+' is not a name
    the device tool returns); make_gpu_wheelhouse.sh --add-horovod puts the joined wheel under that key."""
    import zipfile

    wheel = tmp_path / "horovod-0.28.1-cp312-cp312-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("horovod/__init__.py", "x" * 3000)
    files_at = tmp_path / "files" / "horovod"
    files_at.mkdir(parents=True)
    key = "horovod-0.28.1-p1-cp312-torch2.11.0+cu130-gpu-abc"
    (files_at / "key.txt").write_text(key + "\n")
    data = wheel.read_bytes()
    for n, start in enumerate(range(0, len(data), 1000)):
        (files_at / f"{wheel.name}.part-a{chr(ord('a') + n)}").write_bytes(data[start:start + 1000])
    result = subprocess.run(["bash", str(REPO / "benchmarks" / "make_gpu_wheelhouse.sh"), "--add-horovod",
                             str(tmp_path / "files"), str(tmp_path / "whl")], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "whl" / "horovod-cache" / key / wheel.name).read_bytes() == data
