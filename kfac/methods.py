"""K-FAC's decomposition methods, one class each: what a factor's decomposition holds, how this rank computes
its share of them, and how a layer's gradient is preconditioned with a pair of them.

- :class:`Eigen` (``'eigen'``): (Q, d) per factor; the exact damped Kronecker solve (kfac.solve). On a GPU,
  small factors go to the host (``cpu_limit``, kfac.decompose).
- :class:`Inverse` (``'inverse'``): ((F + γI)⁻¹,) by Cholesky, factored Tikhonov damping (kfac.solve).
- :class:`Newton` (``'newton'``): the same inverses and damping as ``'inverse'``, by Newton–Schulz iteration
  (kfac.newton): matrix products only, batched over factors of one size, warm-started from the previous
  inverse; a factor that does not converge gets the Cholesky inverse. Nothing runs on the host.

A decomposition is a tuple of tensors (kfac.solve.Decomposition), so every method's travels, is stacked and
is checkpointed the same way. What travels between ranks is each method's wire form (``to_wire``): eigen's
tensors as they are, an inverse's upper triangle (it is exactly symmetric), half the bytes.
:data:`METHODS` maps the names ``KFACPreconditioner(method=...)`` accepts.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kfac import newton, solve
from kfac.decompose import EigenJob, Recoveries, Results, decompose_eigen
from kfac.factors import pack_upper, unpack_upper, upper_size
from kfac.workers import map_largest_first


@dataclass(frozen=True)
class FactorJob:
    """One factor to decompose: its key ((layer, 'A' or 'G')), the factor, the damping γ an inverse bakes
    in (unused by eigen), and this factor's previous decomposition (a warm start or a last resort)."""

    key: Hashable
    factor: Tensor
    gamma: float
    previous: solve.Decomposition | None


def tikhonov_gammas(a: Tensor, g: Tensor, damping: float) -> tuple[float, float]:
    """(γ_A, γ_G) = (π√λ, √λ/π) of factored Tikhonov damping (Martens & Grosse 2015, section 6.3)."""
    pi = solve.tikhonov_pi(a, g)
    return math.sqrt(damping) * pi, math.sqrt(damping) / pi


def tikhonov_gammas_of(pairs: Sequence[tuple[Tensor, Tensor]], damping: float) -> list[tuple[float, float]]:
    """:func:`tikhonov_gammas` of many layers' (A, G) with one host read (on a GPU, one wait instead of two a layer)."""
    if not pairs:
        return []
    device = pairs[0][0].device
    means = torch.stack([f.diagonal().mean().to(device, torch.float64) for pair in pairs for f in pair]).tolist()
    root = math.sqrt(damping)
    gammas = []
    for a_mean, g_mean in zip(means[0::2], means[1::2], strict=True):
        usable = a_mean > 0.0 and g_mean > 0.0 and math.isfinite(a_mean / g_mean)
        pi = math.sqrt(a_mean / g_mean) if usable else 1.0
        gammas.append((root * pi, root / pi))
    return gammas


class Eigen:
    name = "eigen"
    needs_gamma = False
    # Whether a decomposition depends on the previous one (a warm start): then a checkpoint must carry the
    # decompositions themselves, since recomputing one from its factors alone would not reproduce it bit for bit.
    warm_starts = False

    def wire_shapes(self, n: int) -> tuple[tuple[int, ...], ...]:
        """The shapes of an n x n factor's decomposition as it travels between ranks."""
        return solve.eigen_shapes(n)

    @staticmethod
    def to_wire(decomposition: solve.Decomposition) -> solve.Decomposition:
        return decomposition

    @staticmethod
    def from_wire(tensors: Sequence[Tensor], n: int) -> solve.Decomposition:
        return tuple(tensors)

    def decompose(self, jobs: Sequence[FactorJob], dtype: torch.dtype, cpu_limit: int) -> tuple[Results, Recoveries]:
        eigen_jobs = [EigenJob(job.key, job.factor, job.previous) for job in jobs]
        return decompose_eigen(eigen_jobs, dtype, cpu_limit)


class Inverse:
    name = "inverse"
    needs_gamma = True
    warm_starts = False

    def wire_shapes(self, n: int) -> tuple[tuple[int, ...], ...]:
        """An inverse travels as its upper triangle: n(n+1)/2 numbers."""
        return ((upper_size(n),),)

    @staticmethod
    def to_wire(decomposition: solve.Decomposition) -> solve.Decomposition:
        (inverse,) = decomposition
        return (pack_upper(inverse),)

    @staticmethod
    def from_wire(tensors: Sequence[Tensor], n: int) -> solve.Decomposition:
        (upper,) = tensors
        return (unpack_upper(upper, n),)

    def decompose(self, jobs: Sequence[FactorJob], dtype: torch.dtype, cpu_limit: int) -> tuple[Results, Recoveries]:
        on_cpu = all(job.factor.device.type == "cpu" for job in jobs)
        outcomes = map_largest_first(
            lambda job: robust_damped_inverse(job.factor, job.gamma, dtype, job.previous),
            jobs, [float(job.factor.shape[0]) ** 3 for job in jobs], on_cpu)
        results: Results = {}
        recoveries: Recoveries = {}
        for job, (inverse, recovery) in zip(jobs, outcomes, strict=True):
            results[job.key] = inverse
            if recovery is not None:
                recoveries[job.key] = recovery
        return results, recoveries

    @staticmethod
    def precondition(grad: Tensor, a: solve.Decomposition, g: solve.Decomposition) -> Tensor:
        return solve.precondition_inverse(grad, a, g)


@dataclass
class Newton(Inverse):
    """Newton–Schulz inverses; ``counts`` says how they went on this rank (for ``pre.stats``)."""

    name = "newton"
    warm_starts = True
    tol: float | None = None
    max_iters: int = newton.MAX_ITERS
    tf32: bool = False
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def decompose(self, jobs: Sequence[FactorJob], dtype: torch.dtype, cpu_limit: int) -> tuple[Results, Recoveries]:
        """All on the factors' device, one stack per size, the sizes in lockstep; ``cpu_limit`` is eigen's and does
        not apply."""
        by_size: dict[int, list[FactorJob]] = defaultdict(list)
        for job in jobs:
            by_size[job.factor.shape[0]].append(job)
        results: Results = {}
        recoveries: Recoveries = {}
        groups = list(by_size.values())
        all_outcomes = newton.newton_inverses_by_size(
            [([job.factor for job in group], [job.gamma for job in group],
              [None if job.previous is None else job.previous[0] for job in group]) for group in groups],
            dtype, self.tol, self.max_iters, self.tf32)
        for group, outcomes in zip(groups, all_outcomes, strict=True):
            for job, outcome in zip(group, outcomes, strict=True):
                self.counts["warm" if outcome.warm else "cold"] += 1
                self.counts["iterations"] += outcome.iterations
                if outcome.inverse is not None:
                    results[job.key] = (outcome.inverse,)
                    continue
                self.counts["cholesky"] += 1  # not converged: the exact inverse instead
                results[job.key], recovery = robust_damped_inverse(job.factor, job.gamma, dtype, job.previous)
                if recovery is not None:
                    recoveries[job.key] = recovery
        return results, recoveries


def robust_damped_inverse(
    factor: Tensor, gamma: float, dtype: torch.dtype, previous: solve.Decomposition | None
) -> tuple[solve.Decomposition, str | None]:
    """((F + γI)⁻¹,) by Cholesky, never raising and never non-finite: a factor that gives no finite inverse
    (non-finite entries, or not positive semi-definite by more than γ) keeps its previous inverse
    ('kept_previous'), or with none gets the diagonal approximation's ('diagonal', non-finite entries taken as 0).
    """
    try:
        inverse = solve.damped_inverse(factor, gamma, dtype)
        if bool(torch.isfinite(inverse[0]).all()):
            return inverse, None
    except RuntimeError:  # torch.linalg.LinAlgError: singular even with the damping
        pass
    if previous is not None and bool(torch.isfinite(previous[0]).all()):
        return previous, "kept_previous"
    work = torch.promote_types(dtype, torch.float32)
    diagonal = torch.nan_to_num(factor.diagonal().to(work), nan=0.0, posinf=0.0, neginf=0.0).clamp(min=0.0)
    return (torch.diag(1.0 / (diagonal + gamma)),), "diagonal"


METHODS: dict[str, type[Eigen] | type[Inverse]] = {"eigen": Eigen, "inverse": Inverse, "newton": Newton}
