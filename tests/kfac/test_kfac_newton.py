"""The 'newton' method against independent references, on real factors.

Factors are captured by training hpcdl's ``mnist_cnn`` on the embedded digits (upsampled to 28x28) and a CIFAR
ResNet-20 on random images through the preconditioner, at batch 64 and at batch 2 (A then has rank 2 per
position set: rank-deficient, held up by the damping alone). The reference inverse is float64 ``eigh``'s,
V diag(1/(d + γ)) Vᵀ. Tolerance: Newton–Schulz stops at ‖I − M X‖_F ≤ 1e-3 in float32, and that residual
bounds X's relative error, so the float32 inverses must be within 1e-3 of the reference (Frobenius, relative);
measured up to 6e-4 here. At the damping of 1e-5 the damped factors' condition numbers reach 1e4.
"""

from __future__ import annotations

import math
from functools import cache

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hpcdl.data.digits import load_digits
from hpcdl.training.config import parse_config
from hpcdl.training.models import build_model
from hpcdl.training.optimizers import build_preconditioner
from kfac import KFACPreconditioner, newton
from kfac.methods import FactorJob, Newton, robust_damped_inverse, tikhonov_gammas, tikhonov_gammas_of
from tests.support.kfac_models import DeepNarrow

FLOAT32_TOL = 1e-3
Sequence_ = list[list[tuple[str, torch.Tensor, torch.Tensor]]]


def _digits(n: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    train = load_digits().train
    x = F.interpolate(train.images[offset : offset + n].float() / 16.0, size=28, mode="bilinear", align_corners=False)
    return (x - 0.3) / 0.4, train.labels[offset : offset + n]


def _train(model: nn.Module, batches, steps: int) -> Sequence_:
    """Each step's (layer, A, G) after the preconditioner's update."""
    pre = KFACPreconditioner(model, damping=0.003, kl_clip=0.01, lr=0.1, method="inverse")  # the cheapest
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    sequence = []
    for step in range(steps):
        x, y = batches(step)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        optimizer.step()
        sequence.append([(layer.name, a.clone(), g.clone())
                         for layer, a, g in zip(pre.layers, pre.a_factors, pre.g_factors, strict=True)])
    return sequence


@cache
def real_factors(source: str) -> Sequence_:
    torch.manual_seed(0)
    if source == "mnist_cnn":
        return _train(build_model("mnist_cnn", 10, 1), lambda s: _digits(64, 64 * s), 3)
    if source == "mnist_cnn_batch2":
        return _train(build_model("mnist_cnn", 10, 1), lambda s: _digits(2, 2 * s), 1)
    generator = torch.Generator().manual_seed(0)

    def images(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(8, 3, 32, 32, generator=generator), torch.randint(0, 10, (8,), generator=generator)

    return _train(build_model("resnet20", 10, 3), images, 2)


def exact_inverse(factor: torch.Tensor, gamma: float) -> torch.Tensor:
    """V diag(1/(d + γ)) Vᵀ from float64 eigh."""
    values, vectors = torch.linalg.eigh(factor.double())
    return (vectors / (values + gamma)) @ vectors.T


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def _damped(sequence: Sequence_, damping: float, step: int = -1, every_layer: bool = False):
    """(label, factor, γ) of each factor at ``step``; one layer per shape unless ``every_layer`` (resnet20's
    repeated blocks add time, not cases)."""
    shapes = set()
    for name, a, g in sequence[step]:
        if not every_layer and (a.shape[0], g.shape[0]) in shapes:
            continue
        shapes.add((a.shape[0], g.shape[0]))
        gamma_a, gamma_g = tikhonov_gammas(a, g, damping)
        yield f"{name} A", a, gamma_a
        yield f"{name} G", g, gamma_g


@pytest.mark.parametrize("damping", [0.003, 1e-5])
@pytest.mark.parametrize("source", ["mnist_cnn", "mnist_cnn_batch2", "resnet20"])
def test_newton_inverses_of_real_factors_match_float64_eigh(source: str, damping: float) -> None:
    factors = list(_damped(real_factors(source), damping))
    if source == "mnist_cnn_batch2":
        a = factors[2][1]  # features.3 A (401 x 401) from 2 images: rank-deficient
        assert int(torch.linalg.matrix_rank(a.double(), rtol=1e-6)) < a.shape[0]
    conditions = []
    for label, factor, gamma in factors:
        (outcome,) = newton.newton_inverses([factor], [gamma], [None], torch.float32)
        assert outcome.inverse is not None, f"{label} did not converge (residual {outcome.residual:.2e})"
        want = exact_inverse(factor, gamma)
        assert rel_err(outcome.inverse, want) <= FLOAT32_TOL, label
        assert rel_err(outcome.inverse, want) <= outcome.residual * 1.01 + 1e-6, label  # the residual bounds the error
        values = torch.linalg.eigvalsh(factor.double())
        conditions.append(float((values[-1] + gamma) / (values[0].clamp(min=0) + gamma)))
    if damping == 1e-5:
        assert max(conditions) > 1e3, "the small damping should give ill-conditioned factors"


def test_float64_iterations_reach_float64_accuracy() -> None:
    for label, factor, gamma in _damped(real_factors("resnet20"), 0.003):
        (outcome,) = newton.newton_inverses([factor.double()], [gamma], [None], torch.float64)
        assert outcome.inverse is not None and rel_err(outcome.inverse, exact_inverse(factor, gamma)) < 1e-8, label


def test_the_batched_path_equals_the_per_factor_path() -> None:
    """resnet20 has six 144 x 144 A factors and a dozen 16 x 16 G factors: one stack each, against one by one, and
    the sizes stepped in lockstep against each size alone."""
    by_size: dict[int, list[tuple[torch.Tensor, float]]] = {}
    for _, factor, gamma in _damped(real_factors("resnet20"), 0.003, every_layer=True):
        if factor.shape[0] <= 144:
            by_size.setdefault(factor.shape[0], []).append((factor.double(), gamma))
    stacked = [n for n, group in by_size.items() if len(group) > 2]
    assert stacked, "the model should have several factors of one size"
    # All sizes in lockstep (one host read a step) give each size's own result.
    lockstep = newton.newton_inverses_by_size(
        [([f for f, _ in by_size[n]], [g for _, g in by_size[n]], [None] * len(by_size[n])) for n in by_size],
        torch.float64)
    for n, outcomes in zip(by_size, lockstep, strict=True):
        own = newton.newton_inverses([f for f, _ in by_size[n]], [g for _, g in by_size[n]], [None] * len(by_size[n]),
                                     torch.float64)
        for a, b in zip(outcomes, own, strict=True):
            assert a.iterations == b.iterations and a.inverse is not None and b.inverse is not None
            assert torch.equal(a.inverse, b.inverse)
    for n in stacked:
        group = by_size[n]
        together = newton.newton_inverses([f for f, _ in group], [g for _, g in group], [None] * len(group),
                                          torch.float64)
        for (factor, gamma), batched in zip(group, together, strict=True):
            (alone,) = newton.newton_inverses([factor], [gamma], [None], torch.float64)
            assert batched.iterations == alone.iterations
            assert batched.inverse is not None and alone.inverse is not None
            torch.testing.assert_close(batched.inverse, alone.inverse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("source", ["mnist_cnn", "resnet20"])
def test_a_warm_start_from_the_previous_inverse_takes_fewer_steps_than_a_cold_one(source: str) -> None:
    sequence = real_factors(source)
    before, after = list(_damped(sequence, 0.003, -2)), list(_damped(sequence, 0.003, -1))
    warm_steps = cold_steps = started_warm = 0
    for (label, old, old_gamma), (_, new, new_gamma) in zip(before, after, strict=True):
        (previous,) = newton.newton_inverses([old], [old_gamma], [None], torch.float32)
        (warm,) = newton.newton_inverses([new], [new_gamma], [previous.inverse], torch.float32)
        (cold,) = newton.newton_inverses([new], [new_gamma], [None], torch.float32)
        assert not cold.warm
        started_warm += warm.warm
        assert warm.inverse is not None and rel_err(warm.inverse, exact_inverse(new, new_gamma)) <= FLOAT32_TOL, label
        assert warm.iterations <= cold.iterations, label
        warm_steps += warm.iterations
        cold_steps += cold.iterations
    assert started_warm >= len(after) - 1  # mnist_cnn's classifier.3 A moved too far at the digits' 2nd step
    assert warm_steps < cold_steps  # measured: 0.75x (mnist_cnn at its 3rd step, moving fast) and 0.23x (resnet20)


def test_a_previous_inverse_too_far_off_is_scaled_or_dropped() -> None:
    """X_prev = (3F + γI)⁻¹: 1 < ‖I − M X_prev‖_F < √n, so c·X_prev starts; X_prev = (F/100 + γI)⁻¹: worse than
    none (above √n), so the cold start does. Both converge."""
    _, factor, gamma = next(_damped(real_factors("mnist_cnn"), 0.003))
    n = factor.shape[0]
    m = factor.double() + gamma * torch.eye(n, dtype=torch.float64)
    for scale, warm in ((3.0, True), (0.01, False)):
        previous = exact_inverse(factor * scale, gamma).float()
        residual = float(torch.linalg.matrix_norm(torch.eye(n, dtype=torch.float64) - m @ previous.double()))
        assert (1 < residual < math.sqrt(n)) if warm else residual > math.sqrt(n)
        (outcome,) = newton.newton_inverses([factor], [gamma], [previous], torch.float32)
        assert outcome.warm == warm and outcome.inverse is not None
        assert rel_err(outcome.inverse, exact_inverse(factor, gamma)) <= FLOAT32_TOL


def test_the_tf32_switch_over_accepts_only_float32_residuals() -> None:
    """On a CPU the products stay IEEE, so this runs the two-phase logic alone: the switch to float32 costs one
    step at most, and what comes back is as accurate as without it."""
    for label, factor, gamma in _damped(real_factors("mnist_cnn"), 0.003):
        (plain,) = newton.newton_inverses([factor], [gamma], [None], torch.float32)
        (switched,) = newton.newton_inverses([factor], [gamma], [None], torch.float32, tf32=True)
        assert switched.inverse is not None and rel_err(switched.inverse, exact_inverse(factor, gamma)) <= FLOAT32_TOL
        assert plain.iterations <= switched.iterations <= plain.iterations + 1, label


def test_unconverged_factors_come_back_without_an_inverse() -> None:
    _, factor, gamma = list(_damped(real_factors("mnist_cnn"), 1e-5))[2]  # features.3 A, condition ~2e3
    (outcome,) = newton.newton_inverses([factor], [gamma], [None], torch.float32, max_iters=3)
    assert outcome.inverse is None and outcome.residual > 1e-3


@pytest.mark.parametrize("case", ["nan", "inf", "indefinite", "zero"])
def test_a_singular_or_non_finite_factor_never_raises_nor_gives_a_non_finite_inverse(case: str) -> None:
    """Non-finite: the diagonal approximation (non-finite entries as 0), or the previous inverse when there is one.
    Indefinite beyond the damping (not a Fisher factor; rounding can make one): Newton–Schulz stalls, and the
    Cholesky fallback's general inverse is used. Zero: (γI)⁻¹, by Newton–Schulz itself."""
    n, gamma = 12, 1e-3
    factor = {"nan": torch.full((n, n), float("nan")), "inf": torch.eye(n) * float("inf"),
              "indefinite": -torch.ones(n, n) * 1e-4, "zero": torch.zeros(n, n)}[case]  # indefinite: eigenvalue -1.2e-3
    method = Newton()
    results, recoveries = method.decompose([FactorJob((0, "A"), factor, gamma, None)], torch.float32, 0)
    (inverse,) = results[(0, "A")]
    assert torch.isfinite(inverse).all()
    if case == "zero":
        torch.testing.assert_close(inverse, torch.eye(n) / gamma, rtol=FLOAT32_TOL, atol=0)
        assert recoveries == {} and method.counts["cholesky"] == 0
        return
    assert method.counts["cholesky"] == 1
    if case == "indefinite":
        assert recoveries == {}
        return
    assert recoveries[(0, "A")] == "diagonal"
    torch.testing.assert_close(inverse, torch.eye(n) / gamma)
    previous = (torch.eye(n) * 7.0,)
    kept, how = robust_damped_inverse(factor, gamma, torch.float32, previous)
    assert how == "kept_previous" and kept is previous


def test_training_on_singular_factors_with_newton_goes_on_and_warm_starts() -> None:
    torch.manual_seed(0)
    model = DeepNarrow()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    pre = KFACPreconditioner(model, inv_update_freq=1, damping=0.01, method="newton")
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        optimizer.zero_grad()
        F.cross_entropy(model(torch.randn(2, 32, 2, 2, generator=g)), torch.randint(0, 3, (2,), generator=g)).backward()
        pre.step()
        optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    counts = pre.stats["newton"]
    assert counts["cold"] == 4 and counts["warm"] == 4 * 4  # 2 layers x (A, G): cold once, then warm
    a = pre.a_factors[0].double()
    gamma_a, _ = tikhonov_gammas(pre.a_factors[0], pre.g_factors[0], 0.01)
    (a_inverse,), _ = pre._held.pairs[0]
    assert rel_err(a_inverse, exact_inverse(a, gamma_a)) <= FLOAT32_TOL


def test_the_direction_equals_the_cholesky_inverse_methods_in_float32() -> None:
    """Same damping convention as 'inverse': the two methods' directions agree to the Newton tolerance."""
    directions = {}
    for method in ("inverse", "newton"):
        torch.manual_seed(0)
        model = build_model("mnist_cnn", 10, 1)
        pre = KFACPreconditioner(model, inv_update_freq=1, damping=0.003, kl_clip=None, method=method)
        x, y = _digits(32, 0)
        F.cross_entropy(model(x), y).backward()
        pre.step()
        directions[method] = [p.grad.clone() for p in model.parameters()]
    for got, want in zip(directions["newton"], directions["inverse"], strict=True):
        assert rel_err(got, want.double()) < 2 * FLOAT32_TOL


def test_the_train_flag_selects_the_method_and_bad_methods_are_refused() -> None:
    model = build_model("mnist_cnn", 10, 1)
    pre = build_preconditioner(parse_config(["--kfac", "--kfac-method", "newton"]), model, lambda: 0.1, None)
    assert pre.method == "newton" and isinstance(pre._method, Newton)
    assert build_preconditioner(parse_config(["--kfac"]), model, lambda: 0.1, None).method == "eigen"
    with pytest.raises(ValueError, match="method must be one of"):
        KFACPreconditioner(model, method="cholesky")
    tuned = KFACPreconditioner(model, method=Newton(tol=1e-5))
    assert tuned.method == "newton" and tuned._method.tol == 1e-5


def test_gammas_follow_factored_tikhonov_one_layer_or_many() -> None:
    a, g = torch.eye(4) * 9.0, torch.eye(2)
    gamma_a, gamma_g = tikhonov_gammas(a, g, 0.01)
    assert math.isclose(gamma_a, 0.3) and math.isclose(gamma_g, 0.1 / 3)
    pairs = [(a, g), (torch.zeros(3, 3), g), (torch.eye(2) * float("nan"), g)]  # π = 1 where it is not usable
    got = [gamma for both in tikhonov_gammas_of(pairs, 0.01) for gamma in both]
    assert got == pytest.approx([0.3, 0.1 / 3, 0.1, 0.1, 0.1, 0.1])
