"""Layers K-FAC leaves to the optimizer are said once, in one warning, however many there are (a MobileNet
has dozens of depthwise convolutions), and a training job prints that warning as one line on rank 0."""

from __future__ import annotations

import warnings

import pytest
from torch import nn

from kfac.layers import find_layers
from tests.support.reliability_runs import run_job


def depthwise_stack(count: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 1), *[nn.Conv2d(8, 8, 3, padding=1, groups=8) for _ in range(count)])


def test_many_skipped_layers_make_one_warning_naming_how_many() -> None:
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        layers = find_layers(depthwise_stack(7))
    assert [layer.name for layer in layers] == ["0"]
    assert len(said) == 1, [str(w.message) for w in said]
    message = str(said[0].message)
    assert "\n" not in message
    assert message.startswith("K-FAC skips 7 grouped or depthwise convolution(s)")
    assert "1 (groups=8), 2 (groups=8), 3 (groups=8) and 4 more" in message


@pytest.mark.processes
def test_a_training_job_prints_it_as_one_line_on_rank_0(tmp_path) -> None:
    job = run_job(2, tmp_path / "run", "--dataset", "synthetic", "--synthetic-shape", "3", "16", "16",
                  "--synthetic-size", "256", "--model", "mobilenet_v2", "--kfac", "--epochs", "1", "--max-steps", "1",
                  "--batch-size", "8", timeout=300)
    assert job.rc == 0, job.tail()
    said = [line for line in (job.out + job.err).splitlines() if "K-FAC skips" in line]
    assert len(said) == 1 and said[0].startswith("hpcdl: UserWarning: K-FAC skips 17 grouped or depthwise"), said
    assert "warnings.warn" not in job.err


class TiedLM(nn.Module):
    """nanoGPT's tying: the embedding's weight is the output layer's."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(10, 8)
        self.ln = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 10, bias=False)
        self.wte.weight = self.lm_head.weight


def test_a_tied_weight_is_said_to_be_preconditioned_through_the_layer_k_fac_models() -> None:
    """The line used to list wte among the layers left to the plain step, though its weight is lm_head's."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        layers = find_layers(TiedLM())
    assert [layer.name for layer in layers] == ["lm_head"]
    messages = [str(w.message) for w in said]
    plain = [m for m in messages if "plain step" in m]
    assert plain == ["K-FAC leaves 1 layer(s) it does not model to the optimizer's plain step: ln (LayerNorm)"]
    assert any("preconditions tied weights through the layer it models: wte's weight is lm_head's" in m
               for m in messages), messages
