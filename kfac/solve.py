"""The damped Kronecker solve that turns a layer's gradient into its preconditioned gradient.

Two solves, both for a gradient matrix ∇W of shape (out, in) with factors G (out x out) and A (in x in)
(kfac.methods holds the methods that compute their decompositions):

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
from collections.abc import Sequence

import torch
from torch import Tensor

Decomposition = tuple[Tensor, ...]

# How a decomposition was obtained when the plain float32 eigh failed (see robust_eigen_decomposition).
RECOVERIES = ("float64_retry", "extra_damping", "kept_previous", "diagonal")
EXTRA_DAMPING = 1e-6  # relative to the factor's mean eigenvalue (its mean diagonal)


def eigen_decomposition(factor: Tensor, dtype: torch.dtype) -> Decomposition:
    """(Q, d) of a symmetric factor in ``dtype`` (float32 at least), eigenvalues clamped at 0."""
    work_dtype = torch.promote_types(dtype, torch.float32)
    eigenvalues, eigenvectors = torch.linalg.eigh(factor.to(work_dtype))
    return eigenvectors, eigenvalues.clamp_(min=0.0)


def eigen_decompositions(factors: Sequence[Tensor], dtype: torch.dtype) -> list[Decomposition] | None:
    """(Q, d) of several factors of one size with one batched eigh (one launch and one check on a GPU).

    None when the batch fails: the caller then decomposes them one by one with the recovery ladder.
    """
    work_dtype = torch.promote_types(dtype, torch.float32)
    try:
        eigenvalues, eigenvectors = torch.linalg.eigh(torch.stack([f.to(work_dtype) for f in factors]))
    except RuntimeError:  # torch.linalg.LinAlgError: some member did not converge
        return None
    eigenvalues.clamp_(min=0.0)
    return list(zip(eigenvectors.unbind(0), eigenvalues.unbind(0), strict=False))


def robust_eigen_decomposition(
    factor: Tensor, dtype: torch.dtype, previous: Decomposition | None
) -> tuple[Decomposition, str | None]:
    """(Q, d) as :func:`eigen_decomposition`, never raising: returns the decomposition and how it was recovered.

    LAPACK's and cuSOLVER's symmetric eigensolvers can fail to converge on a singular factor with
    a large cluster of zero eigenvalues (a ResNet-50 layer4 conv on a batch of 2: A of size 4,608
    and rank 2). The ladder: float64 (the iteration that failed in float32 converges there in
    practice); then the factor plus a tiny multiple of its mean eigenvalue on the diagonal (which
    separates the clustered eigenvalues; the eigenvalues keep that extra damping); then the
    previous decomposition; with none, the diagonal approximation (Q = I, d = diag F). The
    second element names the recovery (one of :data:`RECOVERIES`), None when eigh just worked.
    """
    work_dtype = torch.promote_types(dtype, torch.float32)
    try:
        return eigen_decomposition(factor, work_dtype), None
    except RuntimeError:
        pass
    if work_dtype != torch.float64:
        try:
            vectors, values = eigen_decomposition(factor, torch.float64)
            return (vectors.to(work_dtype), values.to(work_dtype)), "float64_retry"
        except RuntimeError:
            pass
    wide = factor.to(torch.float64)
    shift = EXTRA_DAMPING * max(float(wide.diagonal().mean()), torch.finfo(torch.float32).tiny)
    try:
        vectors, values = eigen_decomposition(
            wide + shift * torch.eye(wide.shape[0], dtype=wide.dtype, device=wide.device), torch.float64
        )
        return (vectors.to(work_dtype), values.to(work_dtype)), "extra_damping"
    except RuntimeError:
        pass
    if previous is not None:
        return previous, "kept_previous"
    eye = torch.eye(factor.shape[0], dtype=work_dtype, device=factor.device)
    return (eye, factor.diagonal().to(work_dtype).clamp(min=0.0)), "diagonal"


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
    # not numerically positive definite: fall back to a general inverse
    inverse = torch.linalg.inv(damped) if int(info) != 0 else torch.cholesky_inverse(lower)
    # Exactly symmetric (x_ij + x_ji rounds as x_ji + x_ij; a no-op where it already is), so that its upper
    # triangle is all of it: what ranks share (kfac.methods.Inverse.to_wire) is then lossless.
    return ((inverse + inverse.mT) / 2,)


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


def kl_clip_scale_tensor(vg_sum: Tensor, kl_clip: float) -> Tensor:
    """:func:`kl_clip_scale` on the device: a 0-dim tensor, no host read (the step stays asynchronous)."""
    usable = torch.isfinite(vg_sum) & (vg_sum > 0)
    safe = torch.where(usable, vg_sum, torch.ones_like(vg_sum))
    return torch.where(usable, torch.clamp(torch.sqrt(kl_clip / safe), max=1.0), torch.ones_like(vg_sum))
