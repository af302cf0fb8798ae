"""Damped inverses (F + γI)⁻¹ by Newton–Schulz iteration: matrix products only, batched over factors of one size.

Why: an eigendecomposition or a Cholesky factorisation on a GPU runs on few threads and none of the
matrix units, and K-FAC's step on a GPU is mostly that (issue 44). Newton–Schulz needs nothing but
products, which the matrix units do at hundreds of TFLOP/s, and factors of one size go through as
one stacked tensor (``bmm``).

With M = F + γI (symmetric positive definite for γ > 0) and R = I − M X, the step X ← X + X R
(= X(2I − M X)) squares the residual: R_{k+1} = R_k². It converges whenever ‖R₀‖ < 1 in some
norm, and ‖R‖_F ≥ ‖R‖₂ bounds the relative error of X, since X − M⁻¹ = −M⁻¹R.

- Warm start from the previous inverse of the same factor (the factors move slowly between updates):
  X_prev itself when ‖I − M X_prev‖_F < 1, else c·X_prev with c = 1/‖M X_prev‖_∞. M X_prev has positive
  real eigenvalues (a product of two positive definite matrices), all at most its ∞-norm, so the
  residual's eigenvalues lie in [0, 1) and the iteration converges, in steps that grow with the
  condition of M X_prev (near 1 when the factor moved little) rather than with that of M. A previous
  inverse worse than none (‖I − M X_prev‖_F > ‖I‖_F = √n) is dropped for the cold start: on the real
  factors of tests/kfac/test_kfac_newton.py that was the one case where the scaled start took more steps.
- Cold start: X₀ = αI with α = 2 / (‖M‖_F + γ). The eigenvalues of M lie in [γ, ‖M‖_F], so those of
  R₀ = I − αM lie in (−1, 1): convergence is guaranteed, in about log₂(‖M‖_F / γ) + 5 steps.
- Each factor stops once ‖R‖_F ≤ ``tol``. One whose residual stops falling first (the rounding
  floor of its precision), turns non-finite, or is still above ``tol`` after ``max_iters`` steps
  is handed back unconverged: the caller falls back to the exact Cholesky inverse for it.

The residual is computed in the working precision (float32 at least) from the same product the
next step uses, so checking it costs nothing extra; one host read per step tells which factors
are done. An accepted X is symmetrised ((X + Xᵀ)/2). With ``tf32`` (CUDA only) the steps run with
TF32 products until the residual is below TF32_UNTIL or stops falling, then in full float32 to
reach ``tol``: TF32's rounding (about 5e-4) alone floors ‖R‖ near 5e-4·cond(M), too coarse to
accept for K-FAC's damped factors, but Newton–Schulz corrects its own errors, so the float32
steps that follow start from wherever TF32 left off.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

# ‖I − M X‖_F accepted, by working precision: a relative error in X at most this, near what a float32
# (float64) Cholesky inverse of a factor conditioned like K-FAC's damped ones achieves
# (tests/kfac/test_kfac_newton.py measures both on real factors).
DEFAULT_TOL = {torch.float32: 1e-3, torch.float64: 1e-9}
MAX_ITERS = 40  # enough for cond(M) up to 2³⁵ cold; far fewer when warm
TF32_UNTIL = 1e-2  # with tf32: the residual at which the steps go on in full float32


@dataclass(frozen=True)
class Outcome:
    """One factor's result: the inverse (None when it did not converge), the steps taken, and how it started."""

    inverse: Tensor | None
    iterations: int
    warm: bool
    residual: float


@contextmanager
def _matmul_precision(value: str, device: torch.device) -> Iterator[None]:
    """cuBLAS fp32 products at ``value`` ('ieee' or 'tf32') inside the block, the caller's setting restored after."""
    if device.type != "cuda":
        yield
        return
    matmul = torch.backends.cuda.matmul
    saved = matmul.fp32_precision
    matmul.fp32_precision = value
    try:
        yield
    finally:
        matmul.fp32_precision = saved


def _identity_like(stack: Tensor) -> Tensor:
    return torch.eye(stack.shape[-1], dtype=stack.dtype, device=stack.device).expand_as(stack)


def _residual(m: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    """(R = I − M X, ‖R‖_F per member) of stacks (b, n, n)."""
    r = _identity_like(m) - torch.bmm(m, x)
    return r, torch.linalg.matrix_norm(r)


def newton_inverses(
    factors: Sequence[Tensor],
    gammas: Sequence[float],
    previous: Sequence[Tensor | None],
    dtype: torch.dtype,
    tol: float | None = None,
    max_iters: int = MAX_ITERS,
    tf32: bool = False,
) -> list[Outcome]:
    """(F_i + γ_i I)⁻¹ of factors of one size n, iterated together as one (b, n, n) stack.

    ``previous[i]``: the factor's last inverse (a warm start if close enough), or None. ``dtype``: the
    working precision (float32 at least). Unconverged factors come back with ``inverse`` None.
    """
    work = torch.promote_types(dtype, torch.float32)
    tol = DEFAULT_TOL.get(work, DEFAULT_TOL[torch.float32]) if tol is None else tol
    n = factors[0].shape[-1]
    device = factors[0].device
    m = torch.stack([f.to(work) for f in factors])
    m.diagonal(dim1=-2, dim2=-1).add_(torch.tensor(list(gammas), dtype=work, device=device).unsqueeze(-1))

    # Cold starts for all, replaced by the previous inverse where that is close enough.
    scale = 2.0 / (torch.linalg.matrix_norm(m) + torch.tensor(list(gammas), dtype=work, device=device))
    x = torch.eye(n, dtype=work, device=device) * scale.view(-1, 1, 1)
    warm_members = [k for k, p in enumerate(previous) if p is not None and p.shape == (n, n)]
    warm = [False] * len(factors)
    if warm_members:
        index = torch.tensor(warm_members, device=device)
        candidates = torch.stack([previous[k].to(work) for k in warm_members])  # type: ignore[union-attr]
        with _matmul_precision("ieee", device):
            products = torch.bmm(m[index], candidates)  # P = M X_prev: positive real eigenvalues
        residuals = torch.linalg.matrix_norm(_identity_like(products) - products).tolist()
        # Where X_prev itself is too far off, c X_prev with c = 1/‖P‖_∞ still converges (c·eig(P) in (0, 1]);
        # unless X_prev is worse than X = 0 (‖R‖_F above ‖I‖_F = √n): then the cold start took fewer steps.
        row_sums = torch.linalg.matrix_norm(products, ord=float("inf")).tolist()
        for j, k in enumerate(warm_members):
            if residuals[j] < 1.0:  # also False for NaN
                x[k], warm[k] = candidates[j], True
            elif residuals[j] < math.sqrt(n) and 0.0 < row_sums[j] < float("inf"):
                x[k], warm[k] = candidates[j] / row_sums[j], True

    outcomes: list[Outcome | None] = [None] * len(factors)
    active = list(range(len(factors)))
    best = [float("inf")] * len(factors)
    phase = "tf32" if tf32 and device.type == "cuda" else "ieee"
    for step in range(max_iters + 1):
        ma, xa = m[torch.tensor(active, device=device)], x[torch.tensor(active, device=device)]
        with _matmul_precision(phase, device):
            r, norms = _residual(ma, xa)
        keep, switch = [], False
        for j, (k, norm) in enumerate(zip(active, norms.tolist(), strict=True)):
            finite = norm == norm and norm != float("inf")
            if phase == "tf32" and finite and (norm <= TF32_UNTIL or not norm < best[k]):
                switch = True  # TF32's residual is too coarse to accept: polish in full float32
                keep.append(j)
            elif phase == "ieee" and norm <= tol:
                outcomes[k] = Outcome((xa[j] + xa[j].mT) / 2, step, warm[k], norm)
            elif not norm < best[k] or step == max_iters:  # stalled at the rounding floor, NaN, or out of steps
                outcomes[k] = Outcome(None, step, warm[k], norm)
            else:
                keep.append(j)
            if finite:
                best[k] = min(best[k], norm)
        if not keep:
            break
        kept = torch.tensor(keep, device=device)
        xa, r = xa[kept], r[kept]
        active = [active[j] for j in keep]
        with _matmul_precision(phase, device):
            x[torch.tensor(active, device=device)] = xa + torch.bmm(xa, r)
        if switch:
            phase = "ieee"
            for k in active:
                best[k] = float("inf")  # the float32 residual starts its own descent
    return [o if o is not None else Outcome(None, max_iters, warm[k], float("nan")) for k, o in enumerate(outcomes)]
