"""kfac.held: the directions a rank computes with the decompositions it holds, against the dense solve, stacked
(layers of one shape in one batched product) or one by one."""

from __future__ import annotations

import torch

from kfac import solve
from kfac.held import HeldDecompositions
from kfac.methods import Eigen, Inverse

SHAPES = [(4, 3), (5, 2), (4, 3)]  # (a_dim, g_dim) per layer: layers 0 and 2 have one shape


def _spd(n: int, generator: torch.Generator) -> torch.Tensor:
    x = torch.randn(n + 3, n, generator=generator, dtype=torch.float64)
    return x.T @ x / (n + 3)


def _setup(method):
    generator = torch.Generator().manual_seed(0)
    factors = [(_spd(a, generator), _spd(g, generator)) for a, g in SHAPES]
    grads = {i: torch.randn(g, a, generator=generator, dtype=torch.float64) for i, (a, g) in enumerate(SHAPES)}
    if isinstance(method, Inverse):
        pairs = {i: (solve.damped_inverse(a, 0.1, torch.float64), solve.damped_inverse(g, 0.2, torch.float64))
                 for i, (a, g) in enumerate(factors)}
    else:
        pairs = {i: (solve.eigen_decomposition(a, torch.float64), solve.eigen_decomposition(g, torch.float64))
                 for i, (a, g) in enumerate(factors)}
    return factors, grads, pairs


def _dense_eigen(a: torch.Tensor, g: torch.Tensor, grad: torch.Tensor, damping: float) -> torch.Tensor:
    """(G ⊗ A + λI)⁻¹ vec(grad), grad's rows indexed by G and columns by A."""
    n = a.shape[0] * g.shape[0]
    return torch.linalg.solve(torch.kron(g, a) + damping * torch.eye(n, dtype=a.dtype), grad.reshape(-1)).reshape(
        grad.shape)


def test_eigen_directions_equal_the_dense_solve_stacked_and_alone() -> None:
    factors, grads, pairs = _setup(Eigen())
    held = HeldDecompositions(3, Eigen())
    held.install([0, 1, 2], pairs)
    assert held.decomposed == [True] * 3 and [layers for layers, *_ in held.batches] == [[0, 2]]
    stack = held.batches[0][1][0]
    assert held.pairs[2][0][0].data_ptr() == stack[1].data_ptr()  # a layer's decomposition is a view of its stack
    for damping in (0.01, 0.3):  # a new damping is not served from the kept denominators
        directions = held.directions(grads, damping, lambda i: True)
        assert sorted(directions) == [0, 1, 2]
        for i, (a, g) in enumerate(factors):
            torch.testing.assert_close(directions[i], _dense_eigen(a, g, grads[i], damping), rtol=1e-9, atol=1e-9)


def test_inverse_directions_equal_the_product_of_the_damped_inverses() -> None:
    factors, grads, pairs = _setup(Inverse())
    held = HeldDecompositions(3, Inverse())
    held.install([0, 1, 2], pairs)
    directions = held.directions(grads, 0.01, lambda i: True)
    for i, (a, g) in enumerate(factors):
        want = torch.linalg.solve(g + 0.2 * torch.eye(g.shape[0], dtype=g.dtype),
                                  torch.linalg.solve(a + 0.1 * torch.eye(a.shape[0], dtype=a.dtype), grads[i].T).T)
        torch.testing.assert_close(directions[i], want, rtol=1e-9, atol=1e-9)


def test_only_this_rank_s_layers_get_directions_and_a_stack_missing_a_gradient_goes_one_by_one() -> None:
    factors, grads, pairs = _setup(Eigen())
    held = HeldDecompositions(3, Eigen())
    held.install([0, 1, 2], pairs)
    assert sorted(held.directions(grads, 0.1, lambda i: i == 1)) == [0, 1, 2]  # the stack is computed whole
    partial = {i: grads[i] for i in (1, 2)}  # layer 0 has no gradient: its stack partner 2 goes alone
    directions = held.directions(partial, 0.1, lambda i: i == 2)
    assert sorted(directions) == [2]
    a, g = factors[2]
    torch.testing.assert_close(directions[2], _dense_eigen(a, g, grads[2], 0.1), rtol=1e-9, atol=1e-9)


def test_a_rank_marks_layers_decomposed_that_it_holds_no_decomposition_of() -> None:
    _, grads, pairs = _setup(Eigen())
    held = HeldDecompositions(3, Eigen())
    held.install([1], {})  # another rank is layer 1's grad worker
    assert held.decomposed == [False, True, False] and held.pairs == [None, None, None]
    held.install([0, 2], {0: pairs[0], 2: pairs[2]})
    assert held.directions({1: grads[1]}, 0.1, lambda i: i != 1) == {}
    held.clear()
    assert held.decomposed == [False] * 3 and held.pairs == [None] * 3 and held.batches == []
