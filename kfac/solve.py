"""The damped Kronecker solve that turns a layer's gradient into its preconditioned gradient.

Two methods, both for a gradient matrix ∇W of shape (out, in) with factors G (out x out) and
A (in x in):

- eigen (default): with A = Q_A diag(d_A) Q_Aᵀ and G = Q_G diag(d_G) Q_Gᵀ,
  V = Q_G [(Q_Gᵀ ∇W Q_A) / (d_G d_Aᵀ + λ)] Q_Aᵀ, the exact solve (G ⊗ A + λI) vec(V) = vec(∇W)
  for row-major vec. Damping is applied at preconditioning time, so it can change every step.
- inverse: V = (G + γ_G I)⁻¹ ∇W (A + γ_A I)⁻¹ with Martens & Grosse's factored Tikhonov damping
  γ_A = π √λ, γ_G = √λ / π, π² = (tr A / dim A) / (tr G / dim G). Damping is baked into the
  inverses when they are computed.

A decomposition is a tuple of tensors, so that it can be packed into one buffer and broadcast.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

Decomposition = tuple[Tensor, ...]
METHODS = ("eigen", "inverse")


def eigen_decomposition(factor: Tensor, dtype: torch.dtype) -> Decomposition:
    """(Q, d) of a symmetric factor in ``dtype`` (float32 at least), eigenvalues clamped at 0."""
    work_dtype = torch.promote_types(dtype, torch.float32)
    eigenvalues, eigenvectors = torch.linalg.eigh(factor.to(work_dtype))
    return eigenvectors, eigenvalues.clamp_(min=0.0)


def eigen_shapes(n: int) -> tuple[tuple[int, ...], ...]:
    return ((n, n), (n,))


def eigen_denominator(da: Tensor, dg: Tensor, damping: float) -> Tensor:
    """d_G d_Aᵀ + λ: the eigenvalues of G ⊗ A + λI arranged like the gradient matrix (batched too)."""
    return (dg.unsqueeze(-1) * da.unsqueeze(-2)).add_(damping)


def precondition_eigen(grad: Tensor, a: Decomposition, g: Decomposition, denominator: Tensor) -> Tensor:
    """Q_G [(Q_Gᵀ ∇W Q_A) / (d_G d_Aᵀ + λ)] Q_Aᵀ, the denominator from :func:`eigen_denominator`.

    Also for a stack of layers of one shape: every tensor then has a leading batch dimension.
    """
    qa, _ = a
    qg, _ = g
    rotated = qg.mT @ grad.to(qa.dtype) @ qa
    rotated /= denominator
    return qg @ rotated @ qa.mT


def tikhonov_pi(a_factor: Tensor, g_factor: Tensor) -> float:
    """π of factored Tikhonov damping: balances the damping between the two factors by their mean eigenvalue."""
    a_mean = float(torch.trace(a_factor)) / a_factor.shape[0]
    g_mean = float(torch.trace(g_factor)) / g_factor.shape[0]
    if a_mean <= 0.0 or g_mean <= 0.0 or not math.isfinite(a_mean / g_mean):
        return 1.0
    return math.sqrt(a_mean / g_mean)


def damped_inverse(factor: Tensor, gamma: float, dtype: torch.dtype) -> Decomposition:
    """((F + γI)⁻¹,) through a Cholesky factorisation (F is symmetric positive semi-definite)."""
    work_dtype = torch.promote_types(dtype, torch.float32)
    damped = factor.to(work_dtype) + gamma * torch.eye(factor.shape[0], dtype=work_dtype, device=factor.device)
    lower, info = torch.linalg.cholesky_ex(damped)
    if int(info) != 0:  # not numerically positive definite: fall back to a general inverse
        return (torch.linalg.inv(damped),)
    return (torch.cholesky_inverse(lower),)


def inverse_shapes(n: int) -> tuple[tuple[int, ...], ...]:
    return ((n, n),)


def precondition_inverse(grad: Tensor, a: Decomposition, g: Decomposition) -> Tensor:
    """(G + γ_G I)⁻¹ ∇W (A + γ_A I)⁻¹."""
    (a_inv,) = a
    (g_inv,) = g
    return g_inv @ grad.to(a_inv.dtype) @ a_inv


def kl_clip_scale(vg_sum: float, kl_clip: float | None) -> float:
    """min(1, sqrt(kl_clip / Σ lr² |v·g|)): shrinks the whole step when it would move the model too far."""
    if kl_clip is None or vg_sum <= 0.0 or not math.isfinite(vg_sum):
        return 1.0
    return min(1.0, math.sqrt(kl_clip / vg_sum))
