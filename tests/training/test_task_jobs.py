"""Whole ``--task`` jobs under mpirun (docs/training.md, "Your own model"): the two examples train on 2 ranks and
resume bit-identically from a mid-epoch checkpoint on another world size; a built-in model brought as a task
trains exactly as the built-in one; bad tasks are one line, and nothing is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.mpi_harness import REPO
from tests.support.reliability_runs import assert_usage_error, checkpoint_steps, load_checkpoint, run_job, same_weights

pytestmark = pytest.mark.processes  # starts processes: not in the fast tier

# The commands of docs/training.md's "Your own model" section (tests/docs checks that they are written there).
LM = ("--task", "examples.transformer_lm:small_task", "--kfac", "--epochs", "2", "--batch-size", "8", "--seed", "3")
SEGMENTATION = ("--task", "examples.segmentation:task", "--optimizer", "adamw", "--base-lr", "0.01",
                "--epochs", "2", "--batch-size", "16", "--workers", "1", "--seed", "3")
# flags, steps per epoch on 2 ranks, the step of the mid-epoch cut. K-FAC checkpoints its factors, not their
# decompositions (recomputed on loading): a K-FAC resume is exact at a multiple of --kfac-inv-update-freq (10), where
# the uninterrupted run decomposes the same factors too (docs/training.md).
CUT = {"transformer": (LM, 21, 10), "segmentation": (SEGMENTATION, 16, 7)}


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("example", CUT)
def test_an_example_trains_on_two_ranks_and_resumes_bit_identically_on_one(example: str, tmp_path: Path) -> None:
    """2 ranks x batch B is 1 rank x B x 2 accumulated passes (micro-batch j is rank j's batch), so a run cut
    inside its first epoch and resumed on 1 rank ends with the uninterrupted 2-rank run's weights, bit for bit."""
    flags, steps, cut_at = CUT[example]
    last = 2 * steps
    whole = run_job(2, tmp_path / "whole", *flags, timeout=300)
    assert whole.rc == 0, whole.tail()
    assert checkpoint_steps(tmp_path / "whole") == [steps, last], whole.tail()
    cut = run_job(2, tmp_path / "cut", *flags, "--max-steps", str(cut_at), timeout=300)
    assert cut.rc == 0 and checkpoint_steps(tmp_path / "cut") == [cut_at], cut.tail()
    resumed = run_job(1, tmp_path / "cut", *flags, "--resume", "--batches-per-allreduce", "2", timeout=300)
    assert resumed.rc == 0 and "resuming from" in resumed.out, resumed.tail()
    a, b = load_checkpoint(tmp_path / "whole", last), load_checkpoint(tmp_path / "cut", last)
    assert same_weights(a["model"], b["model"])
    # the same weights evaluated in other shards: batch means summed in another order, equal to float32's precision
    assert a["progress"]["last_test"] == pytest.approx(b["progress"]["last_test"], rel=1e-6)

    rows = rows_of(tmp_path / "whole")
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    best = torch.load(tmp_path / "whole" / "best.pt", map_location="cpu", weights_only=True)
    assert best["global_step"] == summary["best"]["step"]  # the checkpoint of the best evaluation, by the task's metric
    assert "train_accuracy" not in rows[-1] and "test_accuracy" not in rows[-1]  # accuracy only where a task says so
    assert summary["best_accuracy"] is None and summary["best"]["metric"] == summary["best"]["metric"]
    if example == "transformer":
        assert rows[-1]["test_loss"] < rows[0]["test_loss"]  # it learns
        assert summary["best"] | {"value": 0, "step": 0} == dict(metric="test_loss", goal="min", value=0, step=0)
        assert summary["best"]["value"] == min(r["test_loss"] for r in rows)
        said = [line for line in whole.out.splitlines() if "K-FAC leaves" in line]
        assert said == ["hpcdl: UserWarning: K-FAC leaves 5 layer(s) it does not model to the optimizer's plain "
                        "step: embed (Embedding), position (Embedding), blocks.0.norm1 (LayerNorm) and 2 more"]
    else:
        assert {"test_loss", "test_iou", "test_pixel_accuracy"} <= set(rows[-1])
        assert summary["best"]["metric"] == "test_iou" and summary["best"]["goal"] == "max"
        assert summary["best"]["value"] == max(r["test_iou"] for r in rows) > 0.5


def test_a_builtin_model_brought_as_a_task_trains_exactly_as_the_builtin_one(tmp_path: Path) -> None:
    """digits_cnn on digits with K-FAC, same seed and flags: the task's weights equal the built-in run's."""
    flags = ("--kfac", "--epochs", "1", "--max-steps", "12", "--seed", "9")
    builtin = run_job(2, tmp_path / "builtin", "--model", "digits_cnn", *flags, timeout=300)
    assert builtin.rc == 0, builtin.tail()
    task = run_job(2, tmp_path / "task", "--task", "tests.support.tasks:digits_task", *flags, timeout=300)
    assert task.rc == 0, task.tail()
    a, b = load_checkpoint(tmp_path / "builtin", 12), load_checkpoint(tmp_path / "task", 12)
    assert same_weights(a["model"], b["model"])
    assert a["progress"]["last_test"]["test_accuracy"] == pytest.approx(b["progress"]["last_test"]["test_accuracy"])
    assert b["config"]["task"] == "tests.support.tasks:digits_task"


BAD = {
    "a path that does not import": (["--task", "no_such_package.tasks:task"], "cannot import no_such_package.tasks"),
    "a function that raises": (["--task", "tests.support.tasks:raises"],
                               "--task tests.support.tasks:raises raised ValueError: no data here"),
    "shapes the model cannot take": (["--task", "tests.support.tasks:wrong_shapes"],
                                     "the task's model cannot take a first batch of inputs (2, 3) float32"),
    "a metric that is not a number": (["--task", "tests.support.tasks:metric_not_a_number"],
                                      "the task's metric 'errors' returns (2, 1) float32"),
}


@pytest.mark.parametrize("row", BAD)
def test_a_bad_task_is_one_line_and_writes_nothing(row: str, tmp_path: Path) -> None:
    flags, fragment = BAD[row]
    job = run_job(2, tmp_path / "run", *flags, "--epochs", "1", timeout=180)
    assert_usage_error(job, fragment)
    written = [p for p in (tmp_path / "run").rglob("*") if p.is_file()] if (tmp_path / "run").exists() else []
    assert not [p for p in written if p.name in ("metrics.jsonl", "summary.json") or p.suffix == ".pt"], written


def test_task_with_dataset_is_one_line_under_mpirun(tmp_path: Path) -> None:
    job = run_job(2, tmp_path / "run", "--task", "examples.segmentation:task", "--dataset", "mnist", timeout=120)
    assert_usage_error(job, "--task brings its own model, data and loss: leave out --dataset")
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(600)
def test_the_transformer_example_in_the_image_equals_the_host_run(tmp_path: Path) -> None:
    """launch/mpirun.sh --image: the user's task module stays outside the image (here, the repository's examples/
    in the working directory) and trains inside it, to the host run's weights bit for bit."""
    import torch

    from tests.support.container import clean_env, existing_image
    from tests.support.vcluster import Launch

    image, reason = existing_image()
    if image is None:
        pytest.skip(reason)
    flags = [*LM, "--max-steps", "10", "--no-progress"]
    checkpoints = {}
    for where, extra in (("host", []), ("image", ["--image", str(image)])):
        out_dir = tmp_path / where
        job = Launch(["-np", "2", *extra, "--", *flags, "--output-dir", str(out_dir)], tmp_path / f"{where}.log", 300,
                     env=clean_env())
        rc = job.wait(315)
        assert rc == 0, f"{where}:\n{job.tail()}"
        assert ("ch-run" in job.text) == (where == "image"), job.tail()
        checkpoints[where] = load_checkpoint(out_dir, 10)["model"]
    assert all(torch.equal(checkpoints["host"][k], checkpoints["image"][k]) for k in checkpoints["host"])


API_SCRIPT = """
import sys
import hpcdl.train
from examples.segmentation import task
hpcdl.train.main(task, epochs=1, max_steps=int(sys.argv[2]), batch_size=16, output_dir=sys.argv[1], progress=False,
                 **({"dataset": "mnist"} if sys.argv[3] == "bad" else {}))
"""


def test_the_python_api_trains_a_task_function_from_a_users_script_under_mpirun(tmp_path: Path) -> None:
    from tests.support.mpi_harness import run_mpi

    script = tmp_path / "mine.py"
    script.write_text(API_SCRIPT)
    done = run_mpi(2, [str(script), str(tmp_path / "run"), "4", "good"], timeout=180, env={"PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert checkpoint_steps(tmp_path / "run") == [4]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["config"]["task"] == "examples.segmentation:task" and summary["stop_reason"] == "max_steps"
    assert summary["best"]["metric"] == "test_iou"
    bad = run_mpi(2, [str(script), str(tmp_path / "bad"), "4", "bad"], timeout=120, env={"PYTHONPATH": str(REPO)})
    lines = [line for line in bad.stderr.splitlines() if ": error: " in line]
    assert bad.returncode == 2 and lines == ["hpcdl.train: error: --task brings its own model, data and loss: leave "
                                             "out --dataset (put them in the task's function)"], bad.stderr[-2000:]
    assert not (tmp_path / "bad").exists()
