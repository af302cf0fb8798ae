"""hpcdl.rundir: one run per directory, stale locks of dead runs taken over, names that never collide.

The "other run" in these tests is a real second process (a subprocess or a multiprocessing
worker), since the lock must keep separate processes apart, not threads of one.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from hpcdl.persistence import rundir
from hpcdl.runtime.errors import LockHeldError, UsageError
from tests.support.mpi_harness import REPO, error_lines, run_mpi

pytestmark = pytest.mark.processes  # starts processes: not in the fast tier

HOLD = """
import sys, time
from hpcdl.persistence import rundir
run = rundir.claim(sys.argv[1], None, resume=False, heartbeat_seconds=float(sys.argv[2]))
print(run.run_id, flush=True)
sys.stdin.readline()  # hold the directory until told to go
"""


def start_holder(directory: Path, heartbeat: float = 0.2) -> tuple[subprocess.Popen[str], str]:
    """A second process that claims ``directory`` and keeps it until its stdin is closed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(directory), str(heartbeat)],
        cwd=REPO,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    run_id = proc.stdout.readline().strip()
    assert run_id, proc.stderr.read() if proc.stderr else ""
    return proc, run_id


def write_lock(directory: Path, **fields: object) -> Path:
    holder = {
        "run_id": "20260101T000000-elsewhere-1-abcdef",
        "host": socket.gethostname(),
        "pid": 1,
        "started": "2026-01-01T00:00:00+00:00",
        "program": "hpcdl.train",
        "slurm_job_id": "",
        "slurm_restart_count": 0,
        **fields,
    }
    lock = directory / rundir.LOCK_NAME
    lock.write_text(json.dumps(holder))
    return lock


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_second_run_on_a_held_directory_is_refused_naming_the_holder(tmp_path: Path) -> None:
    proc, holder_id = start_holder(tmp_path)
    try:
        with pytest.raises(LockHeldError) as refused:
            rundir.claim(tmp_path, None, resume=False)
        line = str(refused.value)
        assert "\n" not in line
        assert f"is in use by run {holder_id} (host {socket.gethostname()}, pid {proc.pid}, started " in line
        assert "choose another --output-dir" in line
        assert json.loads((tmp_path / rundir.LOCK_NAME).read_text())["run_id"] == holder_id  # untouched
    finally:
        proc.communicate("\n", timeout=30)
    assert proc.returncode == 0
    assert not (tmp_path / rundir.LOCK_NAME).exists()  # released on exit
    with rundir.claim(tmp_path, None, resume=True) as run:  # now free
        assert run.path == tmp_path


def test_resume_of_a_running_run_is_refused_too(tmp_path: Path) -> None:
    proc, holder_id = start_holder(tmp_path)
    try:
        with pytest.raises(LockHeldError, match=rf"in use by run {holder_id} .*--resume continues a run only after"):
            rundir.claim(tmp_path, None, resume=True)
    finally:
        proc.communicate("\n", timeout=30)


def test_lock_of_a_dead_process_on_this_host_is_taken_over_with_one_line(tmp_path: Path, capfd) -> None:
    pid = dead_pid()
    write_lock(tmp_path, pid=pid)
    with rundir.claim(tmp_path, None, resume=True) as run:
        assert json.loads((tmp_path / rundir.LOCK_NAME).read_text())["run_id"] == run.run_id
    err = capfd.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and f"hpcdl.train: taking over {tmp_path} from run 20260101T000000-elsewhere-1-abcdef" in err[0]
    )
    assert f"its process {pid} on {socket.gethostname()} is gone" in err[0]


def test_a_killed_run_leaves_a_lock_the_next_run_takes_over(tmp_path: Path) -> None:
    proc, holder_id = start_holder(tmp_path)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert json.loads((tmp_path / rundir.LOCK_NAME).read_text())["run_id"] == holder_id  # SIGKILL: no clean-up
    with rundir.claim(tmp_path, None, resume=True) as run:
        assert run.run_id != holder_id


def test_lock_from_another_host_is_respected_while_its_heartbeat_is_fresh(tmp_path: Path) -> None:
    write_lock(tmp_path, host="node-that-is-not-here", pid=dead_pid())  # a pid elsewhere says nothing
    with pytest.raises(LockHeldError, match=r"in use by run .* \(host node-that-is-not-here, .*last heartbeat \d+ s ago"):
        rundir.claim(tmp_path, None, resume=True)


def test_lock_from_another_host_with_a_stale_heartbeat_is_taken_over(tmp_path: Path, capfd) -> None:
    lock = write_lock(tmp_path, host="node-that-is-not-here")
    old = time.time() - 2 * rundir.STALE_AFTER_SECONDS
    os.utime(lock, (old, old))
    with rundir.claim(tmp_path, None, resume=True):
        pass
    assert re.search(r"taking over .*: no heartbeat for \d+ s \(stale after 180 s\)", capfd.readouterr().err)


def test_heartbeat_keeps_a_live_lock_fresh(tmp_path: Path) -> None:
    """The holder's heartbeat moves the lock's mtime, so a quiet but live run is never declared stale."""
    proc, _ = start_holder(tmp_path, heartbeat=0.1)
    try:
        lock = tmp_path / rundir.LOCK_NAME
        old = time.time() - 1000
        os.utime(lock, (old, old))
        deadline = time.time() + 20
        while lock.stat().st_mtime < time.time() - 100 and time.time() < deadline:
            time.sleep(0.05)
        assert lock.stat().st_mtime > time.time() - 100
    finally:
        proc.communicate("\n", timeout=30)


def test_requeued_slurm_job_takes_over_its_earlier_incarnation(tmp_path: Path, monkeypatch) -> None:
    """The earlier start's lock is fresh and on a host whose processes cannot be asked: only the job's restart
    count says it is gone. The same job before a requeue is still refused."""
    earlier = "20260101T000000-elsewhere-1-abcdef"
    write_lock(tmp_path, run_id=earlier, host="node-that-is-not-here", slurm_job_id="4242", slurm_restart_count=0)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    with pytest.raises(LockHeldError, match=f"is in use by run {earlier}"):
        rundir.claim(tmp_path, None, resume=True)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with rundir.claim(tmp_path, None, resume=True) as run:
        holder = json.loads((tmp_path / rundir.LOCK_NAME).read_text())
        assert run.run_id != earlier and holder["run_id"] == run.run_id
        assert (holder["host"], holder["slurm_job_id"], holder["slurm_restart_count"]) == (
            socket.gethostname(), "4242", 1)


def test_takeover_removes_only_the_dead_runs_temporaries(tmp_path: Path) -> None:
    dead_id = "20260101T000000-elsewhere-1-abcdef"
    write_lock(tmp_path, run_id=dead_id, pid=dead_pid())
    (tmp_path / "checkpoints").mkdir()
    dead_tmp = tmp_path / "checkpoints" / f".ckpt-000000020.pt.tmp-{dead_id}"
    other_tmp = tmp_path / "checkpoints" / ".ckpt-000000020.pt.tmp-20260101T000000-other-2-123456"
    kept = tmp_path / "checkpoints" / "ckpt-000000010.pt"
    for path in (dead_tmp, other_tmp, kept):
        path.write_bytes(b"x")
    with rundir.claim(tmp_path, None, resume=True):
        pass
    assert not dead_tmp.exists() and other_tmp.exists() and kept.exists()


def test_garbled_lock_counts_as_held_until_its_heartbeat_is_stale(tmp_path: Path) -> None:
    lock = tmp_path / rundir.LOCK_NAME
    lock.write_bytes(b"\x00{half")
    with pytest.raises(LockHeldError, match="lock file .* is unreadable"):
        rundir.claim(tmp_path, None, resume=True)
    old = time.time() - 2 * rundir.STALE_AFTER_SECONDS
    os.utime(lock, (old, old))
    with rundir.claim(tmp_path, None, resume=True):
        pass


def test_unwritable_output_dir_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(UsageError, match=r"output directory .*file/run is not writable \(Not a directory\)"):
        rundir.claim(blocker / "run", None, resume=False)


def test_output_dir_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "run").write_text("")
    with pytest.raises(UsageError, match=r"output directory .*run is a file, not a directory"):
        rundir.claim(tmp_path / "run", None, resume=False)


def test_release_leaves_a_lock_taken_over_by_another_run_alone(tmp_path: Path) -> None:
    run = rundir.claim(tmp_path, None, resume=False, heartbeat_seconds=0.05)
    write_lock(tmp_path, run_id="20260101T000000-thief-9-999999")
    deadline = time.time() + 10
    while run.lost is None and time.time() < deadline:
        time.sleep(0.02)
    assert run.lost is not None and "thief" in run.lost
    run.release()
    assert json.loads((tmp_path / rundir.LOCK_NAME).read_text())["run_id"] == "20260101T000000-thief-9-999999"


def _default_in_the_same_second(args: tuple[str, float]) -> str:
    parent, start = args
    os.chdir(parent)
    while time.time() < start:  # the workers draw their names together
        time.sleep(0.001)
    return str(rundir.default_directory(Path("runs"), now=datetime(2026, 11, 23, 11, 0, 0)))


def test_default_names_never_collide_under_a_burst_of_claims(tmp_path: Path) -> None:
    """16 processes name a run directory in the same second (the timestamp is fixed: a loaded machine could
    otherwise spread them over several seconds and hide a clash)."""
    workers = 16
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers) as pool:
        start = time.time() + 3.0
        paths = pool.map(_default_in_the_same_second, [(str(tmp_path), start)] * workers)
    assert len(set(paths)) == workers
    assert all(re.fullmatch(r"runs/20261123-110000-[0-9a-f]{6}", p) for p in paths), paths
    assert len(list((tmp_path / "runs").iterdir())) == workers


def test_a_claim_without_output_dir_makes_a_new_default_directory(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with rundir.claim(None, None, resume=False) as first, rundir.claim(None, None, resume=False) as second:
        assert first.path != second.path and first.run_id != second.run_id
        assert re.fullmatch(r"runs/\d{8}-\d{6}-[0-9a-f]{6}", str(first.path))
        assert (first.path / rundir.LOCK_NAME).exists()
    assert not (first.path / rundir.LOCK_NAME).exists()


def test_default_name_retries_when_the_name_is_taken(tmp_path: Path, monkeypatch) -> None:
    now = datetime(2026, 11, 23, 10, 0, 0)
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    draws = iter(["aaaaaa", "aaaaaa", "aaaaaa", "bbbbbb"])
    monkeypatch.setattr(rundir, "_random_suffix", lambda: next(draws))
    first = rundir.default_directory(tmp_path, now=now)
    second = rundir.default_directory(tmp_path, now=now)
    assert first.name == "20261123-100000-j777-aaaaaa" and second.name == "20261123-100000-j777-bbbbbb"


class ThreeRanks:
    """Rank 0 of a small world: the others report what they saw (the real collective is tested on
    virtual nodes in tests/cluster/test_multinode.py)."""

    def __init__(self, others: list[tuple[str, bool]]) -> None:
        self.others = others

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1 + len(self.others)

    def bcast(self, value, root: int = 0):
        return value

    def allgather(self, value):
        return [value, *self.others]


def test_a_directory_some_node_cannot_see_is_refused_naming_it_and_removed(tmp_path: Path) -> None:
    comm = ThreeRanks([("node1", True), ("node2", False), ("node2", False)])
    with pytest.raises(UsageError, match=r"^output directory .*/run is not shared by every node: node2 \(ranks 2, 3\) "
                                         r"cannot see .*file system every node mounts") as caught:
        rundir.claim(tmp_path / "run", comm, resume=False, visible_within=0.1)
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "run").exists()  # rank 0 made it empty, and it goes


def test_a_refused_directory_that_existed_keeps_everything_in_it(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    comm = ThreeRanks([("node2", False), ("node3", True)])
    with pytest.raises(UsageError, match=r"node2 \(ranks 1\) cannot see"):
        rundir.claim(tmp_path, comm, resume=True, visible_within=0.1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # no lock left, nothing removed


def test_a_directory_every_rank_sees_is_claimed(tmp_path: Path) -> None:
    with rundir.claim(tmp_path, ThreeRanks([("node1", True), ("node2", True)]), resume=False) as run:
        assert (tmp_path / rundir.LOCK_NAME).exists() and rundir.sees_lock(run, within=0)


def test_a_rank_that_does_not_see_the_lock_says_so_after_its_wait(tmp_path: Path) -> None:
    with rundir.claim(tmp_path, None, resume=False) as run:
        elsewhere = rundir.RunDir(tmp_path / "other", run.run_id, owner=False, heartbeat_seconds=60)
        start = time.monotonic()
        assert not rundir.sees_lock(elsewhere, within=0.6)
        assert time.monotonic() - start >= 0.6


def test_temporary_names_carry_the_run_id() -> None:
    path = rundir.temporary_path(Path("/x/checkpoints/ckpt-000000001.pt"), "20260101T000000-h-1-abcdef")
    assert path == Path("/x/checkpoints/.ckpt-000000001.pt.tmp-20260101T000000-h-1-abcdef")
    assert rundir.run_of_temporary(path) == "20260101T000000-h-1-abcdef"
    assert rundir.run_of_temporary(Path("ckpt-000000001.pt")) is None


CLAIM_JOB = """
import sys
from mpi4py import MPI
from hpcdl.persistence import rundir
from hpcdl.runtime.errors import run_main

def main():
    run = rundir.claim(sys.argv[1], MPI.COMM_WORLD, resume=False)
    ids = MPI.COMM_WORLD.allgather(run.run_id)
    assert len(set(ids)) == 1, ids
    print(f"rank {MPI.COMM_WORLD.Get_rank()} claimed {run.path} as {run.run_id}", flush=True)
    run.release()
run_main(main, "hpcdl.train")
"""


def test_every_rank_gets_the_same_claim_or_the_same_refusal(tmp_path: Path) -> None:
    free = run_mpi(2, ["-c", CLAIM_JOB, str(tmp_path / "free")], timeout=120)
    assert free.returncode == 0, free.stderr[-2000:]
    assert len(re.findall(r"rank [01] claimed ", free.stdout)) == 2
    proc, holder_id = start_holder(tmp_path / "held")
    try:
        held = run_mpi(2, ["-c", CLAIM_JOB, str(tmp_path / "held")], timeout=120)
    finally:
        proc.communicate("\n", timeout=30)
    assert held.returncode == 2, held.stderr[-2000:]
    lines = error_lines(held.stderr)
    assert len(lines) == 1 and f"in use by run {holder_id}" in lines[0], held.stderr
    assert "Traceback" not in held.stderr
