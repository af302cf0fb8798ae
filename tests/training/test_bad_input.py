"""The bad-input catalogue of docs/reliability.md, one job test per row, under ``mpirun -np 2``.

The contract for input a user can fix: exactly one ``hpcdl.train: error: ...`` line (rank 0's),
exit status 2, no traceback, no MPI_Abort, no hang. A few rows are not errors (a checkpoint from
another world size must work; resuming a finished run is a no-op) and a few are found by one
rank only in the middle of training (a corrupt image): those end the whole job naming the rank
and the file. Rows about interrupted or truncated checkpoints are in tests/runtime/test_reliability.py.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpcdl.training.schedule import LRSchedule
from tests.support.backends import BACKENDS, needs_horovod
from tests.support.data_files import write_cifar10, write_imagenet
from tests.support.mpi_harness import run_mpi
from tests.support.reliability_runs import (
    BASE_FLAGS,
    Job,
    assert_usage_error,
    baseline_run,
    checkpoint_steps,
    copy_run,
    load_checkpoint,
    run_job,
    same_weights,
)

pytestmark = pytest.mark.processes  # starts processes: not in the fast tier


RANKS = 2
SHORT = ("--epochs", "1", "--max-steps", "2")


def bad_run(tmp_path: Path, *flags: str, fault: str | None = None, timeout: float = 120) -> Job:
    return run_job(RANKS, tmp_path / "run", *flags, fault=fault, timeout=timeout)


# ------------------------------------------------------------------ flags (rejected before MPI starts)

FLAG_ROWS = {
    "zero batch size": (["--batch-size", "0"], "--batch-size must be >= 1 (got 0)"),
    "misspelt flag": (["--bach-size", "8"], "unrecognized arguments: --bach-size 8"),
    "not a number": (["--base-lr", "fast"], "argument --base-lr: invalid float value: 'fast'"),
    "unknown dataset": (["--dataset", "mnits"], "argument --dataset: invalid choice: 'mnits'"),
    "percent for a fraction": (["--target-accuracy", "95"], "--target-accuracy must be a fraction in (0, 1] (got 95.0)"),
    "decreasing lr milestones": (["--lr-decay", "75", "35"], "--lr-decay takes strictly increasing epoch numbers"),
    "negative stall timeout": (["--stall-timeout", "-1"], "--stall-timeout must be >= 0 (got -1.0)"),
    "keep no checkpoints": (["--keep-checkpoints", "0"], "--keep-checkpoints must be >= 1 (got 0)"),
    "not-a-number learning rate": (["--base-lr", "nan"], "--base-lr must be > 0 (got nan)"),
    "seed beyond the generator's range": (["--seed", str(2**63)],
                                          f"argument --seed: must be an integer in [0, 2**63 - 1] (got {2**63})"),
    "negative seed": (["--seed", "-1"], "argument --seed: must be an integer in [0, 2**63 - 1] (got -1)"),
    "large-batch preset with a warm-up ramp": (["--kfac-preset", "large-batch", "--warmup-start-factor", "0.1"],
                                               "--kfac-preset large-batch holds the peak rate through the warm-up: "
                                               "--warmup-start-factor 0.1 would ramp it"),
    "large-batch preset with K-FAC off": (["--kfac-preset", "large-batch", "--no-kfac"],
                                          "--kfac-preset large-batch is a K-FAC recipe (its momentum 0.5 is for "
                                          "preconditioned steps) and K-FAC is turned off"),
    "bf16 factor sums under Horovod": (["--kfac", "--kfac-factor-precision", "bf16", "--backend", "horovod"],
                                       "--kfac-factor-precision bf16 needs --backend torch: Horovod 0.28 cannot sum "
                                       "bfloat16"),
}


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("row", FLAG_ROWS)
def test_bad_flag(row: str, rank: int, monkeypatch, capsys) -> None:
    """Flags are checked before MPI starts, identically on every rank, so each row runs in-process
    as rank 0 and as rank 1 (the launcher's variable says which); the next test runs one under mpirun."""
    from hpcdl.runtime.errors import run_main
    from hpcdl.training.train import main

    flags, message = FLAG_ROWS[row]
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", str(rank))
    with pytest.raises(SystemExit) as exited:
        run_main(lambda: main(flags), program="hpcdl.train")
    printed = capsys.readouterr()
    assert exited.value.code == 2
    assert printed.out == ""
    if rank == 0:
        assert printed.err.startswith("hpcdl.train: error: ") and printed.err.count("\n") == 1, printed.err
        assert message in printed.err
    else:
        assert printed.err == ""


def test_bad_flag_under_mpirun(tmp_path: Path) -> None:
    assert_usage_error(bad_run(tmp_path, "--batch-size", "0"), "--batch-size must be >= 1 (got 0)")


def test_resume_without_output_dir(tmp_path: Path) -> None:
    result = run_mpi(RANKS, ["-m", "hpcdl.train", "--resume", "--no-progress"], timeout=120, env={"HPCDL_FAULT": ""},
                     cwd=tmp_path)
    job = Job(result, 0.0, 0.0, tmp_path)
    assert_usage_error(job, "--resume needs --output-dir")
    assert not (tmp_path / "runs").exists()  # and it did not start a fresh run somewhere


def test_the_largest_seed_trains(tmp_path: Path) -> None:
    """The range the check names is the generators' own: its top value trains (data order, augmentation, init)."""
    job = bad_run(tmp_path, "--seed", str(2**63 - 1), *SHORT)
    assert job.rc == 0, job.tail()
    assert checkpoint_steps(tmp_path / "run") == [2]


def test_a_grad_worker_fraction_that_does_not_divide_the_world(tmp_path: Path) -> None:
    job = run_job(3, tmp_path / "run", "--kfac", "--kfac-grad-worker-fraction", "0.5", *SHORT)
    assert_usage_error(job, "--kfac-grad-worker-fraction 0.5 gives 1.5 gradient workers per layer on 3 ranks",
                       "on 3 ranks use one of 1/3, 1")
    assert not (tmp_path / "run" / "checkpoints").exists() or not checkpoint_steps(tmp_path / "run")


def test_a_resume_onto_a_world_the_grad_worker_fraction_does_not_divide(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    flags = ("--kfac", "--kfac-grad-worker-fraction", "0.5", "--epochs", "1")
    first = run_job(RANKS, run_dir, *flags, "--max-steps", "2")
    assert first.rc == 0, first.tail()
    job = run_job(3, run_dir, *flags, "--max-steps", "4", "--resume")
    assert_usage_error(job, "--kfac-grad-worker-fraction 0.5 gives 1.5 gradient workers per layer on 3 ranks")
    assert checkpoint_steps(run_dir) == [2]


def test_a_launcher_whose_mpi_is_not_ours_is_one_line_not_n_runs(tmp_path: Path) -> None:
    """Two tasks that a launcher of another MPI started (MVAPICH's variables, which Open MPI ignores): each
    initialises MPI alone. Without the check each would train as rank 0 of 1, N copies of one run; with it
    the launcher's rank 0 prints one line, every task exits 2, and nothing is written."""
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_", "SLURM_"))}
        env.update(MV2_COMM_WORLD_SIZE="2", MV2_COMM_WORLD_RANK=str(rank), MV2_COMM_WORLD_LOCAL_RANK=str(rank),
                   OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", HPCDL_FAULT="")
        procs.append(subprocess.Popen([sys.executable, "-m", "hpcdl.train", "--output-dir", str(tmp_path / f"run{rank}"),
                                       "--no-progress", *SHORT], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=180)
        finally:
            proc.kill()
        results.append((proc.returncode, out, err))
    assert [rc for rc, _, _ in results] == [2, 2], results
    lines = [line for _, out, err in results for line in (out + err).splitlines() if line.strip()]
    assert lines == ["hpcdl.train: error: the launcher started 2 tasks (MV2_COMM_WORLD_SIZE) but MPI sees a world "
                     "of 1: every rank runs alone; launch with the MPI that mpi4py and Horovod were built against "
                     "(srun needs --mpi=pmix for Open MPI; an image's MPI must be of the host launcher's family)"]
    assert not any((tmp_path / f"run{rank}" / "checkpoints").exists() for rank in range(2))


# ------------------------------------------------------------------ model, fault switch, run size

def test_unknown_model(tmp_path: Path) -> None:
    job = bad_run(tmp_path, "--dataset", "synthetic", "--model", "resnet33", *SHORT)
    assert_usage_error(job, "unknown model 'resnet33'")


def test_fault_switch_naming_a_rank_outside_the_job(tmp_path: Path) -> None:
    assert_usage_error(bad_run(tmp_path, *SHORT, fault="7:5:kill"), "HPCDL_FAULT names rank 7 but the job has 2 rank(s)")


def test_malformed_fault_switch_is_a_usage_error(monkeypatch) -> None:
    """The same path in-process (tests/runtime/test_faults.py has every malformed form)."""
    from hpcdl.runtime.errors import UsageError
    from hpcdl.runtime.faults import FaultInjector

    monkeypatch.setenv("HPCDL_FAULT", "1:five:kill")
    with pytest.raises(UsageError, match=r"HPCDL_FAULT entry '1:five:kill' is not RANK:STEP:KIND"):
        FaultInjector(0, world_size=2)


def test_more_ranks_than_samples(tmp_path: Path) -> None:
    job = bad_run(tmp_path, "--dataset", "synthetic", "--synthetic-size", "48", "--batch-size", "32", *SHORT)
    assert_usage_error(job, "48 training samples cannot give 2 ranks a batch of 32 each")


@needs_horovod
def test_adasum_on_a_world_size_that_is_not_a_power_of_two(tmp_path: Path) -> None:
    job = run_job(3, tmp_path / "run", "--use-adasum", *SHORT, timeout=120)
    assert_usage_error(job, "--use-adasum needs a power-of-two number of ranks (Horovod's Adasum), got 3")


def test_adasum_with_kfac(tmp_path: Path) -> None:
    job = bad_run(tmp_path, "--use-adasum", "--kfac", *SHORT)
    assert_usage_error(job, "--use-adasum cannot be combined with --kfac")


def test_diverging_learning_rate_stops_with_a_clear_message(tmp_path: Path) -> None:
    """A learning rate far too high: the loss overflows, updates are skipped, then the run stops."""
    job = bad_run(tmp_path, "--base-lr", "1e6", "--warmup-epochs", "0", "--epochs", "1")
    line = assert_usage_error(job, "non-finite for 5 consecutive steps", "lower --base-lr")
    assert "non-finite gradients, update skipped" in job.out
    assert checkpoint_steps(tmp_path / "run") == []  # nothing non-finite was saved
    assert "Checkpoints were not overwritten" in line


# ------------------------------------------------------------------ data

def test_cifar10_without_data_dir(tmp_path: Path) -> None:
    assert_usage_error(bad_run(tmp_path, "--dataset", "cifar10", *SHORT), "--dataset cifar10 needs --data-dir")


def test_missing_data_dir(tmp_path: Path) -> None:
    job = bad_run(tmp_path, "--dataset", "cifar10", "--data-dir", str(tmp_path / "nowhere"), *SHORT)
    assert_usage_error(job, f"--data-dir {tmp_path / 'nowhere'} does not exist")


def test_data_dir_is_the_unextracted_archive(tmp_path: Path) -> None:
    archive = tmp_path / "cifar-10-python.tar.gz"
    archive.write_bytes(gzip.compress(b"not extracted"))
    job = bad_run(tmp_path, "--dataset", "cifar10", "--data-dir", str(archive), *SHORT)
    assert_usage_error(job, f"--data-dir {archive} is a file, not a folder")


def test_cifar10_file_missing(tmp_path: Path) -> None:
    folder = write_cifar10(tmp_path / "data")
    (folder / "data_batch_3").unlink()
    job = bad_run(tmp_path, "--dataset", "cifar10", "--data-dir", str(folder), *SHORT)
    assert_usage_error(job, f"CIFAR-10 file {folder / 'data_batch_3'} is missing")


def test_cifar10_file_corrupted(tmp_path: Path) -> None:
    folder = write_cifar10(tmp_path / "data")
    batch = folder / "data_batch_2"
    batch.write_bytes(batch.read_bytes()[: batch.stat().st_size // 2])  # a copy cut short
    job = bad_run(tmp_path, "--dataset", "cifar10", "--data-dir", str(folder), *SHORT)
    assert_usage_error(job, f"CIFAR-10 file {batch} is unreadable or malformed")


def test_imagenet_without_val(tmp_path: Path) -> None:
    root = write_imagenet(tmp_path / "imagenet")
    shutil.rmtree(root / "val")
    job = bad_run(tmp_path, "--dataset", "imagenet", "--data-dir", str(root), *SHORT)
    assert_usage_error(job, "no val/ folder of class subfolders")


def test_imagenet_corrupt_image_ends_the_job_naming_the_rank(tmp_path: Path) -> None:
    """Found by one rank only, in the middle of an epoch: it names itself and the error and ends the job."""
    root = write_imagenet(tmp_path / "imagenet", classes=3, per_class=4)
    broken = root / "train" / "n00000001" / "img_2.JPEG"
    broken.write_bytes(broken.read_bytes()[:200])  # a copy cut short
    # 12 training images, 2 ranks x batch 6: the first step reads every image, so exactly one rank meets it.
    job = bad_run(tmp_path, "--dataset", "imagenet", "--data-dir", str(root), "--model", "digits_cnn",
                  "--batch-size", "6", "--test-batch-size", "6", "--workers", "0", "--epochs", "1")
    assert job.rc != 0, job.tail()
    lines = [line for line in job.err.splitlines() if "failed with" in line]
    assert len(lines) == 1, job.tail()
    assert lines[0].startswith(("hpcdl.train: rank 0 failed with OSError: ", "hpcdl.train: rank 1 failed with OSError: "))
    assert "truncated" in lines[0].lower() and lines[0].endswith("aborting the whole job")
    assert f"cannot decode image {broken}" in lines[0]  # the line names the file to replace
    assert "Traceback" not in job.err  # an I/O error, not a bug: the line is the whole story


# ------------------------------------------------------------------ the output directory

def test_unwritable_output_dir_read_only_directory(tmp_path: Path) -> None:
    """A directory nobody may write, root included (the immutable attribute)."""
    locked = tmp_path / "locked"
    locked.mkdir()
    if subprocess.run(["chattr", "+i", str(locked)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not supported on this file system (the next test covers the row)")
    try:
        job = run_job(RANKS, locked / "run", *SHORT)
    finally:
        subprocess.run(["chattr", "-i", str(locked)], check=True)
    assert_usage_error(job, f"output directory {locked / 'run'} is not writable (Operation not permitted)")


def test_unwritable_output_dir_under_a_file(tmp_path: Path) -> None:
    (tmp_path / "results").write_text("a file where a folder should be")
    job = run_job(RANKS, tmp_path / "results" / "run", *SHORT)
    assert_usage_error(job, f"output directory {tmp_path / 'results' / 'run'} is not writable (Not a directory)")


def test_output_dir_of_another_run_without_resume(tmp_path_factory, tmp_path: Path) -> None:
    run_dir = copy_run(baseline_run(tmp_path_factory), tmp_path / "run")
    before = {p.name: p.read_bytes() for p in (run_dir / "checkpoints").iterdir()}
    job = run_job(RANKS, run_dir, *BASE_FLAGS)
    assert_usage_error(job, "already holds checkpoints of an earlier run: add --resume to continue it")
    assert {p.name: p.read_bytes() for p in (run_dir / "checkpoints").iterdir()} == before


@pytest.mark.parametrize("backend", BACKENDS)
def test_disk_full_while_writing_a_checkpoint(backend: str, tmp_path: Path) -> None:
    """A real full disk: a 2 MiB tmpfs holds the first checkpoint (1.2 MB) but not the second (rank 0's failed
    write is agreed over MPI under either backend)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root and mount rights)")
    try:
        job = run_job(RANKS, mount / "run", *BASE_FLAGS, "--backend", backend)
        steps = checkpoint_steps(mount / "run")
        leftovers = [p.name for p in (mount / "run" / "checkpoints").iterdir() if p.name.startswith(".")]
        first = load_checkpoint(mount / "run", 22) if steps else None
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
    assert_usage_error(job, "could not write the checkpoint of step 44", "No space left on device",
                       "the earlier checkpoints are intact")
    assert steps == [22] and first is not None and first["global_step"] == 22
    assert leftovers == []  # the half-written temporary file was removed


# ------------------------------------------------------------------ resuming

def test_resume_checkpoint_of_another_model(tmp_path_factory, tmp_path: Path) -> None:
    run_dir = copy_run(baseline_run(tmp_path_factory), tmp_path / "run")
    job = run_job(RANKS, run_dir, "--resume", "--model", "resnet20", "--epochs", "3")
    assert_usage_error(job, "cannot resume: the checkpoint was trained with --model digits_cnn (checkpoint) vs "
                            "resnet20 (now)")
    assert checkpoint_steps(run_dir) == [22, 44]


def test_resume_checkpoint_from_another_world_size_works(tmp_path_factory, tmp_path: Path) -> None:
    """Written by 2 ranks, continued by 4: it must work, with the learning rate scaled for 4 ranks."""
    run_dir = copy_run(baseline_run(tmp_path_factory), tmp_path / "run")
    job = run_job(4, run_dir, "--resume", "--epochs", "3", "--seed", "11", timeout=240)
    assert job.rc == 0, job.tail()
    assert "checkpoint was written by 2 rank(s) with global batch 64, resuming on 4 with global batch 128" in job.out
    assert "lr 0.02 -> 0.08" in job.out  # base lr x 4 ranks
    assert checkpoint_steps(run_dir) == [22, 44, 55]  # epoch 3 took 11 steps of 4 x 32
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    schedule = LRSchedule(0.02, 0.08, 1.0, 3, "cosine", [])  # the preset: 1 warm-up epoch, then cosine
    assert rows[-1]["lr"] == pytest.approx(schedule(2 + 10 / 11))  # the lr of epoch 3's last step on 4 ranks
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 4


def test_resume_with_no_checkpoint_starts_from_scratch(tmp_path: Path) -> None:
    job = run_job(RANKS, tmp_path / "run", "--resume", *SHORT)
    assert job.rc == 0, job.tail()
    assert "no checkpoint to resume from: starting from scratch" in job.out
    assert checkpoint_steps(tmp_path / "run") == [2]


def test_resume_when_no_checkpoint_is_readable(tmp_path_factory, tmp_path: Path) -> None:
    run_dir = copy_run(baseline_run(tmp_path_factory), tmp_path / "run")
    for path in (run_dir / "checkpoints").glob("ckpt-*.pt"):
        path.write_bytes(path.read_bytes()[:1000])
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    job = run_job(RANKS, run_dir, "--resume", *BASE_FLAGS)
    assert_usage_error(job, "none of the 2 checkpoint(s)", "is readable", "move them away to start from scratch")
    assert "skipping checkpoint: ckpt-000000044.pt is unreadable" in job.err
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before  # nothing renamed or deleted


def test_resume_a_finished_run_changes_nothing(tmp_path_factory, tmp_path: Path) -> None:
    run_dir = copy_run(baseline_run(tmp_path_factory), tmp_path / "run")
    summary = (run_dir / "summary.json").read_text()
    job = run_job(RANKS, run_dir, "--resume", *BASE_FLAGS)
    assert job.rc == 0, job.tail()
    assert "already finished (stopped by epochs after 2 epoch(s)); nothing to do" in job.out
    assert (run_dir / "summary.json").read_text() == summary
    assert checkpoint_steps(run_dir) == [22, 44]
    assert same_weights(load_checkpoint(run_dir, 44)["model"],
                        load_checkpoint(baseline_run(tmp_path_factory), 44)["model"])


# ------------------------------------------------------------------ every rank exits by itself

@pytest.mark.mpi(min_size=2)
def test_usage_error_makes_every_rank_exit_2_by_itself() -> None:
    """In-process, on every rank of the pytest-mpi job: run_main turns a UsageError raised on all
    ranks into exit status 2 on each (no MPI_Abort), and only rank 0 prints."""
    import contextlib
    import io

    from hpcdl.runtime.errors import UsageError, run_main
    from tests.support.mpi_harness import assert_all_ranks

    def main() -> int:
        raise UsageError("a bad flag")

    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as exited:
        run_main(main, program="probe")
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    printed = stderr.getvalue()
    expected = "probe: error: a bad flag\n" if rank == 0 else ""
    assert_all_ranks(exited.value.code == 2 and printed == expected, f"exit {exited.value.code}, printed {printed!r}")



# ------------------------------------------------------------------ the catalogue itself

def test_every_catalogue_row_names_a_test_that_exists() -> None:
    """docs/reliability.md's two tables: each row names at least one test, and each named test exists."""
    repo = Path(__file__).resolve().parents[2]
    text = (repo / "docs" / "reliability.md").read_text()
    rows = [line for line in text.splitlines()
            if line.startswith("| ") and not line.startswith(("| Failure |", "| Input |", "| Kind |"))]
    rows = [row for row in rows if row.count("|") >= 5]  # the two catalogue tables, not the fault kinds
    assert len(rows) >= 40, len(rows)
    for row in rows:
        refs = re.findall(r"`((?:test_\w+\.py::)?test_\w+(?:\[[^\]]*\])?)`", row.rstrip(" |").rsplit("|", 1)[1])
        assert refs, f"no test named in: {row}"
        for ref in refs:
            file, _, name = ref.rpartition("::")
            found = list((repo / "tests").rglob(file or "test_bad_input.py"))
            assert len(found) == 1, f"{ref}: {len(found)} files named {file}"
            source = found[0].read_text()
            function, _, param = name.partition("[")
            assert f"def {function}(" in source, f"{ref} does not exist"
            for part in param.rstrip("]").split("-"):
                assert part in ("", "*") or part in source, f"{ref}: no parametrization {part!r}"
