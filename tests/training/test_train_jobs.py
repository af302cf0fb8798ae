"""Whole training jobs under mpirun: accuracy, exact data parallelism, resume, and run outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.backends import BACKENDS, needs_horovod
from tests.support.mpi_harness import run_train
from tests.support.reliability_runs import BASE_FLAGS, BASE_RANKS, STEPS_PER_EPOCH, baseline_run, eval_every_run

pytestmark = pytest.mark.processes  # starts processes: not in the fast tier



def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    newest = sorted((run_dir / "checkpoints").glob("ckpt-*.pt"))[-1]
    return torch.load(newest, map_location="cpu", weights_only=True)["model"]


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float, atol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=rtol, atol=atol), f"{name} differs by {(a[name] - b[name]).abs().max()}"


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> Path:
    """`mpirun -np 4 python -m hpcdl.train` with the defaults (digits)."""
    run_dir = tmp_path_factory.mktemp("default") / "run"
    result = run_train(4, run_dir, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def test_defaults_reach_95_percent_on_4_ranks_with_identical_replicas(default_run: Path) -> None:
    summary = json.loads((default_run / "summary.json").read_text())
    assert summary["world_size"] == 4
    assert summary["final_accuracy"] >= 0.95 and summary["best_accuracy"] >= summary["final_accuracy"]
    assert 0 <= summary["best_accuracy"] <= 1
    assert summary["replicas_identical"] is True
    assert summary["images_per_second"] > 0 and summary["time_to_target_seconds"] is None
    assert summary["config"]["dataset"] == "digits" and summary["epochs"] == summary["config"]["epochs"]


def test_run_directory_holds_metrics_checkpoints_and_tensorboard(default_run: Path) -> None:
    rows = [json.loads(line) for line in (default_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == list(range(1, len(rows) + 1))
    assert {"train_loss", "test_loss", "test_accuracy", "lr", "images_per_second"} <= rows[0].keys()
    assert rows[-1]["test_loss"] < rows[0]["test_loss"]
    checkpoints = list((default_run / "checkpoints").glob("ckpt-*.pt"))
    assert len(checkpoints) == 3  # --keep-checkpoints default
    assert not list((default_run / "checkpoints").glob(".*tmp*"))
    assert list((default_run / "tensorboard").glob("events.out.tfevents.*"))


def test_plot_draws_curves_of_several_runs(default_run: Path, tmp_path: Path) -> None:
    from hpcdl.tools.plot import main as plot_main

    output = tmp_path / "curves.png"
    assert plot_main([str(default_run), str(default_run), "-o", str(output), "--labels", "a", "b"]) == 0
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and output.stat().st_size > 20_000


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_rank_and_two_ranks_take_the_same_steps(backend: str, tmp_path: Path) -> None:
    """Data parallelism is exact: 2 ranks x 32 equals 1 rank x 64 (same seed, same global batch)."""
    common = ["--max-steps", "6", "--warmup-epochs", "0", "--epochs", "1", "--seed", "3", "--backend", backend]
    one = run_train(1, tmp_path / "one", "--batch-size", "64", "--base-lr", "0.04", *common)
    two = run_train(2, tmp_path / "two", "--batch-size", "32", "--base-lr", "0.02", *common)
    assert one.returncode == 0 and two.returncode == 0, one.stderr[-2000:] + two.stderr[-2000:]
    w1, w2 = final_weights(tmp_path / "one"), final_weights(tmp_path / "two")
    assert_close(w1, w2, rtol=1e-5, atol=1e-6)
    initial = torch.load(sorted((tmp_path / "one" / "checkpoints").glob("ckpt-*.pt"))[0], weights_only=True)
    assert initial["global_step"] == 6  # the comparison is after real steps, not of the initial weights


def test_resume_after_a_kill_ends_like_an_uninterrupted_run(tmp_path_factory, tmp_path: Path) -> None:
    """Kill rank 0 during the last epoch (2 of 2); --resume continues from epoch 2 and ends bit-identical to the
    uninterrupted run (the shared reference of tests/support/reliability_runs.py: same ranks and flags)."""
    full = baseline_run(tmp_path_factory)
    cut = tmp_path / "cut"
    killed = run_train(BASE_RANKS, cut, *BASE_FLAGS, env={"HPCDL_FAULT": f"0:{STEPS_PER_EPOCH[BASE_RANKS] + 3}:kill"})
    assert killed.returncode != 0
    assert not (cut / "summary.json").exists()
    resumed = run_train(BASE_RANKS, cut, *BASE_FLAGS, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stdout and "epoch   2/2" in resumed.stdout
    assert "epoch   1/2" not in resumed.stdout
    rows = [json.loads(line) for line in (cut / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2]
    a, b = final_weights(full), final_weights(cut)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_kfac_training_with_accumulation_checkpoints_its_factors(tmp_path: Path) -> None:
    result = run_train(2, tmp_path / "kfac", "--kfac", "--epochs", "3",
                       "--batches-per-allreduce", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "K-FAC" in result.stdout
    summary = json.loads((tmp_path / "kfac" / "summary.json").read_text())
    assert summary["final_accuracy"] > 0.9 and summary["replicas_identical"] is True
    newest = sorted((tmp_path / "kfac" / "checkpoints").glob("ckpt-*.pt"))[-1]
    assert torch.load(newest, weights_only=True)["kfac"] is not None


@needs_horovod
def test_adasum_trains_on_two_ranks(tmp_path: Path) -> None:
    """--use-adasum: Horovod's Adasum optimizer steps inside backward, so the loop must not wrap it in
    skip_synchronize (which it refuses); replicas stay identical and the model learns."""
    job = run_train(2, tmp_path / "adasum", "--use-adasum", "--epochs", "3", "--seed", "0")
    assert job.returncode == 0, job.stderr[-3000:]
    summary = json.loads((tmp_path / "adasum" / "summary.json").read_text())
    assert summary["replicas_identical"] is True
    assert summary["final_accuracy"] > 0.7, summary["final_accuracy"]  # chance is 0.1; 0.875 when written


def test_eval_every_adds_mid_epoch_rows_without_changing_the_training(tmp_path_factory) -> None:
    """--eval-every 5 on 2 ranks x 32 (22 steps an epoch): rows at steps 5, 10, ... labelled with the fractional
    epoch, the epoch's own row still covers the whole epoch, and the weights end bit-identical to a run without
    (both runs shared, tests/support/reliability_runs.py: the same 2 ranks x 2 epochs and seed)."""
    plain, every = baseline_run(tmp_path_factory), eval_every_run(tmp_path_factory)
    rows = [json.loads(line) for line in (every.output_dir / "metrics.jsonl").read_text().splitlines()]
    plain_rows = [json.loads(line) for line in (plain / "metrics.jsonl").read_text().splitlines()]
    assert [r["global_step"] for r in rows] == [5, 10, 15, 20, 22, 25, 30, 35, 40, 44]
    assert [r["epoch"] for r in rows] == [round(s / 22, 4) if s % 22 else s // 22 for s in (5, 10, 15, 20, 22, 25, 30,
                                                                                             35, 40, 44)]
    assert "step 5 (epoch 0.23/2) | train loss" in every.out and "epoch   2/2" in every.out
    ends = [r for r in rows if isinstance(r["epoch"], int)]
    for end, ref in zip(ends, plain_rows, strict=True):  # the epoch's row: the same sums over the whole epoch
        assert end["train_loss"] == pytest.approx(ref["train_loss"], rel=1e-6)
        assert end["test_accuracy"] == ref["test_accuracy"]
    a, b = final_weights(plain), final_weights(every.output_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_target_accuracy_stops_at_an_eval_every_point(tmp_path: Path) -> None:
    run_dir = tmp_path / "target"
    result = run_train(2, run_dir, "--epochs", "5", "--eval-every", "3", "--target-accuracy", "0.5")
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stop_reason"] == "target_accuracy" and summary["time_to_target_seconds"] is not None
    assert summary["global_steps"] % 3 == 0 and summary["global_steps"] < 22  # inside the first epoch
    again = run_train(2, run_dir, "--epochs", "5", "--eval-every", "3", "--target-accuracy", "0.5", "--resume")
    assert again.returncode == 0 and "already finished" in again.stdout, again.stderr[-2000:]
