"""Models by name, the learning-rate schedule, and flag validation."""

from __future__ import annotations

import math

import pytest
import torch

from hpcdl.runtime.errors import UsageError
from hpcdl.training.config import parse_config
from hpcdl.training.models import build_model
from hpcdl.training.schedule import LRSchedule, lr_scale


@pytest.mark.parametrize("name,params", [("resnet20", 0.27e6), ("resnet32", 0.46e6), ("resnet56", 0.85e6)])
def test_cifar_resnets_have_the_papers_sizes(name: str, params: float) -> None:
    model = build_model(name, 10, 3)
    count = sum(p.numel() for p in model.parameters())
    assert abs(count - params) / params < 0.02
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_mnist_resnet_has_batch_norm_residual_blocks_and_takes_28x28() -> None:
    from torch import nn

    from hpcdl.training.models import BasicBlock

    model = build_model("mnist_resnet", 10, 1)
    assert sum(p.numel() for p in model.parameters()) == 75_002
    assert sum(isinstance(m, BasicBlock) for m in model.modules()) == 3
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == 7
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    block = model.layers[0]  # a residual block: its output is relu(branch + input), so zeroing the branch passes x on
    nn.init.zeros_(block.bn2.weight)
    nn.init.zeros_(block.bn2.bias)
    x = torch.rand(2, 16, 14, 14)
    assert torch.equal(block.eval()(x), torch.relu(x))


def test_torchvision_model_by_name_with_class_count_and_grey_input() -> None:
    model = build_model("resnet18", 7, 1)
    assert model(torch.randn(2, 1, 32, 32)).shape == (2, 7)


def test_unknown_model_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="unknown model 'resnet33'"):
        build_model("resnet33", 10, 3)


def test_warmup_then_milestones() -> None:
    s = LRSchedule(base_lr=0.1, peak_lr=0.4, warmup_epochs=5, total_epochs=100, kind="step", milestones=[35, 75, 90])
    assert s(0) == pytest.approx(0.1) and s(2.5) == pytest.approx(0.25) and s(5) == pytest.approx(0.4)
    assert s(34.9) == pytest.approx(0.4) and s(35) == pytest.approx(0.04) and s(95) == pytest.approx(0.0004)


def test_cosine_reaches_zero_at_the_end() -> None:
    s = LRSchedule(0.1, 0.2, 0, 10, "cosine")
    assert s(0) == pytest.approx(0.2) and s(5) == pytest.approx(0.1) and s(10) == pytest.approx(0.0, abs=1e-12)
    assert all(s(e) >= s(e + 0.5) for e in [x / 2 for x in range(20)])


def test_lr_scales_with_world_size_and_accumulation() -> None:
    assert lr_scale(8, 1, False, 4, True) == 8
    assert lr_scale(8, 2, False, 4, True) == 16
    assert lr_scale(8, 1, True, 4, True) == 4 and lr_scale(8, 1, True, 4, False) == 1


def test_presets_follow_the_course_command_line() -> None:
    c = parse_config(["--dataset", "cifar10", "--data-dir", "/tmp/cifar-10-batches-py"])
    assert (c.model, c.base_lr, c.batch_size, c.epochs, c.lr_decay, c.kfac) == (
        "resnet32", 0.1, 128, 100, [35, 75, 90], False)
    d = parse_config([])
    assert d.dataset == "digits" and d.model == "digits_cnn"
    milestones = parse_config(["--epochs", "3", "--lr-decay", "1", "2"])  # digits' preset is cosine
    assert milestones.lr_decay == [1, 2] and milestones.lr_schedule == "step"


@pytest.mark.parametrize("flags,message", [
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--epochs", "-1"], "--epochs must be >= 1"),
    (["--base-lr", "0"], "--base-lr must be > 0"),
    (["--target-accuracy", "95"], "fraction"),
    (["--lr-decay", "75", "35"], "increasing"),
    (["--dataset", "mnits"], "invalid choice"),
    (["--batch-size", "ten"], "invalid int value"),
    (["--resume"], "--resume needs --output-dir"),
    (["--kfac-grad-worker-fraction", "0"], "fraction"),
])
def test_bad_flags_are_usage_errors(flags: list[str], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        parse_config(flags)
    assert math.isfinite(1.0)


def test_mnist_cnn_maps_28x28_grey_images_to_class_scores() -> None:
    model = build_model("mnist_cnn", 10, 1)
    out = model(torch.randn(5, 1, 28, 28))
    assert out.shape == (5, 10)
    out.sum().backward()  # every parameter takes part in the output
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    # The first linear layer sees 32 channels x 4 x 4: the K-FAC factor sizes docs/kfac.md quotes.
    assert [m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear)] == [512, 128]
