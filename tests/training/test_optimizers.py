"""LARS and LAMB (timm) and the warm-up start in hpcdl.train: values against their formulas and
against timm's own optimizers, non-finite steps skipped, one-line errors, and whole 2-rank jobs
that resume bit-identically and equal a 1-rank run on the same global batch."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from timm.optim import Lamb, Lars
from torch import nn

from hpcdl.runtime.errors import UsageError
from hpcdl.training.config import TrainConfig, parse_config
from hpcdl.training.optimizers import GuardedLamb, GuardedLars, build_preconditioner, build_update_rule
from hpcdl.training.schedule import LRSchedule, warmup_start
from tests.support.reliability_runs import assert_usage_error, checkpoint_steps, load_checkpoint, run_job, same_weights

processes = pytest.mark.processes  # the job tests start mpirun


# ---- warm-up -----------------------------------------------------------------------------------


@pytest.mark.parametrize("start_factor", [None, 0.1, 1.0])
@pytest.mark.parametrize("ranks", [1, 4])
def test_warmup_follows_the_linear_formula_from_its_start(start_factor: float | None, ranks: int) -> None:
    base, warmup = 0.05, 2.0
    peak = base * ranks
    start = warmup_start(base, peak, start_factor)
    assert start == (base if start_factor is None else start_factor * peak)
    schedule = LRSchedule(start, peak, warmup, total_epochs=10, kind="cosine")
    for progress in (0.0, 0.25, 0.5, 1.0, 1.5, 1.999):
        expected = start + (peak - start) * progress / warmup
        assert schedule(progress) == pytest.approx(expected, rel=1e-12)
    assert schedule(warmup) == pytest.approx(peak)  # cosine starts at the peak when the warm-up ends
    assert schedule(10.0) == pytest.approx(0.0, abs=1e-12)


def test_one_rank_warmup_ramps_only_with_a_start_factor() -> None:
    flat = parse_config(["--base-lr", "0.4", "--warmup-epochs", "1"])
    ramp = parse_config(["--base-lr", "0.4", "--warmup-epochs", "1", "--warmup-start-factor", "0.01"])
    assert warmup_start(flat.base_lr, 0.4, flat.warmup_start_factor) == 0.4  # one rank: base == peak, no ramp
    assert warmup_start(ramp.base_lr, 0.4, ramp.warmup_start_factor) == pytest.approx(0.004)


# ---- bad values: one line naming the flag --------------------------------------------------------


@pytest.mark.parametrize("argv, fragment", [
    (["--optimizer", "lion"], "--optimizer"),
    (["--warmup-start-factor", "0"], "--warmup-start-factor must be a fraction in (0, 1]"),
    (["--warmup-start-factor", "1.5"], "--warmup-start-factor must be a fraction in (0, 1]"),
    (["--warmup-start-factor", "nan"], "--warmup-start-factor must be"),
    (["--warmup-start-factor", "0.1", "--warmup-epochs", "0"], "--warmup-start-factor needs --warmup-epochs > 0"),
    (["--optimizer", "lamb", "--nesterov"], "--nesterov needs --optimizer sgd"),
])
def test_bad_values_are_one_line_naming_the_flag(argv: list[str], fragment: str) -> None:
    with pytest.raises(UsageError) as caught:
        parse_config(argv)
    assert fragment in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("spec, fragment", [
    ("nonsense", "takes hpcdl or module:function"),
    ("no_such_module_here:make", "ModuleNotFoundError"),
    ("math:no_such_function", "AttributeError"),
    ("math:pi", "is not callable"),
])
def test_a_bad_kfac_impl_is_one_line(spec: str, fragment: str) -> None:
    config = TrainConfig(kfac=True, kfac_impl=spec)
    with pytest.raises(UsageError) as caught:
        build_preconditioner(config, nn.Linear(2, 2), lambda *_: 0.1, None)
    assert fragment in str(caught.value) and "\n" not in str(caught.value)


def test_kfac_impl_calls_the_factory_with_the_jobs_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def factory(config, model, lr, scaler):
        seen.update(config=config, model=model, lr=lr(), scaler=scaler)
        return "preconditioner"

    monkeypatch.setattr(math, "test_factory", factory, raising=False)
    config, model = TrainConfig(kfac=True, kfac_impl="math:test_factory"), nn.Linear(2, 2)
    assert build_preconditioner(config, model, lambda *_: 0.25, None) == "preconditioner"
    assert seen == dict(config=config, model=model, lr=0.25, scaler=None)
    assert build_preconditioner(TrainConfig(kfac_impl="math:test_factory"), model, lambda *_: 0.1, None) is None


# ---- the update rules against timm's own, and the non-finite skip ---------------------------------


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def _step_with(optimizer: torch.optim.Optimizer, model: nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()


@pytest.mark.parametrize("name, reference", [("lars", Lars), ("lamb", Lamb)])
def test_the_rule_is_timms_with_the_configured_hyperparameters(name: str, reference: type) -> None:
    config = TrainConfig(optimizer=name, momentum=0.8, weight_decay=1e-3)
    ours_model, timm_model = _model(), _model()
    ours = build_update_rule(config, ours_model, lr=0.3)
    extra = {"momentum": 0.8} if name == "lars" else {}
    theirs = reference(timm_model.parameters(), lr=0.3, weight_decay=1e-3, **extra)
    for seed in range(4):
        _step_with(ours, ours_model, seed)
        _step_with(theirs, timm_model, seed)
    assert same_weights(ours_model.state_dict(), timm_model.state_dict())
    assert not same_weights(ours_model.state_dict(), _model().state_dict())  # it did train


@pytest.mark.parametrize("rule", [GuardedLars, GuardedLamb])
def test_a_flagged_step_leaves_parameters_and_state_alone(rule: type) -> None:
    model = _model()
    optimizer = rule(model.parameters(), lr=0.1, weight_decay=1e-3)
    _step_with(optimizer, model, 0)
    params, state = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    optimizer.found_inf = torch.ones(())
    _step_with(optimizer, model, 1)
    assert same_weights(model.state_dict(), params)
    assert str(optimizer.state_dict()) == str(state)
    optimizer.found_inf = torch.zeros(())
    _step_with(optimizer, model, 1)
    assert not same_weights(model.state_dict(), params)


# ---- whole jobs ----------------------------------------------------------------------------------

FLAGS = ("--epochs", "2", "--seed", "5", "--base-lr", "0.02", "--warmup-epochs", "0.5", "--warmup-start-factor",
         "0.1", "--keep-checkpoints", "5")
LRS = {"lars": "2.0", "lamb": "0.005"}  # LARS's trust ratio scales the step: its rate is not SGD's


@processes
@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_two_rank_jobs_resume_bit_identically_and_equal_one_rank(name: str, tmp_path: Path) -> None:
    flags = (*FLAGS, "--optimizer", name, "--base-lr", LRS[name])
    whole = run_job(2, tmp_path / "whole", *flags)
    assert whole.rc == 0, whole.tail()
    cut = run_job(2, tmp_path / "cut", *flags, "--max-steps", "15")  # mid-epoch 1 (22 steps per epoch)
    assert cut.rc == 0 and checkpoint_steps(tmp_path / "cut") == [15], cut.tail()
    resumed = run_job(2, tmp_path / "cut", *flags, "--resume")
    assert resumed.rc == 0 and "resuming from" in resumed.out, resumed.tail()
    a, b = load_checkpoint(tmp_path / "whole", 44), load_checkpoint(tmp_path / "cut", 44)
    assert same_weights(a["model"], b["model"])
    assert str(a["optimizer"]) == str(b["optimizer"])
    assert a["progress"]["last_test"] == b["progress"]["last_test"]

    # 1 rank x 64 is the same global batch as 2 x 32 (Horovod averages the gradients); the base rate is per
    # rank and scaled by the world size, so it is doubled here.
    single = run_job(1, tmp_path / "single", *FLAGS, "--optimizer", name, "--batch-size", "64",
                     "--base-lr", str(2 * float(LRS[name])))
    assert single.rc == 0, single.tail()
    c = load_checkpoint(tmp_path / "single", 44)
    for key, value in a["model"].items():
        torch.testing.assert_close(c["model"][key], value, rtol=1e-4, atol=1e-5, msg=key)


@processes
def test_a_nonfinite_step_is_skipped_with_lars_and_bf16(tmp_path: Path) -> None:
    job = run_job(2, tmp_path / "run", *FLAGS, "--optimizer", "lars", "--base-lr", LRS["lars"], "--amp", "bf16",
                  "--epochs", "1", fault="1:3:nan")
    assert job.rc == 0, job.tail()
    assert "step 3: non-finite gradients, update skipped" in job.out
    state = load_checkpoint(tmp_path / "run", 22)
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())


@processes
def test_a_bad_optimizer_is_one_line_from_the_job(tmp_path: Path) -> None:
    assert_usage_error(run_job(2, tmp_path / "run", "--optimizer", "lion", timeout=120), "--optimizer")
