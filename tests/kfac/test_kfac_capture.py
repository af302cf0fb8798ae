"""Hooks: what is captured, when, and from which tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kfac.capture import LayerCapture
from kfac.layers import LinearLayer


def _capture(module: nn.Linear, capturing=lambda: True, scale=False):
    done = []
    capture = LayerCapture(LinearLayer("fc", module), capturing, scale, done.append)
    return capture, done


def test_forward_and_backward_make_a_complete_capture() -> None:
    fc = nn.Linear(3, 2)
    capture, done = _capture(fc)
    x = torch.randn(5, 3)
    out = fc(x)
    assert not capture.complete
    out.pow(2).sum().backward()
    assert done == [capture]
    stats = capture.statistics()
    rows = torch.cat([x, torch.ones(5, 1)], 1)
    torch.testing.assert_close(stats.a_sum, rows.T @ rows)
    grad = 2 * out.detach()
    torch.testing.assert_close(stats.g_sum, grad.T @ grad)
    assert (stats.a_count, stats.g_count) == (5.0, 5.0)


def test_nothing_is_captured_in_eval_mode_under_no_grad_or_between_update_steps() -> None:
    fc = nn.Linear(3, 2)
    enabled = [True]
    capture, _ = _capture(fc, capturing=lambda: enabled[0])
    with torch.no_grad():
        fc(torch.randn(2, 3))
    fc.eval()
    fc(torch.randn(2, 3)).sum().backward()
    fc.train()
    enabled[0] = False
    fc(torch.randn(2, 3)).sum().backward()
    assert capture.forwards == 0 and capture.statistics() is None


def test_an_output_without_gradient_leaves_the_layer_incomplete() -> None:
    used, unused = nn.Linear(3, 2), nn.Linear(3, 2)
    capture, done = _capture(unused)
    x = torch.randn(4, 3)
    _ = unused(x)
    used(x).sum().backward()
    assert capture.forwards == 1 and not capture.complete and not done and capture.statistics() is None


def test_two_calls_in_one_forward_add_up_and_complete_once() -> None:
    fc = nn.Linear(2, 2)
    capture, done = _capture(fc)
    x = torch.randn(3, 2)
    fc(fc(x)).sum().backward()
    assert len(done) == 1 and capture.statistics().a_count == 6


def test_in_place_activation_after_the_layer_still_gives_the_gradient_of_its_output() -> None:
    fc = nn.Linear(3, 4)
    capture, _ = _capture(fc, scale=True)
    x = torch.randn(6, 3)
    out = fc(x)
    F.cross_entropy(torch.relu_(out), torch.arange(6) % 4).backward()
    pre_activation = F.linear(x, fc.weight, fc.bias).detach().requires_grad_()  # no hook
    F.cross_entropy(torch.relu(pre_activation), torch.arange(6) % 4).backward()
    per_example = pre_activation.grad * 6  # mean loss: per-example gradient = N x grad_output
    torch.testing.assert_close(capture.statistics().g_sum, per_example.T @ per_example)
