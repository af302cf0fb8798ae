"""The damped Kronecker solves against dense linear algebra."""

from __future__ import annotations

import math

import pytest
import torch

from kfac import solve


def _spd(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3 * n, n, generator=g, dtype=torch.float64)
    return x.T @ x / (3 * n)


def test_eigen_direction_is_the_dense_kronecker_solve() -> None:
    a, g, grad, damping = _spd(5, 0), _spd(3, 1), torch.randn(3, 5, dtype=torch.float64), 0.1
    ea, eg = solve.eigen_decomposition(a, torch.float64), solve.eigen_decomposition(g, torch.float64)
    got = solve.precondition_eigen(grad, ea, eg, solve.eigen_denominator(ea[1], eg[1], damping))
    dense = torch.kron(g, a) + damping * torch.eye(15, dtype=torch.float64)
    torch.testing.assert_close(got, torch.linalg.solve(dense, grad.reshape(-1)).reshape(3, 5))


def test_inverse_direction_uses_factored_tikhonov_damping() -> None:
    a, g, grad, damping = _spd(4, 2), 10 * _spd(3, 3), torch.randn(3, 4, dtype=torch.float64), 0.05
    pi = solve.tikhonov_pi(a, g)
    assert pi == pytest.approx(math.sqrt((a.trace() / 4) / (g.trace() / 3)))
    a_inv = solve.damped_inverse(a, pi * math.sqrt(damping), torch.float64)
    g_inv = solve.damped_inverse(g, math.sqrt(damping) / pi, torch.float64)
    got = solve.precondition_inverse(grad, a_inv, g_inv)
    want = (
        torch.linalg.inv(g + math.sqrt(damping) / pi * torch.eye(3, dtype=torch.float64))
        @ grad
        @ torch.linalg.inv(a + pi * math.sqrt(damping) * torch.eye(4, dtype=torch.float64))
    )
    torch.testing.assert_close(got, want)


def test_eigenvalues_are_clamped_at_zero_and_at_least_float32() -> None:
    q = torch.linalg.qr(torch.randn(3, 3, dtype=torch.float64))[0]
    factor = q @ torch.diag(torch.tensor([-1e-3, 0.0, 2.0], dtype=torch.float64)) @ q.T
    vectors, values = solve.eigen_decomposition(factor.half(), torch.float16)
    assert values.dtype == torch.float32 and vectors.dtype == torch.float32
    assert values.min() >= 0.0


def test_kl_clip_scale() -> None:
    assert solve.kl_clip_scale(4.0, 1.0) == 0.5
    assert solve.kl_clip_scale(0.5, 1.0) == 1.0
    assert solve.kl_clip_scale(4.0, None) == 1.0
    assert solve.kl_clip_scale(0.0, 1.0) == 1.0
