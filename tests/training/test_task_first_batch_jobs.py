"""What the first-batch check finds behaves the same on 1 and N ranks under both backends (real mpirun jobs):
a parameter the loss never reaches is one line everywhere (torch's DDP failed at the second step on 2 ranks,
79 lines), and a lazy layer trains on 2 ranks (its parameters used to be broadcast before they existed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.reliability_runs import assert_usage_error, checkpoint_steps, run_job

pytestmark = pytest.mark.processes

SHORT = ("--epochs", "1", "--max-steps", "2", "--batch-size", "8", "--stall-timeout", "0")


@pytest.mark.parametrize(("ranks", "backend"), [(1, "horovod"), (2, "horovod"), (2, "torch")])
def test_a_parameter_the_loss_never_reaches_is_one_line_on_any_ranks(ranks: int, backend: str,
                                                                      tmp_path: Path) -> None:
    job = run_job(ranks, tmp_path / "run", "--task", "tests.support.tasks:unused_parameter", "--backend", backend,
                  *SHORT, timeout=180)
    assert_usage_error(job, "the task's loss does not depend on the parameter(s) unused.weight, unused.bias")


@pytest.mark.parametrize("backend", ["horovod", "torch"])
def test_a_lazy_layer_trains_on_two_ranks(backend: str, tmp_path: Path) -> None:
    job = run_job(2, tmp_path / "run", "--task", "tests.support.tasks:lazy_model", "--backend", backend, "--kfac",
                  *SHORT, timeout=180)
    assert job.rc == 0, job.tail()
    assert checkpoint_steps(tmp_path / "run") == [2]


def test_the_own_model_example_trains_with_its_groups_and_options_and_loads_into_a_plain_model(tmp_path: Path) -> None:
    """examples/own_model.py: a (logits, loss) model wrapped, AdamW with two parameter groups (no weight decay on
    norms and biases) and betas (0.9, 0.95), then best.pt loaded into the unwrapped model."""
    import torch

    from examples.own_model import Classifier, load_best
    from tests.support.reliability_runs import load_checkpoint

    run_dir = tmp_path / "run"
    job = run_job(1, run_dir, "--task", "examples.own_model:task", "--optimizer", "adamw", "--base-lr", "0.003",
                  *SHORT, timeout=180)
    assert job.rc == 0, job.tail()
    groups = load_checkpoint(run_dir, 2)["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.05, 0.0]
    assert all(tuple(g["betas"]) == (0.9, 0.95) for g in groups)
    model = load_best(run_dir)
    assert isinstance(model, Classifier)
    saved = load_checkpoint(run_dir, 2)["model"]
    assert all(torch.equal(saved[f"model.{k}"], v) for k, v in model.state_dict().items())
