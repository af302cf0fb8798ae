"""K-FAC against a dense float64 reference built by hand.

The reference takes every quantity from its definition: A from the layer inputs (unfolded with
F.unfold for convolutions, a column of ones for the bias), G from per-example gradients computed
one example at a time with autograd, and the preconditioned gradient from a dense solve with the
explicit Kronecker product (G ⊗ A + λI) vec(V) = vec(∇W), row-major vec. Nothing here calls
K-FAC's own factor or solve code.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac import KFACPreconditioner
from kfac.capture import examples_per_pass

TOL = 1e-5
DTYPE = torch.float64


class TinyConvNet(nn.Module):
    """A conv with stride 2, padding 1 and dilation 2 (the acceptance case), then a linear head."""

    def __init__(self, conv_bias: bool = True) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, stride=2, padding=1, dilation=2, bias=conv_bias)
        self.fc = nn.Linear(3 * 4 * 4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


class TinyMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 4)
        self.fc2 = nn.Linear(4, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class TwinMLP(nn.Module):
    """Layers of one shape: K-FAC preconditions them with one batched product."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 5)
        self.fc2 = nn.Linear(5, 5)
        self.fc3 = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def _with_ones(rows: torch.Tensor, bias: bool) -> torch.Tensor:
    return torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=rows.dtype)], dim=1) if bias else rows


def reference_factors(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, conv: str = "expand"
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(A, G) per layer from the textbook definitions, one example at a time; ``conv`` 'reduce' takes a
    convolution's positions as K-FAC-reduce does (Eschenhagen et al. 2023), in hpcdl's scale: A = |T|/N Σₙ āₙāₙᵀ
    with āₙ the mean patch, G = 1/(N|T|) Σₙ ḡₙḡₙᵀ with ḡₙ the gradient summed over positions."""
    inputs: dict[str, torch.Tensor] = {}
    outputs: dict[str, torch.Tensor] = {}

    def keep(name: str):
        def hook(module, args, out):
            inputs[name] = args[0]
            outputs[name] = out

        return hook

    modules = {name: m for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))}
    handles = [m.register_forward_hook(keep(name)) for name, m in modules.items()]
    n = x.shape[0]
    a_rows: dict[str, list[torch.Tensor]] = {name: [] for name in modules}
    g_rows: dict[str, list[torch.Tensor]] = {name: [] for name in modules}
    for i in range(n):
        loss_i = F.cross_entropy(model(x[i : i + 1]), y[i : i + 1], reduction="sum")  # this example's loss
        names = list(modules)
        grads = torch.autograd.grad(loss_i, [outputs[name] for name in names])
        for name, grad in zip(names, grads, strict=False):
            m = modules[name]
            bias = m.bias is not None
            if isinstance(m, nn.Conv2d):
                patches = F.unfold(inputs[name], m.kernel_size, m.dilation, m.padding, m.stride)[0].T  # (L, C*k*k)
                a_rows[name].append(_with_ones(patches, bias))
                g_rows[name].append(grad[0].reshape(grad.shape[1], -1).T)  # (L, out)
            else:
                a_rows[name].append(_with_ones(inputs[name].detach(), bias))
                g_rows[name].append(grad)
    for h in handles:
        h.remove()
    factors = {}
    for name in modules:
        a = torch.stack(a_rows[name])  # (N, positions, in)
        g = torch.stack(g_rows[name])  # (N, positions, out)
        positions = g.shape[1]
        if conv == "reduce" and isinstance(modules[name], nn.Conv2d):
            a_mean, g_sum = a.mean(1), g.sum(1)
            big_a = positions * a_mean.T @ a_mean / n
            big_g = g_sum.T @ g_sum / (n * positions)
        else:  # A: sum over positions, mean over examples; G: mean over examples and positions (KFC)
            big_a = torch.einsum("npi,npj->ij", a, a) / n
            big_g = torch.einsum("npi,npj->ij", g, g) / (n * positions)
        factors[name] = (big_a, big_g)
    return factors


def grad_matrix(m: nn.Module) -> torch.Tensor:
    w = m.weight.grad.reshape(m.weight.shape[0], -1)
    return torch.cat([w, m.bias.grad[:, None]], dim=1) if m.bias is not None else w


def dense_solve(big_a: torch.Tensor, big_g: torch.Tensor, grad: torch.Tensor, damping: float) -> torch.Tensor:
    """V with (G ⊗ A + λI) vec(V) = vec(∇W), vec row-major."""
    kron = torch.kron(big_g, big_a)
    v = torch.linalg.solve(kron + damping * torch.eye(kron.shape[0], dtype=kron.dtype), grad.reshape(-1))
    return v.reshape(grad.shape)


def dense_inverse_solve(big_a, big_g, grad, damping):
    """(G + γ_G I)⁻¹ ∇W (A + γ_A I)⁻¹ as a dense Kronecker solve, π from the traces."""
    pi = math.sqrt((torch.trace(big_a) / big_a.shape[0]) / (torch.trace(big_g) / big_g.shape[0]))
    gamma_a, gamma_g = pi * math.sqrt(damping), math.sqrt(damping) / pi
    kron = torch.kron(
        big_g + gamma_g * torch.eye(big_g.shape[0], dtype=DTYPE),
        big_a + gamma_a * torch.eye(big_a.shape[0], dtype=DTYPE),
    )
    return torch.linalg.solve(kron, grad.reshape(-1)).reshape(grad.shape)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def _data(model_kind: str, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    conv = model_kind == "conv"
    x = torch.randn(*((n, 2, 9, 9) if conv else (n, 5)), generator=g, dtype=DTYPE)
    y = torch.randint(0, 4 if conv else 3, (n,), generator=g)
    return x, y


def _model(kind: str, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    return {"mlp": TinyMLP, "twins": TwinMLP, "conv": TinyConvNet}[kind](**kwargs).to(DTYPE)


def _precondition_once(model, x, y, reduction="mean", **kwargs) -> dict[str, torch.Tensor]:
    pre = KFACPreconditioner(model, inv_update_freq=1, kl_clip=None, loss_reduction=reduction, **kwargs)
    model.zero_grad()
    F.cross_entropy(model(x), y, reduction=reduction).backward()
    raw = {name: grad_matrix(m).clone() for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))}
    pre.step()
    return raw, pre


@pytest.mark.parametrize("kind", ["mlp", "conv", "twins"])
@pytest.mark.parametrize("method", ["eigen", "inverse", "newton"])
def test_preconditioned_gradient_matches_dense_solve(kind: str, method: str) -> None:
    """'newton' solves the same damped system as 'inverse' (factored Tikhonov), iterated in float64 here."""
    damping = 0.05
    model = _model(kind)
    x, y = _data(kind, 6, seed=1)
    factors = reference_factors(model, x, y)
    raw, pre = _precondition_once(model, x, y, damping=damping, method=method)
    if kind == "twins":  # fc1 and fc2 in one batched product, whichever the method
        assert [layers for layers, *_ in pre._held.batches] == [[0, 1]], method
    for i, layer in enumerate(pre.layers):
        big_a, big_g = factors[layer.name]
        assert rel_err(pre.a_factors[i], big_a) < TOL, layer.name
        assert rel_err(pre.g_factors[i], big_g) < TOL, layer.name
        solve = dense_solve if method == "eigen" else dense_inverse_solve
        want = solve(big_a, big_g, raw[layer.name], damping)
        assert rel_err(grad_matrix(layer.module), want) < TOL, (layer.name, method)


def test_conv_without_bias_matches_dense_solve() -> None:
    model = _model("conv", conv_bias=False)
    x, y = _data("conv", 5, seed=2)
    factors = reference_factors(model, x, y)
    raw, pre = _precondition_once(model, x, y, damping=0.01)
    conv = pre.layers[0]
    assert conv.a_dim == 2 * 9
    want = dense_solve(*factors["conv"], raw["conv"], 0.01)
    assert rel_err(grad_matrix(conv.module), want) < TOL


@pytest.mark.parametrize("conv_bias", [True, False])
def test_conv_reduce_matches_dense_solve(conv_bias: bool) -> None:
    model = _model("conv", conv_bias=conv_bias)
    x, y = _data("conv", 5, seed=3)
    factors = reference_factors(model, x, y, conv="reduce")
    expand = reference_factors(model, x, y)  # before K-FAC's hooks are on the model
    raw, pre = _precondition_once(model, x, y, damping=0.01, conv_approximation="reduce")
    for i, layer in enumerate(pre.layers):
        big_a, big_g = factors[layer.name]
        assert rel_err(pre.a_factors[i], big_a) < TOL, layer.name
        assert rel_err(pre.g_factors[i], big_g) < TOL, layer.name
        assert rel_err(grad_matrix(layer.module), dense_solve(big_a, big_g, raw[layer.name], 0.01)) < TOL
    assert rel_err(factors["conv"][0], expand["conv"][0]) > 1e-2  # reduce is another approximation


@pytest.mark.parametrize("kind", ["mlp", "conv"])
def test_factor_examples_take_the_factors_from_the_first_examples_and_precondition_the_whole_gradient(
    kind: str,
) -> None:
    """factor_examples=4 of 7: A and G are the reference's on x[:4] (per-example gradients of the loss over
    all 7), and the direction is the dense solve of the whole batch's gradient with those factors."""
    damping = 0.05
    model = _model(kind)
    x, y = _data(kind, 7, seed=6)
    factors = reference_factors(model, x[:4], y[:4])
    raw, pre = _precondition_once(model, x, y, damping=damping, factor_examples=4)
    for i, layer in enumerate(pre.layers):
        big_a, big_g = factors[layer.name]
        assert rel_err(pre.a_factors[i], big_a) < TOL, layer.name
        assert rel_err(pre.g_factors[i], big_g) < TOL, layer.name
        want = dense_solve(big_a, big_g, raw[layer.name], damping)
        assert rel_err(grad_matrix(layer.module), want) < TOL, layer.name
    all_examples = reference_factors(model, x, y)
    assert rel_err(pre.a_factors[0], all_examples[pre.layers[0].name][0]) > 1e-3, "the subset must make a difference"


def test_factor_examples_are_dealt_over_the_accumulated_passes() -> None:
    """Two backward passes of 5 per step, factor_examples=5 for the step: the factors are the reference's on the
    first 3 examples of the first pass and the first 2 of the second."""
    model = _model("conv")
    (x1, y1), (x2, y2) = _data("conv", 5, seed=7), _data("conv", 5, seed=8)
    factors = reference_factors(model, torch.cat([x1[:3], x2[:2]]), torch.cat([y1[:3], y2[:2]]))
    pre = KFACPreconditioner(model, inv_update_freq=1, kl_clip=None, backward_passes_per_step=2, factor_examples=5)
    model.zero_grad()
    for x, y in ((x1, y1), (x2, y2)):
        (F.cross_entropy(model(x), y) / 2).backward()
    pre.step()
    for i, layer in enumerate(pre.layers):
        big_a, big_g = factors[layer.name]
        assert rel_err(pre.a_factors[i], big_a) < TOL, layer.name
        assert rel_err(pre.g_factors[i], big_g) < TOL, layer.name


@pytest.mark.parametrize(("total", "world", "passes", "want"), [
    (512, 1, 1, [[512]]), (512, 2, 1, [[256], [256]]), (5, 2, 1, [[3], [2]]), (5, 1, 2, [[3, 2]]),
    (7, 2, 2, [[2, 2], [2, 1]]), (2, 4, 1, [[1], [1], [1], [1]]),
])
def test_factor_examples_are_dealt_over_ranks_and_passes_as_micro_batches_are(
        total: int, world: int, passes: int, want: list[list[int]]) -> None:
    """The budget is the step's: shares add up to it (at least one example a slot), and one rank with k passes
    takes what k ranks with one pass take, slot for slot."""
    got = [examples_per_pass(total, rank, world, passes) for rank in range(world)]
    assert got == want
    assert sum(map(sum, got)) == max(total, world * passes)
    flat = [n for shares in got for n in shares]
    assert flat == [examples_per_pass(total, s, world * passes, 1)[0] for s in range(world * passes)]


def test_sum_reduction_gives_the_same_factors_as_mean() -> None:
    """Per-example gradients do not depend on how the loss was reduced."""
    x, y = _data("conv", 6, seed=3)
    _, mean_pre = _precondition_once(_model("conv"), x, y, reduction="mean")
    _, sum_pre = _precondition_once(_model("conv"), x, y, reduction="sum")
    for a_mean, a_sum, g_mean, g_sum in zip(
        mean_pre.a_factors, sum_pre.a_factors, mean_pre.g_factors, sum_pre.g_factors, strict=False
    ):
        assert rel_err(a_sum, a_mean) < TOL
        assert rel_err(g_sum, g_mean) < TOL


def test_running_average_and_kl_clip_follow_the_formulas() -> None:
    """Two steps: F = ξF₁ + (1−ξ)F₂, then every direction is scaled by min(1, sqrt(c / Σ lr²|v·g|))."""
    decay, damping, lr, kl_clip = 0.7, 0.02, 0.3, 1e-4
    model = _model("mlp")
    batches = [_data("mlp", 6, seed=s) for s in (4, 5)]
    refs = [reference_factors(model, x, y) for x, y in batches]  # the model does not change in between
    pre = KFACPreconditioner(model, inv_update_freq=1, damping=damping, factor_decay=decay, kl_clip=kl_clip, lr=lr)
    for x, y in batches:
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        raw = {layer.name: grad_matrix(layer.module).clone() for layer in pre.layers}
        pre.step()
    directions, vg = {}, 0.0
    for layer in pre.layers:
        big_a = decay * refs[0][layer.name][0] + (1 - decay) * refs[1][layer.name][0]
        big_g = decay * refs[0][layer.name][1] + (1 - decay) * refs[1][layer.name][1]
        directions[layer.name] = dense_solve(big_a, big_g, raw[layer.name], damping)
        vg += float((directions[layer.name] * raw[layer.name]).sum()) * lr**2
    nu = min(1.0, math.sqrt(kl_clip / vg))
    assert nu < 1.0, "the test should exercise the clip"
    for layer in pre.layers:
        assert rel_err(grad_matrix(layer.module), nu * directions[layer.name]) < TOL
