"""Which modules K-FAC takes, and how a layer reads its statistics and gradient."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kfac.layers import Conv2dLayer, LinearLayer, find_layers


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.depthwise = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.block = nn.Sequential(nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8), nn.Conv2d(8, 8, 3, padding=1, bias=False))
        self.frozen = nn.Linear(8, 8)
        self.frozen.weight.requires_grad_(False)
        self.head = nn.Linear(8, 4)


def test_finds_linear_and_conv_in_model_order_and_skips_grouped_with_a_warning() -> None:
    with pytest.warns(UserWarning, match="depthwise.*groups=8"):
        layers = find_layers(Model())
    assert [layer.name for layer in layers] == ["stem", "block.0", "block.2", "head"]
    assert [type(layer) for layer in layers] == [Conv2dLayer, Conv2dLayer, Conv2dLayer, LinearLayer]
    assert [(layer.a_dim, layer.g_dim) for layer in layers] == [(28, 8), (9, 8), (72, 8), (9, 4)]


@pytest.mark.filterwarnings("ignore:K-FAC skips")
@pytest.mark.parametrize(
    "skip, expected",
    [
        (["block"], ["stem", "head"]),  # a name skips everything under it
        (["block.2", "head"], ["stem", "block.0"]),
        (["linear"], ["stem", "block.0", "block.2"]),  # class names, any case
        ([nn.Conv2d], ["head"]),  # classes
    ],
)
def test_skip_layers(skip, expected) -> None:
    assert [layer.name for layer in find_layers(Model(), skip)] == expected


def test_linear_treats_every_leading_row_as_an_example() -> None:
    layer = LinearLayer("fc", nn.Linear(3, 2))
    x = torch.randn(4, 5, 3)
    moment, count = layer.a_moment(x)
    rows = torch.cat([x.reshape(-1, 3), torch.ones(20, 1)], 1)
    torch.testing.assert_close(moment, rows.T @ rows)
    assert count == 20
    grad = torch.randn(4, 5, 2)
    g_moment, g_count = layer.g_moment(grad)
    torch.testing.assert_close(g_moment, grad.reshape(-1, 2).T @ grad.reshape(-1, 2))
    assert g_count == 20 and layer.examples(grad) == 20


def test_conv_g_moment_sums_over_examples_and_positions() -> None:
    layer = Conv2dLayer("c", nn.Conv2d(2, 3, 3).double())
    grad = torch.randn(4, 3, 5, 6, dtype=torch.float64)
    moment, count = layer.g_moment(grad)
    want = sum(torch.outer(grad[n, :, i, j], grad[n, :, i, j]) for n in range(4) for i in range(5) for j in range(6))
    torch.testing.assert_close(moment, want)
    assert count == 4 * 5 * 6 and layer.examples(grad) == 4


@pytest.mark.parametrize("channels_last", [False, True])
def test_conv_g_moment_of_a_deep_layer_needs_no_per_example_stack(channels_last: bool) -> None:
    """More channels than positions (ResNet-50's layer4): G comes from one (N·positions, out) matrix."""
    layer = Conv2dLayer("c", nn.Conv2d(2, 12, 3).double())
    grad = torch.randn(5, 12, 2, 3, dtype=torch.float64)
    if channels_last:
        grad = grad.to(memory_format=torch.channels_last)
    moment, count = layer.g_moment(grad)
    want = sum(torch.outer(grad[n, :, i, j], grad[n, :, i, j]) for n in range(5) for i in range(2) for j in range(3))
    torch.testing.assert_close(moment, want)
    assert count == 5 * 2 * 3


def test_factors_are_float32_for_half_models_and_float64_for_double() -> None:
    assert (
        LinearLayer("a", nn.Linear(2, 2).to(torch.bfloat16)).a_moment(torch.randn(3, 2).bfloat16())[0].dtype
        == torch.float32
    )
    assert LinearLayer("a", nn.Linear(2, 2).double()).a_moment(torch.randn(3, 2).double())[0].dtype == torch.float64


def test_grad_matrix_round_trip_with_bias_last() -> None:
    conv = nn.Conv2d(2, 3, 2)
    layer = Conv2dLayer("c", conv)
    conv.weight.grad = torch.randn_like(conv.weight)
    conv.bias.grad = torch.randn_like(conv.bias)
    matrix = layer.grad_matrix(torch.float32)
    assert matrix.shape == (3, 2 * 2 * 2 + 1)
    torch.testing.assert_close(matrix[:, -1], conv.bias.grad)
    layer.set_grad(2 * matrix)
    torch.testing.assert_close(layer.grad_matrix(torch.float32), 2 * matrix)


def test_grad_matrix_is_none_without_gradient() -> None:
    layer = LinearLayer("fc", nn.Linear(2, 2))
    assert layer.grad_matrix(torch.float32) is None
