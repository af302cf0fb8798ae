"""benchmarks/kfac_overhead.py: what it times is the training loop's own step."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
import torch
from torch import nn

from hpcdl.runtime.errors import UsageError
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


def test_the_phases_hold_k_fac_s_extra_time(study: Any, monkeypatch) -> None:
    """K-FAC's extra time over SGD is in its phases, the hooks' statistics included: with every hook slowed by a
    known sleep the remainder ("hooks and the rest") stays a small part of the extra time (accounting, not speed;
    the sleeps dwarf a loaded machine's noise). Before the hooks were timed the remainder held all the sleeps."""
    import time

    monkeypatch.setattr(study, "build_model", lambda args: nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 30 * 30, 10)))
    args = argparse.Namespace(device="cpu", precision="fp32", batch_size=2)
    batch = study.make_batch(args)
    sgd, kfac = study.Stepper(args, batch), study.Stepper(args, batch, study.import_kfac(None), (1, 4))
    for layer in kfac.pre.layers:
        for name in ("a_moment", "g_moment"):
            real = getattr(layer, name)
            setattr(layer, name, lambda tensor, real=real: time.sleep(0.05) or real(tensor))
    kfac.step()
    entry = study.one_round(args, sgd, {"kfac": kfac}, 4)
    phases = study.attributed(entry)
    extra = entry["kfac_ms"] - entry["sgd_ms"]
    assert phases["statistics"] >= 2 * len(kfac.pre.layers) * 50  # ms per step: every hook's sleep
    assert abs(phases["hooks and the rest"]) < 0.2 * extra
    assert set(entry["phases"]) == set(study.PHASES)


def test_a_device_timed_round_settles_the_events_before_it_reads_the_phases(study: Any, monkeypatch) -> None:
    """On CUDA the attribution round times the phases by device events: their seconds reach ``timings`` only
    when settled, so the round settles before it reads them (here a stand-in settle adds a known second)."""
    monkeypatch.setattr(study, "build_model", lambda args: nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10)))
    args = argparse.Namespace(device="cpu", precision="fp32", batch_size=2)
    batch = study.make_batch(args)
    sgd, kfac = study.Stepper(args, batch), study.Stepper(args, batch, study.import_kfac(None), (1, 2))
    kfac.pre.device_timings = True
    monkeypatch.setattr(kfac.pre, "settle_timings", lambda: kfac.pre.timings.__setitem__(
        "factors", kfac.pre.timings["factors"] + 1.0))
    entry = study.one_round(args, sgd, {"kfac": kfac}, 2)
    assert entry["phases"]["factors"] >= 1e3 / 2  # ms per step: the settled second, over the round's 2 steps


def test_conv_statistics_times_every_conv_layer_of_both_packages(study: Any, capsys, tmp_path) -> None:
    """--conv-statistics runs each package's a_moment on every conv layer's real input, prints one line per
    model and saves the rows; without --baseline it stops with a one-line usage error before measuring."""
    import json
    from pathlib import Path

    from hpcdl.runtime.errors import UsageError

    repo = Path(__file__).resolve().parents[2]
    study.main(["--conv-statistics", "mnist_cnn:2", "--rounds", "1", "--threads", "1", "--baseline", str(repo),
                "--out", str(tmp_path / "conv")])
    line = capsys.readouterr().out.strip().splitlines()[-2]
    assert line.startswith("mnist_cnn batch 2: conv A statistics") and "baseline/this" in line
    [row] = json.loads((tmp_path / "conv.json").read_text())["rows"]
    assert (row["model"], row["batch"]) == ("mnist_cnn", 2) and row["speedup"] > 0
    with pytest.raises(UsageError, match="--conv-statistics needs --baseline"):
        study.main(["--conv-statistics", "mnist_cnn:2"])


@pytest.mark.parametrize(("amp_dtype", "scaled"), [("bf16", False), ("fp16", True)])
def test_autocast_is_the_dtype_asked_for_with_the_scaler_only_for_fp16(study: Any, amp_dtype: str,
                                                                       scaled: bool) -> None:
    """As hpcdl.train's --amp: bf16 (its choice on GPUs that have it) without a loss scaler, fp16 with one; the
    autocast in the step is the dtype asked for (on the CPU bf16 autocast runs, so the step shows it)."""
    import warnings

    args = argparse.Namespace(device="cpu", precision="amp", batch_size=2, amp_dtype=amp_dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a CUDA GradScaler built without CUDA says it is disabled
        stepper = study.Stepper(args, study.make_batch(args))
    assert (stepper.trainer.state.scaler is not None) == scaled
    assert stepper.amp_dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[amp_dtype]
    if amp_dtype == "bf16":
        seen = []
        handle = stepper.model.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
        stepper.step()
        handle.remove()
        assert seen == [torch.bfloat16]


def test_the_statistics_precision_and_factor_examples_reach_hpcdl_s_preconditioner(study: Any) -> None:
    """--kfac-statistics-precision bf16 and --kfac-factor-examples N are the preconditioner's statistics_dtype and
    factor_examples (kfac_gpu.sh's third step measures the first); left out, its defaults."""
    args = argparse.Namespace(device="cpu", precision="fp32", batch_size=2, kfac_statistics_precision="bf16",
                              kfac_factor_examples=1)
    batch = study.make_batch(args)
    options = study.Stepper(args, batch, study.import_kfac(None), (1, 1)).pre.options
    assert options.statistics_dtype == torch.bfloat16 and options.factor_examples == 1
    plain = argparse.Namespace(device="cpu", precision="fp32", batch_size=2)
    options = study.Stepper(plain, batch, study.import_kfac(None), (1, 1)).pre.options
    assert options.statistics_dtype is None and options.factor_examples is None


def test_frequency_pairs_are_read_as_factor_and_inverse_frequencies(study: Any) -> None:
    assert study.frequency_pairs("1,10  10,100") == [(1, 10), (10, 100)]
    for bad in ("1,10 10", "1;10", "0,10", "1,-2", "a,b", "1,2,3", " "):
        with pytest.raises(argparse.ArgumentTypeError):
            study.frequency_pairs(bad)


@pytest.mark.parametrize("flags, says", [
    (["--configs", "1,10 10"], "--configs: '10' is not a (factor,inverse) pair"),
    (["--memory-configs", "1;10"], "--memory-configs: '1;10' is not a (factor,inverse) pair"),
    (["--configs", "1,10", "--memory-configs", "10,100"], "--memory-configs 10,100: not among the timed pairs (1,10)"),
])
def test_malformed_or_untimed_pairs_are_usage_errors_before_any_work(study: Any, tmp_path, flags,
                                                                       says: str) -> None:
    """run_main prints a UsageError as one line; nothing is written, not even the results folder."""
    with pytest.raises(UsageError) as error:
        study.main([*flags, "--out", str(tmp_path / "overhead")])
    assert says in str(error.value) and "\n" not in str(error.value)
    assert not list(tmp_path.iterdir())
