"""The accuracy studies (kfac_large_batch.py, kfac_convergence.py) keep what they ran (issue 38, kinds 2, 3, 5).

Each test runs a real study of tiny hpcdl.train runs on the embedded digits data: stopped by a real signal
while its second run trains, it has saved the first, ends in one line with 128 + the signal's number, leaves
no training process and no scratch folder; ``--keep`` then runs only the rest, and refuses in one line a
recorded run whose command is not the one the study would run now (a ``--max-steps`` trial is not the study).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcdl.runtime.processes import descendants

pytestmark = [pytest.mark.processes, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
# Two runs of about the same length each (20 digits epochs); the study is stopped while the second trains.
LARGE_BATCH = [str(REPO / "benchmarks" / "kfac_large_batch.py"), "--reduced", "--dataset", "digits", "--model",
               "digits_cnn", "--batches", "32", "64", "--methods", "sgd", "--epochs", "20", "--jobs", "1"]
CONVERGENCE = [str(REPO / "benchmarks" / "kfac_convergence.py"), "--epochs", "20", "--seeds", "0", "--sgd-lrs",
               "0.05", "0.1", "--kfac", "--target", "0.5"]


def study_env(tmp_path: Path) -> dict[str, str]:
    """The study's scratch folder goes under ``tmp_path/scratch`` (TMPDIR), so that the test sees it removed."""
    (tmp_path / "scratch").mkdir(exist_ok=True)
    return dict(os.environ, PYTHONPATH=str(REPO), TMPDIR=str(tmp_path / "scratch"), OMP_NUM_THREADS="1")


def training_processes(pid: int) -> list[int]:
    found = []
    for child in descendants(pid):
        try:
            if b"hpcdl.train" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
        except OSError:
            continue
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop_during_the_second_run(command: list[str], results: Path, tmp_path: Path,
                               sig: signal.Signals) -> tuple[subprocess.CompletedProcess[str], list[int]]:
    """Start the study, wait until the first run is saved and the second trains, send ``sig``; its result and the
    training processes it had then."""
    proc = subprocess.Popen([sys.executable, *command], cwd=tmp_path, env=study_env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline, running = time.monotonic() + 600, []
        while time.monotonic() < deadline and proc.poll() is None:
            saved = results.exists() and len(runs_in(results)) == 1
            running = training_processes(proc.pid) if saved else []
            if running:
                break
            time.sleep(0.2)
        assert running, f"the second run never started: rc={proc.poll()}"
        time.sleep(1.0)  # well inside the run
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return subprocess.CompletedProcess(command, proc.returncode, out, err), running


def runs_in(results: Path) -> list[dict]:
    data = json.loads(results.read_text())
    if "runs" in data:  # kfac_large_batch
        return data["runs"]
    return [run for setting in data["settings"].values() for run in setting["runs"]]  # kfac_convergence


def assert_stopped_in_one_line(done: subprocess.CompletedProcess[str], sig: signal.Signals, program: str,
                               running: list[int], tmp_path: Path) -> None:
    assert done.returncode == 128 + sig, (done.returncode, done.stderr[-2000:])
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{program}: stopped by {sig.name}: 1 finished run(s) saved in"), \
        done.stderr[-2000:]
    assert "Traceback" not in done.stderr + done.stdout
    deadline = time.monotonic() + 2  # the study waited for them: only their reaping may lag (a run takes far longer)
    while time.monotonic() < deadline and any(alive(pid) for pid in running):
        time.sleep(0.1)
    assert not any(alive(pid) for pid in running), "a training run outlived its study"
    assert scratch_folders(tmp_path, program) == [], "the study left its scratch folder"


def scratch_folders(tmp_path: Path, program: str) -> list[Path]:
    """The study's own scratch folders left in its TMPDIR (torch's caches there are not the study's)."""
    return [p for p in (tmp_path / "scratch").iterdir() if p.name.startswith(f"{program}-")]


def run_study(command: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *command], cwd=tmp_path, env=study_env(tmp_path), capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize(("command", "program", "sig"), [
    (LARGE_BATCH, "kfac_large_batch", signal.SIGTERM),
    (CONVERGENCE, "kfac_convergence", signal.SIGINT),
], ids=["kfac_large_batch-SIGTERM", "kfac_convergence-Ctrl-C"])
def test_a_stopped_study_keeps_its_runs_and_keep_runs_only_the_rest(tmp_path: Path, command: list[str],
                                                                   program: str, sig: signal.Signals) -> None:
    stem = tmp_path / "out" / "study-lr0.05"  # a name with a dot: one file, whatever the writer
    results = tmp_path / "out" / "study-lr0.05.json"
    study = [*command, "--out", str(stem)]
    done, running = stop_during_the_second_run(study, results, tmp_path, sig)
    assert_stopped_in_one_line(done, sig, program, running, tmp_path)
    (first,) = runs_in(results)
    assert first["returncode"] == 0

    again = run_study(study, tmp_path)  # the same command without --keep or --force: refused, nothing touched
    assert again.returncode == 2 and "study-lr0.05.json already exists" in again.stderr, again.stderr[-2000:]
    assert runs_in(results) == [first]

    trial = run_study([*study, "--keep", "--epochs", "19"], tmp_path)  # not the study that ran: refused
    assert trial.returncode == 2, trial.stdout[-2000:] + trial.stderr[-2000:]
    (line,) = [line for line in trial.stderr.splitlines() if line.strip()]
    assert "--keep: " in line and "--epochs 20, now 19" in line, line
    assert runs_in(results) == [first]

    resumed = run_study([*study, "--keep"], tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    runs = runs_in(results)
    assert len(runs) == 2 and runs[0] == first and runs[1]["returncode"] == 0
    assert scratch_folders(tmp_path, program) == []


def test_a_failed_run_is_recorded_as_failed_and_the_study_goes_on(tmp_path: Path) -> None:
    """Every run raises at step 2 (HPCDL_FAULT reaches them): both are recorded with their error, the file is
    written, the study exits 1 without a traceback (it used to end at the first in a RuntimeError, saving
    nothing)."""
    stem = tmp_path / "failing"
    command = [*CONVERGENCE, "--epochs", "1", "--out", str(stem)]
    done = subprocess.run([sys.executable, *command], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=dict(study_env(tmp_path), HPCDL_FAULT="0:2:exception"))
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "2 run(s) FAILED" in done.stdout, done.stdout[-2000:]
    runs = runs_in(tmp_path / "failing.json")
    assert len(runs) == 2 and all(r["failed"] and "injected fault" in r["error"] for r in runs)


def test_a_virtual_cluster_that_does_not_exist_is_refused_before_the_first_run(tmp_path: Path) -> None:
    stem = tmp_path / "never"
    done = run_study([*LARGE_BATCH, "--ranks", "2", "--vcluster", "nosuch", "--out", str(stem)], tmp_path)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    (line,) = [line for line in done.stderr.splitlines() if line.strip()]
    assert line.startswith("kfac_large_batch: error: launch/mpirun.sh refuses --vcluster nosuch") and "nosuch" in line
    assert "runs," not in done.stdout and not (tmp_path / "never.json").exists()
