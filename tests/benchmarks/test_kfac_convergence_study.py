"""benchmarks/kfac_convergence.py: time to target, the paired verdict, the run order, refusals.

The study itself takes minutes; these check its bookkeeping on synthetic accuracy curves, whose
right answers are worked out by hand below.
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.processes  # starts processes: not in the fast tier


REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "kfac_convergence.py"


@pytest.fixture(scope="module")
def study() -> Any:
    spec = importlib.util.spec_from_file_location("kfac_convergence", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["kfac_convergence"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def curve(accuracies: list[float], seconds_per_point: float, evals_per_epoch: int = 4) -> list[dict[str, float]]:
    return [
        {
            "epoch": (i + 1) / evals_per_epoch,
            "accuracy": a,
            "seconds": (i + 1) * seconds_per_point,
            "cpu_seconds": (i + 1) * seconds_per_point * 0.9,
            "thread_seconds": 0.0,
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
        "cpu_seconds_to_target": hit and hit["cpu_seconds"],
        "final_accuracy": accuracies[-1],
        "train_seconds": points[-1]["seconds"],
        "eval_seconds": 1.0,
        "ms_per_step": {
            p: 1.0 for p in ("forward_backward", "allreduce", "factors", "decompositions", "precondition", "optimizer")
        },
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
    k = study.parse_kfac_setting(
        "lr=0.1,damping=0.01,factors=10,inverse=100,skip=classifier.1+features.0,method=inverse"
    )
    assert (k.factor_freq, k.inv_freq, k.skip, k.method) == (10, 100, ("classifier.1", "features.0"), "inverse")
    plan = study.interleaved([a, b, k], [0, 1])
    assert plan == [(a, 0), (k, 0), (b, 0), (b, 1), (k, 1), (a, 1)]


@pytest.mark.parametrize(
    "text,message",
    [
        ("damping=0.1", "lr= is required"),
        ("lr=0.1,factors=ten", "bad item 'factors=ten'"),
        ("lr=0.1,colour=red", "bad item 'colour=red'"),
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
