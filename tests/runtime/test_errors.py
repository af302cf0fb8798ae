"""The error classes, their exit behaviour, the rank-0-then-all helper and the launcher variables, in-process."""

from __future__ import annotations

from typing import Any

import pytest

from hpcdl.runtime import launcher
from hpcdl.runtime.errors import (
    EXIT_CRASH,
    EXIT_USAGE,
    DivergenceError,
    JobError,
    LockHeldError,
    LostRankError,
    StorageError,
    UsageError,
    rank0_then_all,
    run_main,
)


class FakeComm:
    """A communicator as one rank of a larger job sees it: ``bcast`` hands out what rank 0 sent."""

    def __init__(self, rank: int, size: int, from_root: Any = None) -> None:
        self.rank, self.size, self.from_root, self.sent = rank, size, from_root, None

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size

    def bcast(self, value: Any, root: int = 0) -> Any:
        if self.rank == root:
            self.sent = value
            return value
        return self.from_root


@pytest.mark.parametrize("kind", [UsageError, DivergenceError, StorageError, LockHeldError])
def test_every_job_error_is_one_line_on_rank_0_and_exit_2(kind: type[JobError], capsys, monkeypatch) -> None:
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")

    def main() -> int:
        raise kind("what happened")

    with pytest.raises(SystemExit) as exited:
        run_main(main, program="prog")
    assert exited.value.code == EXIT_USAGE == 2
    assert capsys.readouterr().err == "prog: error: what happened\n"


def test_a_job_error_prints_nothing_on_other_ranks(capsys, monkeypatch) -> None:
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    with pytest.raises(SystemExit) as exited:
        run_main(lambda: (_ for _ in ()).throw(StorageError("disk full")), program="prog")
    assert exited.value.code == 2 and capsys.readouterr().err == ""


def test_a_lost_rank_is_one_line_without_traceback_and_ends_the_job(capsys, monkeypatch) -> None:
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.delenv("HPCDL_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as exited:
        run_main(lambda: (_ for _ in ()).throw(LostRankError("another rank of the job is gone")), program="prog")
    err = capsys.readouterr().err
    assert exited.value.code == EXIT_CRASH
    assert err == "prog: rank 1 stops: another rank of the job is gone; aborting the whole job\n"


def test_a_bug_keeps_its_traceback(capsys, monkeypatch) -> None:
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    with pytest.raises(SystemExit) as exited:
        run_main(lambda: (_ for _ in ()).throw(KeyError("x")), program="prog")
    err = capsys.readouterr().err
    assert exited.value.code == EXIT_CRASH
    assert "Traceback" in err and err.endswith("prog: rank 0 failed with KeyError: 'x'; aborting the whole job\n")


def test_a_single_process_tool_names_no_rank_and_no_job(capsys, monkeypatch) -> None:
    from hpcdl.runtime.launcher import LAUNCHED_VARS

    for name in LAUNCHED_VARS:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exited:
        run_main(lambda: (_ for _ in ()).throw(OSError(28, "No space left on device")), program="hpcdl.pack")
    assert exited.value.code == EXIT_CRASH
    assert capsys.readouterr().err == "hpcdl.pack: failed with OSError: [Errno 28] No space left on device\n"


def test_rank0_then_all_runs_on_rank_0_only_and_everyone_gets_the_outcome() -> None:
    calls = []
    root = FakeComm(0, 4)
    assert rank0_then_all(lambda: calls.append("ran") or 7, root) == 7
    assert calls == ["ran"]
    other = FakeComm(2, 4, from_root=root.sent)
    assert rank0_then_all(lambda: calls.append("ran on 2"), other) == 7
    assert calls == ["ran"]  # rank 2 never tried


def test_rank0_then_all_raises_rank_0s_error_of_the_same_class_everywhere() -> None:
    root = FakeComm(0, 2)
    with pytest.raises(LockHeldError, match="in use by run r1"):
        rank0_then_all(lambda: (_ for _ in ()).throw(LockHeldError("in use by run r1")), root)
    with pytest.raises(LockHeldError, match="in use by run r1"):
        rank0_then_all(lambda: None, FakeComm(1, 2, from_root=root.sent))


def test_rank0_then_all_alone_and_a_bug_is_not_broadcast() -> None:
    assert rank0_then_all(lambda: "x", None) == "x"
    with pytest.raises(ZeroDivisionError):  # not a JobError: the crash path ends the job, not a broadcast
        rank0_then_all(lambda: 1 / 0, FakeComm(0, 1))


def test_launcher_variables_in_their_order() -> None:
    assert launcher.first_number(launcher.RANK_VARS, {"SLURM_PROCID": "5", "OMPI_COMM_WORLD_RANK": "2"}) == 2
    assert launcher.first_number(launcher.RANK_VARS, {"PMIX_RANK": " 3 "}) == 3
    assert launcher.first_number(launcher.RANK_VARS, {"PMIX_RANK": "x"}) is None
    assert launcher.local_size_from_env({"MPI_LOCALNRANKS": "2"}) == 2
    assert not launcher.launched({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"})  # an sbatch script, not a rank
    assert launcher.launched({"PMI_RANK": "0"}) and launcher.launched({"SLURM_STEP_NUM_TASKS": "2"})


def test_current_rank_reads_the_launcher_before_mpi(monkeypatch) -> None:
    for name in launcher.RANK_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "6")
    assert launcher.current_rank() == 6
    monkeypatch.delenv("SLURM_PROCID")
    assert launcher.current_rank() == 0
