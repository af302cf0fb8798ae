"""benchmarks/kfac_convergence.py: each run is python -m hpcdl.train with the intended flags; time to
target, the paired verdict, the run order, refusals.

The full study takes minutes to hours; these check its bookkeeping on synthetic accuracy curves, whose
right answers are worked out by hand below, and run one tiny study on the digits end to end.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.scripts import load_benchmark

pytestmark = pytest.mark.processes  # starts processes: not in the fast tier


REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "kfac_convergence.py"


@pytest.fixture(scope="module")
def study() -> Any:
    return load_benchmark("kfac_convergence")


def curve(accuracies: list[float], seconds_per_point: float, evals_per_epoch: int = 4) -> list[dict[str, float]]:
    return [
        {
            "epoch": (i + 1) / evals_per_epoch,
            "accuracy": a,
            "seconds": (i + 1) * seconds_per_point,
        }
        for i, a in enumerate(accuracies)
    ]


def test_first_point_at_or_above_the_target_counts_even_if_accuracy_dips_later(study: Any) -> None:
    points = curve([0.97, 0.985, 0.990, 0.989, 0.992], 2.0)
    hit = study.first_reaching(points, 0.99)
    assert hit is not None and (hit["epoch"], hit["seconds"]) == (0.75, 6.0)  # exactly equal counts as reached
    assert study.first_reaching(points, 0.995) is None


def test_median_counts_a_run_that_never_reached_the_target_as_infinite(study: Any) -> None:
    assert study.median_or_inf([3.0, None, 1.0]) == 3.0
    assert study.median_or_inf([None, None, 1.0]) == math.inf


def run(seed: int, accuracies: list[float], seconds_per_point: float, target: float = 0.99) -> dict[str, Any]:
    points = curve(accuracies, seconds_per_point)
    hit = next((p for p in points if p["accuracy"] >= target), None)
    return {
        "seed": seed,
        "points": points,
        "epochs_to_target": hit and hit["epoch"],
        "seconds_to_target": hit and hit["seconds"],
        "final_accuracy": accuracies[-1],
        "train_seconds": points[-1]["seconds"],
    }


def test_verdict_pairs_the_best_of_each_kind_seed_by_seed(study: Any) -> None:
    # SGD lr=0.1 reaches 99% at epoch 1.0 (4 points x 2 s = 8 s) in every seed; lr=0.05 later (12 s).
    # K-FAC costs 1.5x per point (3 s) and reaches it at epoch 0.5 (6 s) in seeds 0 and 1, 0.75 (9 s) in seed 2.
    sgd_fast = [run(s, [0.97, 0.98, 0.985, 0.99, 0.991, 0.992], 2.0) for s in range(3)]
    sgd_slow = [run(s, [0.96, 0.97, 0.98, 0.985, 0.988, 0.99], 2.0) for s in range(3)]
    kfac = [
        run(0, [0.98, 0.99, 0.99, 0.991, 0.992, 0.993], 3.0),
        run(1, [0.98, 0.99, 0.99, 0.99, 0.99, 0.99], 3.0),
        run(2, [0.98, 0.985, 0.99, 0.99, 0.99, 0.99], 3.0),
    ]
    settings = {}
    for name, runs, kfac_flag in (
        ("SGD lr=0.05", sgd_slow, False),
        ("SGD lr=0.1", sgd_fast, False),
        ("K-FAC", kfac, True),
    ):
        settings[name] = {"kfac": kfac_flag, **study.summarise(runs), "runs": runs}
    assert (
        settings["SGD lr=0.1"]["median_seconds_to_target"] == 8.0
        and settings["SGD lr=0.05"]["median_seconds_to_target"] == 12.0
    )
    assert settings["K-FAC"]["median_epochs_to_target"] == 0.5 and settings["K-FAC"]["median_seconds_to_target"] == 6.0
    v = study.verdict(settings)
    assert (v["best_sgd"], v["best_kfac"]) == ("SGD lr=0.1", "K-FAC")
    assert [p["wall_ratio"] for p in v["pairs"]] == [0.75, 0.75, 9.0 / 8.0]
    assert v["median_wall_ratio"] == 0.75 and v["kfac_faster_in_wall_time"] and v["kfac_fewer_epochs_every_seed"]
    assert v["cost_per_epoch_ratio"] == pytest.approx(1.5) and v["break_even_epoch_ratio"] == pytest.approx(1 / 1.5)


def test_a_kfac_run_that_misses_the_target_fails_the_every_seed_check(study: Any) -> None:
    sgd = [run(s, [0.98, 0.99], 1.0) for s in range(2)]
    kfac = [run(0, [0.99, 0.99], 1.0), run(1, [0.98, 0.985], 1.0)]
    settings = {
        "SGD": {"kfac": False, **study.summarise(sgd), "runs": sgd},
        "K": {"kfac": True, **study.summarise(kfac), "runs": kfac},
    }
    v = study.verdict(settings)
    assert not v["kfac_fewer_epochs_every_seed"] and v["pairs"][1]["wall_ratio"] is None


def test_runs_alternate_sgd_and_kfac_and_reverse_on_every_other_seed(study: Any) -> None:
    a, b = study.Setting(0.1), study.Setting(0.2)
    k = study.parse_kfac_setting("lr=0.1,damping=0.01,factors=10,inverse=100,skip=classifier.1+features.0")
    assert (k.factor_freq, k.inv_freq, k.skip) == (10, 100, ("classifier.1", "features.0"))
    plan = study.interleaved([a, b], [k], [0, 1])
    assert plan == [(a, 0), (k, 0), (b, 0), (b, 1), (k, 1), (a, 1)]


@pytest.mark.parametrize("ranks", [1, 2])
def test_each_run_is_hpcdl_train_with_the_recipe_at_any_number_of_ranks(study: Any, ranks: int) -> None:
    from hpcdl.training.config import parse_config

    recipe = study.RECIPES["mnist"]
    k = study.parse_kfac_setting("lr=0.1,damping=0.1,factors=10,inverse=100,skip=classifier.1,kl_clip=0.002")
    sgd = parse_config(study.train_flags(study.Setting(0.05), 3, recipe, "mnist", Path("/m"), ranks))
    kfac = parse_config(study.train_flags(k, 3, recipe, "mnist", Path("/m"), ranks))
    for config, lr in ((sgd, 0.05), (kfac, 0.1)):
        assert config.batch_size * ranks == 128 and config.base_lr * ranks == pytest.approx(lr)  # global batch, peak
        assert (config.model, config.epochs, config.weight_decay, config.momentum, config.seed) == (
            "mnist_cnn", 3, 5e-4, 0.9, 3)
        assert (config.lr_schedule, config.warmup_epochs, config.eval_every, config.data_dir) == (
            "cosine", 0.0, 117, "/m")  # 468 steps an epoch, 4 evaluations
    assert not sgd.kfac
    assert kfac.kfac and (kfac.kfac_damping, kfac.kfac_factor_update_freq, kfac.kfac_inv_update_freq,
                          kfac.kfac_kl_clip, kfac.kfac_skip_layers) == (0.1, 10, 100, 0.002, ["classifier.1"])


def test_the_study_has_no_training_loop_of_its_own() -> None:
    source = SCRIPT.read_text()
    for own in ("import torch", "backward(", "KFACPreconditioner", "build_model", ".step("):
        assert own not in source, own


def test_a_tiny_digits_study_runs_hpcdl_train_and_writes_its_results(tmp_path: Path) -> None:
    out = tmp_path / "study"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--epochs", "2", "--seeds", "0", "--sgd-lrs", "0.05", "--kfac",
         "lr=0.05,damping=0.01,factors=1,inverse=5", "--target", "0.5", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["trainer"] == "python -m hpcdl.train" and report["order"] == [
        "SGD lr=0.05 seed 0", "K-FAC lr=0.05 d=0.01 f=1/5 seed 0"]
    for setting in report["settings"].values():
        (run,) = setting["runs"]
        assert run["command"][1:3] == ["-m", "hpcdl.train"] and ("--kfac" in run["command"]) == setting["kfac"]
        assert [p["epoch"] for p in run["points"]] == [1.0, 2.0] and run["steps"] == 2 * (1437 // 32)
        assert run["epochs_to_target"] == 1.0 and run["final_accuracy"] > 0.5  # digits pass 50 % in an epoch
    assert report["verdict"]["best_sgd"] == "SGD lr=0.05"
    assert out.with_suffix(".png").stat().st_size > 0 and not out.with_suffix(".csv").exists()


def test_a_bad_flag_of_a_run_is_refused_before_any_run(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--kfac", "lr=0.1,factors=0", "--sgd-lrs",
                             "--out", str(tmp_path / "x")], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "--kfac-factor-update-freq must be >= 1" in result.stderr and not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "text,message",
    [
        ("damping=0.1", "lr= is required"),
        ("lr=0.1,factors=ten", "bad item 'factors=ten'"),
        ("lr=0.1,colour=red", "bad item 'colour=red'"),
        ("lr=0.1,method=inverse", "bad item 'method=inverse'"),  # hpcdl.train has no flag for it
    ],
)
def test_bad_kfac_settings_are_usage_errors(study: Any, text: str, message: str) -> None:
    with pytest.raises(study.UsageError, match=message):
        study.parse_kfac_setting(text)


def test_missing_mnist_folder_is_refused_in_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--dataset", "mnist", "--data-dir", str(missing)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert (
        f"MNIST not found in {missing} (no folder); fetch it with: python -m hpcdl.fetch_mnist --output {missing}"
        in result.stderr
    )


def test_incomplete_mnist_folder_is_one_line_that_says_how_to_fetch(tmp_path: Path) -> None:
    (tmp_path / "train-images-idx3-ubyte").write_bytes(b"")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--dataset", "mnist", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "hpcdl.fetch_mnist" in result.stderr
