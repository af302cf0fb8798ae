"""``--channels-last``: which models run in NHWC (hpcdl.training.job.put_in_nhwc), on a CPU as on CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from hpcdl.runtime.errors import UsageError
from hpcdl.training.config import parse_config
from hpcdl.training.job import model_channels_last
from hpcdl.training.models import build_model
from hpcdl.training.train import train

CONV = build_model("digits_cnn", 10, 1)
MLP = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
VIEW_CNN = ["--model", "tests.support.models:view_cnn"]


@pytest.mark.parametrize(("setting", "model", "expected"), [
    ("auto", CONV, True), ("on", CONV, True), ("off", CONV, False),
    ("auto", MLP, False), ("on", MLP, False),  # nothing to gain without convolutions
])
def test_which_models_are_asked_for_nhwc(setting: str, model: nn.Module, expected: bool) -> None:
    assert model_channels_last(setting, model) is expected


def run(flags: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> set[bool]:
    """Train 2 steps on the CPU; for each training forward of a convolution, whether its weight was NHWC."""
    seen: list[bool] = []
    forward = nn.Conv2d.forward

    def recording(self: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
        if self.training:  # the training steps (the first-batch checks run in eval mode)
            weight = self.weight
            seen.append(weight.is_contiguous(memory_format=torch.channels_last) and not weight.is_contiguous())
        return forward(self, x)

    monkeypatch.setattr(nn.Conv2d, "forward", recording)
    train(parse_config(["--dataset", "synthetic", "--model", "digits_cnn", "--synthetic-shape", "3", "8", "8",
                        "--synthetic-size", "64", "--batch-size", "16", "--max-steps", "2", "--device", "cpu",
                        "--no-progress", "--output-dir", str(tmp_path / "run"), *flags]))
    return set(seen)


@pytest.mark.processes
@pytest.mark.parametrize(("flags", "nhwc"), [([], True), (["--channels-last", "off"], False),
                                             (["--model", "tests.support.models:reshape_cnn"], True)])
def test_a_cpu_run_trains_convolutional_models_in_nhwc_by_default(flags: list[str], nhwc: bool, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    assert run(flags, tmp_path, monkeypatch) == {nhwc}


@pytest.mark.processes
def test_a_model_whose_forward_cannot_take_nhwc_trains_in_nchw_with_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    assert run(VIEW_CNN, tmp_path, monkeypatch) == {False}
    said = [line for line in capfd.readouterr().out.splitlines() if "--channels-last auto" in line]
    assert len(said) == 1 and said[0].startswith("hpcdl: --channels-last auto: tests.support.models:view_cnn on "
                                                 "synthetic cannot run in NHWC (RuntimeError: view size")
    assert said[0].endswith("training in NCHW (use .reshape or torch.flatten in its forward to gain NHWC's speed)")


def test_asking_for_nhwc_with_such_a_model_is_one_line_before_any_step(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UsageError, match=r"^--channels-last on: tests.support.models:view_cnn on synthetic cannot "
                                         r"run in NHWC \(RuntimeError: view size .*\); use .reshape or torch.flatten "
                                         r"in its forward, or --channels-last off$"):
        run([*VIEW_CNN, "--channels-last", "on"], tmp_path, monkeypatch)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
