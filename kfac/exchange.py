"""StatisticsExchange: sums one step's factor statistics over ranks, in buckets started as backward fills them.

Each layer's statistics of a step (summed over its backward passes) are packed into one flat buffer
(BatchStatistics.pack). Consecutive layers travel together in one sum-allreduce of up to ``bucket_cap_mb``
megabytes, so that small layers do not pay one collective each (a deterministic Horovod run fuses nothing).
A bucket starts as soon as backward has given all its layers their last pass, overlapping the rest of
backward, and buckets start strictly in order, so every rank issues the same collectives in the same order.
The cap is small (0.25 MB by default): a bucket that held a model's whole statistics would start only when
backward ends, and under Horovod the last gradients would queue behind it.

With ``wire`` bfloat16 the sums travel in that precision, and the counts (integers bfloat16 cannot hold
exactly) travel apart in the statistics' own precision, in one small allreduce with the last bucket, so the
averages divide by exact counts.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from kfac.comm import Communicator
from kfac.factors import BatchStatistics, upper_size
from kfac.layers import KFACLayer


def buckets(sizes: Sequence[int], cap: float) -> list[list[int]]:
    """Consecutive layers, last first (the order backward reaches them), in buckets of at most ``cap`` bytes
    (a layer larger than the cap is a bucket of its own)."""
    result: list[list[int]] = []
    filled = cap
    for index in reversed(range(len(sizes))):
        if filled + sizes[index] > cap:
            result.append([])
            filled = 0
        result[-1].append(index)
        filled += sizes[index]
    return result


def layer_buckets(layers: Sequence[KFACLayer], cap_mb: float) -> list[list[int]]:
    """The buckets of these layers' packed statistics (in the layers' precision) at a cap of ``cap_mb`` megabytes."""
    return buckets([packed_size(layer) * layer.dtype.itemsize for layer in layers], cap_mb * 2**20)


def packed_size(layer: KFACLayer) -> int:
    """Elements of a layer's packed statistics: the upper triangles of A and G, then their two counts."""
    return upper_size(layer.a_dim) + upper_size(layer.g_dim) + 2


class StatisticsExchange:
    """Collects each layer's statistics of a step and, with several ranks, sums them over all ranks.

    ``add`` is called inside backward as each layer finishes a pass; ``reduce`` starts the buckets still
    waiting and waits for all (every rank calls it at every factor update, whatever it saw); ``take`` hands
    back the step's statistics and starts the next step afresh.
    """

    def __init__(self, comm: Communicator, layers: Sequence[KFACLayer], passes: int, bucket_cap_mb: float,
                 wire: torch.dtype | None, collectives: dict[str, int]) -> None:
        if wire == torch.bfloat16 and comm.size > 1 and not comm.sums_bfloat16:
            raise ValueError(f"factor_comm_dtype bfloat16 needs a communicator that sums bfloat16; "
                             f"{type(comm).__name__} cannot (use torch.distributed's)")
        self.comm, self.layers, self.passes, self.wire = comm, list(layers), passes, wire
        self.collectives = collectives  # the preconditioner's counters, by kind
        self.buckets = layer_buckets(self.layers, bucket_cap_mb)
        self._bucket_of = {index: b for b, bucket in enumerate(self.buckets) for index in bucket}
        self._gathered: dict[int, BatchStatistics] = {}  # per layer, this step's statistics so far
        self._passes: dict[int, int] = defaultdict(int)
        self._extra: dict[int, BatchStatistics] = {}  # passes beyond ``passes`` after the bucket had left
        self._next_bucket = 0  # buckets whose allreduce this step has started
        self._in_flight: dict[int | str, Any] = {}  # per bucket (and "counts"), the allreduce started
        self._counts: list[Tensor] = []  # with a bfloat16 wire: the launched buckets' counts, sent with the last
        self._count_index: dict[tuple[int, torch.device], Tensor] = {}
        self._received: dict[int, Tensor] = {}

    def add(self, index: int, stats: BatchStatistics) -> None:
        """Keep one pass's statistics of layer ``index``; start its bucket once all its layers had their last."""
        if self._bucket_of[index] < self._next_bucket:  # more passes than expected: kept on this rank
            extra = self._extra.get(index)
            self._extra[index] = stats if extra is None else BatchStatistics.merge([extra, stats])
            return
        gathered = self._gathered.get(index)
        self._gathered[index] = stats if gathered is None else BatchStatistics.merge([gathered, stats])
        self._passes[index] += 1
        if self.comm.size > 1 and self._passes[index] == self.passes:
            self._launch_ready()  # the allreduces of finished buckets overlap the rest of backward

    @property
    def extra_passes(self) -> list[int]:
        """The layers that ran more passes than expected this step (their extra passes count on this rank only)."""
        return list(self._extra)

    def reduce(self) -> None:
        """Start the buckets not yet started, then wait for every bucket's sum (several ranks only)."""
        for bucket in range(self._next_bucket, len(self.buckets)):
            self._launch(bucket)
        self._received = self._receive_all()

    def take(self) -> dict[int, BatchStatistics]:
        """Per layer, this step's statistics: summed over ranks after ``reduce`` (every layer, with zero counts
        where no rank ran it), else this rank's (the layers it ran); extra passes added. Resets for the next step."""
        taken: dict[int, BatchStatistics] = {}
        for index, layer in enumerate(self.layers):
            stats: BatchStatistics | None
            if self.comm.size > 1:
                stats = BatchStatistics.unpack(self._received[index], layer.a_dim, layer.g_dim)
            else:
                stats = self._gathered.pop(index) if index in self._gathered else None
            extra = self._extra.pop(index) if index in self._extra else None
            if extra is not None:
                stats = extra if stats is None else BatchStatistics.merge([stats, extra])
            if stats is not None:
                taken[index] = stats
        self._gathered.clear()
        self._passes.clear()
        self._received = {}
        self._next_bucket = 0
        return taken

    def _launch_ready(self) -> None:
        """Start the next buckets whose layers all had their last pass, strictly in bucket order, so that
        every rank issues the same collectives in the same order (NCCL needs it) even if a rank skips a layer."""
        for bucket in range(self._next_bucket, len(self.buckets)):
            if not all(self._passes[i] == self.passes for i in self.buckets[bucket]):
                return
            self._launch(bucket)

    def _launch(self, bucket: int) -> None:
        """One sum-allreduce per bucket per step on every rank, whatever the rank saw."""
        buffers = []
        for index in self.buckets[bucket]:
            layer = self.layers[index]
            stats = self._gathered.pop(index, None)
            if stats is None:  # this rank's pass never reached the layer: it still joins, with zero counts
                buffers.append(BatchStatistics.empty_buffer(layer.a_dim, layer.g_dim, layer.dtype, layer.device))
            else:
                buffers.append(stats.pack())
        self._next_bucket += 1
        self.collectives["kfac.factors"] += 1
        payload = torch.cat(buffers)
        name = f"kfac.factors.{bucket}"
        if self.wire is None:
            self._in_flight[bucket] = self.comm.allreduce_sum_async(payload, name)
            return
        self._in_flight[bucket] = self.comm.allreduce_sum_async(payload.to(self.wire), name)
        self._counts.append(payload[self._count_positions(bucket, payload.device)])
        if self._next_bucket == len(self.buckets):
            self.collectives["kfac.factor_counts"] += 1
            self._in_flight["counts"] = self.comm.allreduce_sum_async(torch.cat(self._counts), "kfac.factor_counts")
            self._counts = []

    def _count_positions(self, bucket: int, device: torch.device) -> Tensor:
        """Where the two counts of each layer of ``bucket`` sit in its packed buffer (kept on the device)."""
        key = (bucket, device)
        if key not in self._count_index:
            ends = torch.tensor([packed_size(self.layers[i]) for i in self.buckets[bucket]]).cumsum(0)
            self._count_index[key] = torch.stack([ends - 2, ends - 1], 1).reshape(-1).to(device)
        return self._count_index[key]

    def _receive_all(self) -> dict[int, Tensor]:
        """Wait for every bucket's allreduce: per layer, its packed statistics in the layers' precision."""
        received: dict[int, Tensor] = {}
        counts = None if self.wire is None else self.comm.wait(self._in_flight.pop("counts"))
        offset = 0
        for bucket, indices in enumerate(self.buckets):
            summed = self.comm.wait(self._in_flight.pop(bucket))
            if counts is not None:
                summed = summed.to(counts.dtype)
                summed[self._count_positions(bucket, summed.device)] = counts[offset : offset + 2 * len(indices)]
                offset += 2 * len(indices)
            received.update(zip(indices, summed.split([packed_size(self.layers[i]) for i in indices]), strict=True))
        return received
