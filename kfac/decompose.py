"""Where each eigendecomposition runs, and how a failed one is recovered.

On the CPU every decomposition of a rank runs in the single-threaded worker pool
(:mod:`kfac.workers`). On a GPU, small factors are faster on the host (cuSOLVER's fixed cost per
call dominates below a few hundred rows), so they are copied over in one transfer and run in the
pool while the GPU decomposes the large ones, those of one size in one batched ``eigh``.
Whatever fails goes through :func:`kfac.solve.robust_eigen_decomposition` one factor at a time.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kfac import solve
from kfac.workers import map_largest_first, submit_largest_first


@dataclass(frozen=True)
class EigenJob:
    """One factor to decompose, and the decomposition it had (the last resort if this one fails)."""

    key: Hashable
    factor: Tensor
    previous: solve.Decomposition | None


Results = dict[Hashable, solve.Decomposition]
Recoveries = dict[Hashable, str]


def _recover(job: EigenJob, dtype: torch.dtype) -> tuple[solve.Decomposition, str | None]:
    decomposition, recovery = solve.robust_eigen_decomposition(job.factor, dtype, job.previous)
    return decomposition, recovery


def decompose_eigen(jobs: Sequence[EigenJob], dtype: torch.dtype, cpu_limit: int) -> tuple[Results, Recoveries]:
    """(Q, d) of every job's factor; the second dict names the recovery of those that needed one."""
    results: Results = {}
    recoveries: Recoveries = {}
    if not jobs:
        return results, recoveries
    device = jobs[0].factor.device
    costs = [float(job.factor.shape[0]) ** 3 for job in jobs]
    if device.type == "cpu":
        outcomes = map_largest_first(lambda job: _recover(job, dtype), jobs, costs, on_cpu=True)
        for job, (decomposition, recovery) in zip(jobs, outcomes, strict=False):
            results[job.key] = decomposition
            if recovery is not None:
                recoveries[job.key] = recovery
        return results, recoveries

    small = [job for job in jobs if job.factor.shape[0] <= cpu_limit]
    large = [job for job in jobs if job.factor.shape[0] > cpu_limit]
    futures = []
    if small:  # one device-to-host transfer for all of them, then the pool, overlapping the GPU's share
        flat = torch.cat([job.factor.reshape(-1) for job in small]).cpu()
        host_jobs, offset = [], 0
        for job in small:
            n = job.factor.shape[0]
            host_jobs.append(EigenJob(job.key, flat[offset : offset + n * n].view(n, n), None))
            offset += n * n
        futures = submit_largest_first(
            lambda job: _recover(job, dtype), host_jobs, [float(j.factor.shape[0]) ** 3 for j in small]
        )

    by_size: dict[int, list[EigenJob]] = defaultdict(list)
    for job in large:
        by_size[job.factor.shape[0]].append(job)
    for group in by_size.values():
        batched = solve.eigen_decompositions([job.factor for job in group], dtype) if len(group) > 1 else None
        if batched is not None:
            results.update(zip((job.key for job in group), batched, strict=False))
            continue
        for job in group:
            decomposition, recovery = _recover(job, dtype)
            results[job.key] = decomposition
            if recovery is not None:
                recoveries[job.key] = recovery

    for job, future in zip(small, futures, strict=False):
        (vectors, values), recovery = future.result()
        if recovery == "diagonal" and job.previous is not None:  # the host copy had no previous one
            results[job.key], recovery = job.previous, "kept_previous"
        else:
            results[job.key] = (vectors.to(device, non_blocking=True), values.to(device, non_blocking=True))
        if recovery is not None:
            recoveries[job.key] = recovery
    return results, recoveries
