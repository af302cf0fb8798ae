"""benchmarks/kfac_overhead.py: what it times is the training loop's own step."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
import torch

from tests.support.scripts import load_benchmark


@pytest.fixture(scope="module")
def study() -> Any:
    return load_benchmark("kfac_overhead")


def test_a_contender_steps_through_the_training_loop_s_gradient_step(study: Any, monkeypatch) -> None:
    """SGD and K-FAC alike go through hpcdl.training.loop.apply_gradients, which updates the weights and runs
    K-FAC; no copy of its sequence (scaler, preconditioner, update) lives in the benchmark."""
    args = argparse.Namespace(device="cpu", precision="fp32", batch_size=2)
    batch = study.make_batch(args)
    calls: list[Any] = []
    real = study.apply_gradients
    monkeypatch.setattr(study, "apply_gradients", lambda trainer: calls.append(trainer) or real(trainer))
    for stepper in (study.Stepper(args, batch), study.Stepper(args, batch, study.import_kfac(None), (1, 1))):
        before = [p.detach().clone() for p in stepper.model.parameters()]
        stepper.step()
        assert any(not torch.equal(a, b) for a, b in zip(before, stepper.model.parameters(), strict=True))
    assert len(calls) == 2
    assert stepper.pre.timings["decompositions"] > 0  # K-FAC's step ran inside the loop's
