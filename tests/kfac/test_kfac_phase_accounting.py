"""The preconditioner's phase timings account for K-FAC's work wherever it runs: the capture hooks' statistics
inside forward and backward are the ``statistics`` phase, and the step breakdown takes them out of the pass
they ran in. Accounting only: the hooks are slowed by a known sleep, no speed is asserted."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from hpcdl.training.phases import PHASES, StepPhases
from kfac import KFACPreconditioner

SLEEP = 0.1  # seconds added to every hook's statistics (large against a loaded machine's hiccups)


def _slowed(model: nn.Module) -> KFACPreconditioner:
    pre = KFACPreconditioner(model, factor_update_freq=1, inv_update_freq=10)
    for layer in pre.layers:
        for name in ("a_moment", "g_moment"):
            real = getattr(layer, name)

            def slow(tensor, real=real):
                time.sleep(SLEEP)
                return real(tensor)

            setattr(layer, name, slow)
    return pre


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def test_the_hooks_statistics_are_the_statistics_phase_and_the_forward_part_is_named() -> None:
    model = _model()
    pre = _slowed(model)
    model(torch.randn(4, 6)).sum().backward()
    pre.step()
    layers = len(pre.layers)
    assert pre.statistics_in_forward >= layers * SLEEP
    assert pre.timings["statistics"] - pre.statistics_in_forward >= layers * SLEEP  # the backward hooks' part


def test_a_step_without_factor_update_has_no_statistics() -> None:
    model = _model()
    pre = KFACPreconditioner(model, factor_update_freq=2, inv_update_freq=2)
    for _ in range(2):
        model(torch.randn(4, 6)).sum().backward()
        before = pre.timings["statistics"]
        pre.step()
    assert pre.timings["statistics"] == before  # step 1 captured nothing


def test_the_step_breakdown_moves_the_hooks_time_out_of_forward_and_backward() -> None:
    """The phases tile the step: forward and backward lose what their hooks spent, kfac.statistics holds it."""
    model = _model()
    pre = _slowed(model)
    phases = StepPhases(pre, torch.device("cpu"))
    phases.data_wait_begins()
    phases.begin_step()
    x = torch.randn(4, 6)
    with phases.phase("forward"):
        loss = model(x).sum()
    with phases.phase("backward"):
        loss.backward()
    with phases.phase("kfac"):
        pre.step()
    phases.end_step()
    row = dict(zip([*PHASES, "step"], phases.take()[0], strict=True))
    layers = len(pre.layers)
    assert row["kfac.statistics"] >= 2 * layers * SLEEP
    assert 0 <= row["forward"] < layers * SLEEP and 0 <= row["backward"] < layers * SLEEP
    assert sum(row[p] for p in PHASES) == pytest.approx(row["step"], abs=0.05)


def test_tracing_synchronises_the_preconditioner_s_phases_too() -> None:
    pre = KFACPreconditioner(_model())
    phases = StepPhases(pre, torch.device("cpu"))
    phases.synchronise = True
    assert pre.synchronise_timings
    phases.synchronise = False
    assert not pre.synchronise_timings


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_timings_put_every_phase_s_device_time_in_timings_after_settling() -> None:
    """On a GPU, with ``device_timings`` a step's phases (the hooks' statistics in forward and backward too) are
    spans between CUDA events, read when settled: nothing before, every phase that ran after."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 30 * 30, 10)).cuda()
    pre = KFACPreconditioner(model, factor_update_freq=1, inv_update_freq=1)
    pre.device_timings = True
    x, y = torch.randn(32, 3, 32, 32, device="cuda"), torch.randint(0, 10, (32,), device="cuda")
    nn.functional.cross_entropy(model(x), y).backward()
    pre.step()
    assert sum(pre.timings.values()) == 0.0 and pre.statistics_in_forward == 0.0
    pre.settle_timings()
    for phase in ("statistics", "factors", "decompositions", "precondition"):
        assert pre.timings[phase] > 0.0, phase
    assert 0.0 < pre.statistics_in_forward < pre.timings["statistics"]
