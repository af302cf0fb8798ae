"""Running Kronecker factors: a batch's statistics, how they travel between ranks, how they enter the factors.

Each rank adds up Σ a aᵀ and Σ g gᵀ over its own batch. One flat buffer per layer carries the
upper triangles of both sums and their counts; summed over all ranks it gives the global batch
average however the batch was split, which is why a 4-rank run equals a 1-rank run.
RunningFactors averages each step's batch factors into the running ones, leaving out on the device
a batch that is not finite or a step the optimizer skips.
"""

from __future__ import annotations

from collections.abc import Mapping
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

    @property
    def ran(self) -> bool:
        """False when counts known on the host say nothing ran (device counts are not read: they may be 0)."""
        return isinstance(self.a_count, Tensor) or bool(self.a_count != 0 and self.g_count != 0)

    def averages(self, loss_scale: float | Tensor) -> tuple[Tensor, Tensor] | None:
        """This batch's factors, Σ a aᵀ / count and Σ g gᵀ / (count · scale²) with the loss scale's square
        divided out of G; None when counts known on the host say nothing ran (device counts of 0 give 0/0,
        which the update leaves out as not finite)."""
        if not self.ran:
            return None
        scale = loss_scale.to(self.g_sum.device) ** 2 if isinstance(loss_scale, Tensor) else loss_scale**2
        return self.a_sum / self.a_count, self.g_sum / (self.g_count * scale)

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
    still read them). The average is two multi-tensor calls for all factors (on a GPU a few fused
    kernels instead of two launches per factor: the update's cost there is the host's launches).
    """
    if not olds:
        return []
    averaged = torch._foreach_mul(olds, decay)
    torch._foreach_add_(averaged, news, alpha=1.0 - decay)
    return [torch.where(k, old, mixed, out=mixed) for old, mixed, k in zip(olds, averaged, keep, strict=True)]


Batch = tuple[int, Tensor, Tensor]  # (layer, A of this batch, G of this batch)


class RunningFactors:
    """Per layer, the running factors ``a`` and ``g`` (None until the layer's first usable batch), and
    ``skipped``: the layer updates left out so far, a count on the device (None before the first update).

    The lists are updated in place, item by item (a factor is replaced, never mutated: a decomposition
    may still read the old one), so a reference to them stays current.
    """

    def __init__(self, n: int) -> None:
        self.a: list[Tensor | None] = [None] * n
        self.g: list[Tensor | None] = [None] * n
        self.skipped: Tensor | None = None

    def update(self, summed: Mapping[int, BatchStatistics], decay: float, loss_scale: float | Tensor,
               found_inf: Tensor | None) -> None:
        """F ← ξF + (1−ξ)F_batch for every layer in ``summed`` (this step's statistics, by layer) whose batch
        factors are usable: finite, and ``found_inf`` (when given) not saying the optimizer skips this step."""
        batches = batch_averages(summed, loss_scale)
        if batches:
            self._average(batches, decay, found_inf)

    def _average(self, batches: list[Batch], decay: float, found_inf: Tensor | None) -> None:
        """The verdicts are decided on the device (usable) and the old factors selected with torch.where, so
        nothing is read back to the host, except once for a layer's first factors (whether it has factors at
        all decides which layers are decomposed, on the host)."""
        ok = usable(batches, found_inf)
        one_device = len({verdict.device for verdict in ok}) == 1
        kept = ~torch.stack(ok) if one_device else None  # one call for all layers on one device
        keep = list(kept.unbind(0)) if kept is not None else [~verdict for verdict in ok]
        old = [(k, b) for k, b in enumerate(batches) if self.a[b[0]] is not None]
        for factors, side in ((self.a, 1), (self.g, 2)):
            olds = [factors[b[0]] for _, b in old]
            news = [b[side] for _, b in old]
            averaged = masked_running_averages(olds, news, decay, [keep[k] for k, _ in old])  # type: ignore[arg-type]
            for (_, b), factor in zip(old, averaged, strict=False):
                factors[b[0]] = factor
        first = [(k, b) for k, b in enumerate(batches) if self.a[b[0]] is None]
        if first:
            verdicts = torch.stack([ok[k].to(ok[0].device) for k, _ in first]).tolist()  # the one host read
            for (_, (index, a_batch, g_batch)), fine in zip(first, verdicts, strict=False):
                if fine:
                    self.a[index], self.g[index] = a_batch, g_batch
        skipped = kept.sum() if kept is not None else torch.stack([k.to(keep[0].device) for k in keep]).sum()
        self.skipped = skipped if self.skipped is None else self.skipped + skipped


def batch_averages(summed: Mapping[int, BatchStatistics], loss_scale: float | Tensor) -> list[Batch]:
    """Every layer's batch factors (:meth:`BatchStatistics.averages`), by layer, in two multi-tensor divisions
    where the counts are all numbers or all tensors (on a GPU a few launches instead of two per layer)."""
    stats = [(index, summed[index]) for index in sorted(summed) if summed[index].ran]
    if not stats:
        return []
    scale = loss_scale.to(stats[0][1].g_sum.device) ** 2 if isinstance(loss_scale, Tensor) else loss_scale**2
    a_counts = [s.a_count for _, s in stats]
    g_counts = [s.g_count * scale for _, s in stats]
    alike = all(isinstance(c, Tensor) == isinstance(a_counts[0], Tensor) for c in a_counts + g_counts)
    if not alike or len({s.a_sum.device for _, s in stats}) > 1:
        return [(i, *averages) for i, s in stats if (averages := s.averages(loss_scale)) is not None]
    a = torch._foreach_div([s.a_sum for _, s in stats], a_counts)  # type: ignore[arg-type]
    g = torch._foreach_div([s.g_sum for _, s in stats], g_counts)  # type: ignore[arg-type]
    return [(i, a_i, g_i) for (i, _), a_i, g_i in zip(stats, a, g, strict=True)]


def usable(batches: list[Batch], found_inf: Tensor | None) -> list[Tensor]:
    """Per batch, a 0-dim boolean on its device: both factors finite and the step not skipped."""
    tensors = [t for _, a, g in batches for t in (a, g)]
    if len({t.device for t in tensors}) == 1:
        finite = all_finite(tensors).view(-1, 2).all(1)
        if found_inf is not None:
            finite &= found_inf.to(finite.device).reshape(()) == 0
        return list(finite.unbind(0))
    # layers on several devices (model parallel): one verdict per layer where it lives
    verdicts = [all_finite([a, g]).all() for _, a, g in batches]
    if found_inf is None:
        return verdicts
    return [ok & (found_inf.to(ok.device).reshape(()) == 0) for ok in verdicts]


def all_finite(tensors: list[Tensor]) -> Tensor:
    """Per tensor (all on one device), whether every entry is finite: a boolean vector on that device.

    A tensor's extremes are finite exactly when all its entries are (NaN propagates), and unlike a
    sum they cannot overflow. On a GPU torch._foreach_norm gives every max-norm in a few fused
    kernels; on the host it is one norm per tensor, and each tensor's minimum and maximum (one pass,
    torch.aminmax) measured many times cheaper.
    """
    if tensors[0].device.type == "cpu":
        return torch.isfinite(torch.stack([torch.stack(torch.aminmax(t)) for t in tensors])).all(1)
    return torch.isfinite(torch.stack(torch._foreach_norm(tensors, float("inf"))))
