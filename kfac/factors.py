"""Running Kronecker factors, and how a batch's statistics travel between ranks.

Each rank adds up Σ a aᵀ and Σ g gᵀ over its own batch. One flat buffer per layer carries the
upper triangles of both sums and their counts; summed over all ranks it gives the global batch
average however the batch was split, which is why a 4-rank run equals a 1-rank run.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
from torch import Tensor

Count = float | Tensor


@cache
def _upper_positions(n: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Flat positions of the upper triangle of an n x n matrix, and of its mirror image.

    Kept on the device they index (built there once, not copied from the host every call).
    """
    rows, cols = torch.triu_indices(n, n, device=device)
    return rows * n + cols, cols * n + rows


def pack_upper(matrix: Tensor) -> Tensor:
    """The upper triangle (diagonal included) of a symmetric matrix as a vector: n(n+1)/2 numbers."""
    upper, _ = _upper_positions(matrix.shape[0], matrix.device)
    return matrix.reshape(-1).index_select(0, upper)


def unpack_upper(vector: Tensor, n: int) -> Tensor:
    """The symmetric matrix whose upper triangle is ``vector``."""
    upper, lower = _upper_positions(n, vector.device)
    flat = vector.new_empty(n * n)
    flat.index_copy_(0, lower, vector)
    flat.index_copy_(0, upper, vector)
    return flat.view(n, n)


def upper_size(n: int) -> int:
    return n * (n + 1) // 2


@dataclass
class BatchStatistics:
    """One layer's sums over one step's batch, before they are averaged into factors.

    The counts are numbers on the host when they come from this rank's shapes, and 0-dim tensors
    on the device after an allreduce (reading them back would stall the GPU).
    """

    a_sum: Tensor
    a_count: Count
    g_sum: Tensor
    g_count: Count

    def pack(self) -> Tensor:
        """[triu(Σ a aᵀ), triu(Σ g gᵀ), a_count, g_count] as one buffer for a single allreduce."""
        buffer = torch.cat([pack_upper(self.a_sum), pack_upper(self.g_sum), self.a_sum.new_empty(2)])
        buffer[-2] = self.a_count  # filled on the device: no host-to-device copy to wait for
        buffer[-1] = self.g_count
        return buffer

    @classmethod
    def unpack(cls, buffer: Tensor, a_dim: int, g_dim: int) -> BatchStatistics:
        na, ng = upper_size(a_dim), upper_size(g_dim)
        return cls(
            a_sum=unpack_upper(buffer[:na], a_dim),
            a_count=buffer[na + ng],
            g_sum=unpack_upper(buffer[na : na + ng], g_dim),
            g_count=buffer[na + ng + 1],
        )

    @classmethod
    def merge(cls, parts: list[BatchStatistics]) -> BatchStatistics:
        """Several forward/backward passes of one step (gradient accumulation) added up."""
        first = parts[0]
        if len(parts) == 1:
            return first
        return cls(
            a_sum=sum((p.a_sum for p in parts[1:]), first.a_sum.clone()),
            a_count=sum((p.a_count for p in parts[1:]), first.a_count),
            g_sum=sum((p.g_sum for p in parts[1:]), first.g_sum.clone()),
            g_count=sum((p.g_count for p in parts[1:]), first.g_count),
        )

    @staticmethod
    def empty_buffer(a_dim: int, g_dim: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A rank whose layer saw no data this step still joins the allreduce, with zero counts."""
        return torch.zeros(upper_size(a_dim) + upper_size(g_dim) + 2, dtype=dtype, device=device)


def running_average(old: Tensor | None, new: Tensor, decay: float) -> Tensor:
    """F ← ξF + (1−ξ)F_batch; the first batch starts the average."""
    if old is None:
        return new.clone()
    return old.mul_(decay).add_(new, alpha=1.0 - decay)


def masked_running_averages(olds: list[Tensor], news: list[Tensor], decay: float, keep: list[Tensor]) -> list[Tensor]:
    """[ξF + (1−ξ)F_batch, or F where ``keep``] for many factors, without reading ``keep`` on the host.

    ``keep`` holds 0-dim booleans on the factors' device (a skipped or non-finite step): the old
    factor is selected element by element, so a non-finite batch never reaches the result. New
    tensors are returned and the old ones are left as they were (a background decomposition may
    still read them); one layer at a time, so that at most one extra factor is alive at once.
    """
    averaged = []
    for old, new, k in zip(olds, news, keep, strict=True):
        mixed = torch.mul(old, decay).add_(new, alpha=1.0 - decay)
        averaged.append(torch.where(k, old, mixed, out=mixed))
    return averaged
