"""K-FAC on what users bring: Linear layers on (batch, sequence, features) inputs, and the layers it cannot
precondition (embeddings, norms, nn.MultiheadAttention) left to the plain step and said once, in one line.

The reference is tests/kfac/test_kfac_reference.py's dense float64 one, applied to the flattened 2-D input:
every position of every sequence is one example (docs/kfac.md), so the factors and the preconditioned gradient
of a 3-D input must equal those of its (batch x sequence, features) rows, computed one row at a time.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from kfac import KFACPreconditioner
from kfac.layers import LinearLayer, find_layers
from tests.kfac.test_kfac_reference import DTYPE, TOL, TinyMLP, dense_solve, grad_matrix, reference_factors, rel_err


def sequence_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))


def test_a_3d_input_gives_the_factors_and_step_of_its_flattened_rows() -> None:
    torch.manual_seed(0)
    model = TinyMLP().to(DTYPE)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, 5, generator=generator, dtype=DTYPE)  # (batch, sequence, features)
    y = torch.randint(0, 3, (3, 4), generator=generator)
    factors = reference_factors(model, x.reshape(-1, 5), y.reshape(-1))  # row by row, by hand
    damping = 0.05
    pre = KFACPreconditioner(model, inv_update_freq=1, kl_clip=None, damping=damping)
    model.zero_grad()
    sequence_loss(model(x), y).backward()
    raw = {layer.name: grad_matrix(layer.module).clone() for layer in pre.layers}
    pre.step()
    assert [layer.name for layer in pre.layers] == ["fc1", "fc2"]
    for i, layer in enumerate(pre.layers):
        big_a, big_g = factors[layer.name]
        assert rel_err(pre.a_factors[i], big_a) < TOL, layer.name
        assert rel_err(pre.g_factors[i], big_g) < TOL, layer.name
        assert rel_err(grad_matrix(layer.module), dense_solve(big_a, big_g, raw[layer.name], damping)) < TOL


def test_linear_moments_of_a_3d_input_are_the_dense_sums_over_its_rows() -> None:
    layer = LinearLayer("fc", nn.Linear(5, 2).double())
    x = torch.randn(2, 7, 5, dtype=DTYPE)
    rows = torch.cat([x.reshape(-1, 5), torch.ones(14, 1, dtype=DTYPE)], dim=1)
    moment, count = layer.a_moment(x)
    assert count == 14 and torch.allclose(moment, rows.T @ rows)
    grad = torch.randn(2, 7, 2, dtype=DTYPE)
    moment, count = layer.g_moment(grad)
    assert count == 14 and torch.allclose(moment, grad.reshape(-1, 2).T @ grad.reshape(-1, 2))
    assert layer.examples(grad) == 14


class WithAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.norm = nn.LayerNorm(8)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 11)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.embed(tokens))
        return self.head(self.attention(x, x, x, need_weights=False)[0])


def test_layers_it_cannot_precondition_take_the_plain_step_and_are_said_once() -> None:
    torch.manual_seed(0)
    model = WithAttention()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        layers = find_layers(model)
    assert [layer.name for layer in layers] == ["head"]  # attention.out_proj runs without its module's forward
    messages = [str(w.message) for w in said]
    assert messages == ["K-FAC leaves 4 layer(s) it does not model to the optimizer's plain step: embed (Embedding), "
                        "norm (LayerNorm), attention (MultiheadAttention) and 1 more"], messages
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        find_layers(model, skip_layers=["embed", "norm", "attention"])
    assert said == []  # what the user skipped by name is not news

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pre = KFACPreconditioner(model, inv_update_freq=1)
    tokens = torch.randint(0, 11, (4, 6))
    sequence_loss(model(tokens), tokens).backward()
    plain = {name: p.grad.clone() for name, p in model.named_parameters() if not name.startswith("head.")}
    head = model.head.weight.grad.clone()
    pre.step()
    for name, p in model.named_parameters():
        if name in plain:
            assert torch.equal(p.grad, plain[name]), name  # the optimizer gets these gradients as they are
    assert not torch.allclose(model.head.weight.grad, head)  # the modelled layer is preconditioned
