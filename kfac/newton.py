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

The residual is computed in the working precision (float32 at least) from the same product the next
step uses, so checking it costs nothing extra; one host read per step tells which factors are done,
for all sizes at once (:func:`newton_inverses_by_size`). An accepted X is symmetrised, (X + Xᵀ)/2.
With ``tf32`` (on CUDA; on a CPU only its switch-over logic runs, the products stay IEEE) the steps
run with TF32 products until the residual is below TF32_UNTIL or stops falling, then in full float32
to reach ``tol``: TF32's rounding (about 5e-4) alone floors ‖R‖ near 5e-4·cond(M), too coarse to
accept for K-FAC's damped factors, but Newton–Schulz corrects its own errors, so the float32 steps
that follow start from wherever TF32 left off.
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


class _Stack:
    """The factors of one size being inverted: M, the iterates X, which members still iterate, and their outcomes."""

    def __init__(self, factors: Sequence[Tensor], gammas: Sequence[float], previous: Sequence[Tensor | None],
                 work: torch.dtype, phase: str) -> None:
        self.n, self.device, self.phase = factors[0].shape[-1], factors[0].device, phase
        damping = torch.tensor(list(gammas), dtype=work, device=self.device)
        self.m = torch.stack([f.to(work) for f in factors])
        self.m.diagonal(dim1=-2, dim2=-1).add_(damping.unsqueeze(-1))
        # Cold starts for all, replaced by the previous inverse where that is close enough (see warm_start).
        scale = 2.0 / (torch.linalg.matrix_norm(self.m) + damping)
        self.x = torch.eye(self.n, dtype=work, device=self.device) * scale.view(-1, 1, 1)
        self.warm = [False] * len(factors)
        self.candidates = [(k, p.to(work)) for k, p in enumerate(previous)
                           if p is not None and p.shape == self.m[k].shape]
        self.active = list(range(len(factors)))
        self.best = [float("inf")] * len(factors)
        self.outcomes: list[Outcome | None] = [None] * len(factors)
        self.r: Tensor | None = None

    def warm_measures(self) -> Tensor:
        """Per previous inverse, ‖I − M X_prev‖_F and ‖M X_prev‖_∞ (to be read on the host with the other sizes')."""
        if not self.candidates:
            return self.m.new_zeros(0)
        index = torch.tensor([k for k, _ in self.candidates], device=self.device)
        with _matmul_precision("ieee", self.device):
            products = torch.bmm(self.m[index], torch.stack([p for _, p in self.candidates]))  # eig(P) > 0, real
        residuals = torch.linalg.matrix_norm(_identity_like(products) - products)
        return torch.cat([residuals, torch.linalg.matrix_norm(products, ord=float("inf"))])

    def warm_start(self, measures: list[float]) -> None:
        """X_prev where ‖R‖_F < 1; c X_prev with c = 1/‖P‖_∞ (c·eig(P) in (0, 1]: converges) where it is further
        off, unless X_prev is worse than X = 0 (‖R‖_F above ‖I‖_F = √n): the cold start took fewer steps there."""
        residuals, row_sums = measures[: len(self.candidates)], measures[len(self.candidates) :]
        for (k, candidate), residual, row_sum in zip(self.candidates, residuals, row_sums, strict=True):
            if residual < 1.0:  # also False for NaN
                self.x[k], self.warm[k] = candidate, True
            elif residual < math.sqrt(self.n) and 0.0 < row_sum < float("inf"):
                self.x[k], self.warm[k] = candidate / row_sum, True
        self.candidates = []

    def residual_norms(self) -> Tensor:
        """‖I − M X‖_F of the active members (R kept for the next step)."""
        index = torch.tensor(self.active, device=self.device)
        with _matmul_precision(self.phase, self.device):
            self.r, norms = _residual(self.m[index], self.x[index])
        return norms

    def advance(self, norms: list[float], step: int, tol: float, max_iters: int) -> None:
        """Settle the members that converged, stalled or ran out of steps; one Newton–Schulz step for the rest."""
        assert self.r is not None
        xa = self.x[torch.tensor(self.active, device=self.device)]
        keep, switch = [], False
        for j, (k, norm) in enumerate(zip(self.active, norms, strict=True)):
            finite = norm == norm and norm != float("inf")
            if self.phase == "tf32" and finite and (norm <= TF32_UNTIL or not norm < self.best[k]):
                switch = True  # TF32's residual is too coarse to accept: polish in full float32
                keep.append(j)
            elif self.phase == "ieee" and norm <= tol:
                self.outcomes[k] = Outcome((xa[j] + xa[j].mT) / 2, step, self.warm[k], norm)
            elif not norm < self.best[k] or step == max_iters:  # stalled at the rounding floor, NaN, or out of steps
                self.outcomes[k] = Outcome(None, step, self.warm[k], norm)
            else:
                keep.append(j)
            if finite:
                self.best[k] = min(self.best[k], norm)
        self.active = [self.active[j] for j in keep]
        if keep:
            kept = torch.tensor(keep, device=self.device)
            xa, r = xa[kept], self.r[kept]
            with _matmul_precision(self.phase, self.device):
                self.x[torch.tensor(self.active, device=self.device)] = xa + torch.bmm(xa, r)
        self.r = None
        if switch:
            self.phase = "ieee"
            for k in self.active:
                self.best[k] = float("inf")  # the float32 residual starts its own descent


def _read(tensors: list[Tensor]) -> list[list[float]]:
    """Every tensor's values on the host with one read (one wait for the device)."""
    if not tensors:
        return []
    flat = torch.cat([t.to(tensors[0].device, torch.float64) for t in tensors]).tolist()
    parts, offset = [], 0
    for t in tensors:
        parts.append(flat[offset : offset + t.numel()])
        offset += t.numel()
    return parts


def newton_inverses_by_size(
    groups: Sequence[tuple[Sequence[Tensor], Sequence[float], Sequence[Tensor | None]]],
    dtype: torch.dtype,
    tol: float | None = None,
    max_iters: int = MAX_ITERS,
    tf32: bool = False,
) -> list[list[Outcome]]:
    """:func:`newton_inverses` of several groups of one size each, stepped in lockstep: each step reads all
    groups' residuals back at once, so a model with many factor sizes waits for the device once a step."""
    work = torch.promote_types(dtype, torch.float32)
    tol = DEFAULT_TOL.get(work, DEFAULT_TOL[torch.float32]) if tol is None else tol
    stacks = [_Stack(factors, gammas, previous, work, "tf32" if tf32 else "ieee")  # CPU products stay IEEE
              for factors, gammas, previous in groups]
    for stack, measures in zip(stacks, _read([s.warm_measures() for s in stacks]), strict=True):
        stack.warm_start(measures)
    for step in range(max_iters + 1):
        live = [s for s in stacks if s.active]
        if not live:
            break
        for stack, norms in zip(live, _read([s.residual_norms() for s in live]), strict=True):
            stack.advance(norms, step, tol, max_iters)
    return [[o or Outcome(None, max_iters, s.warm[k], float("nan")) for k, o in enumerate(s.outcomes)] for s in stacks]


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
    return newton_inverses_by_size([(factors, gammas, previous)], dtype, tol, max_iters, tf32)[0]
