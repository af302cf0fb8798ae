"""kfac.exchange: the factor statistics summed over ranks, against direct sums of what each rank captured.

The plain tests run two exchanges (two ranks) in one process over a stand-in communicator that sums what both
posted under a collective's name; the MPI test runs one exchange per rank over torch.distributed against MPI's
own float64 Allreduce: ``timeout 600 mpiexec -n 4 .venv/bin/python -m pytest --with-mpi -m mpi
tests/kfac/test_kfac_exchange.py``.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Sequence

import pytest
import torch
from torch import Tensor, nn

from hpcdl.training.models import MnistCNN
from kfac import KFACPreconditioner
from kfac.comm import Communicator, Group, Handle
from kfac.exchange import StatisticsExchange, buckets, layer_buckets, packed_size
from kfac.factors import BatchStatistics
from kfac.layers import KFACLayer, find_layers
from tests.support.backends import HOROVOD
from tests.support.mpi_harness import assert_all_ranks

DTYPE = torch.float64


class Wire:
    """What every simulated rank posted under each collective's name; a wait sums them all."""

    def __init__(self) -> None:
        self.posted: dict[str, list[Tensor]] = defaultdict(list)


class Simulated(Communicator):
    """Rank ``rank`` of ``size`` over a shared Wire: allreduce posts a copy, wait returns the sum of all posts."""

    def __init__(self, wire: Wire, rank: int, size: int, sums_bfloat16: bool = True) -> None:
        self.wire, self.rank, self.size, self.sums_bfloat16 = wire, rank, size, sums_bfloat16

    def allreduce_sum_async(self, tensor: Tensor, name: str) -> Handle:
        self.wire.posted[name].append(tensor.clone())
        return name

    def wait(self, handle: Handle) -> Tensor:
        posted = self.wire.posted[handle]
        assert len(posted) == self.size, f"{handle}: {len(posted)} of {self.size} ranks posted"
        return torch.stack(posted).sum(0)

    def groups(self, partition: Sequence[Sequence[int]]) -> Group:
        raise NotImplementedError


def _layers() -> list[KFACLayer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 5), nn.Linear(5, 2, bias=False), nn.Linear(2, 3)).to(DTYPE)
    return find_layers(model, (), "expand")


def _stats(layer: KFACLayer, seed: int, count: float) -> BatchStatistics:
    """Symmetric integer-valued sums (exact in float64 whatever the order of addition)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-8, 8, (layer.a_dim, layer.a_dim), generator=g).to(DTYPE)
    b = torch.randint(-8, 8, (layer.g_dim, layer.g_dim), generator=g).to(DTYPE)
    return BatchStatistics(a + a.T, count, b + b.T, count + 1)


def _random_stats(layer: KFACLayer, seed: int, count: float) -> BatchStatistics:
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(layer.a_dim, layer.a_dim, generator=g), torch.randn(layer.g_dim, layer.g_dim, generator=g)
    return BatchStatistics((a + a.T).to(DTYPE), count, (b + b.T).to(DTYPE), count + 743)


def test_the_default_cap_sends_the_largest_statistics_while_backward_still_runs() -> None:
    """mnist_cnn's first linear layer holds 60 % of its statistics (A is 513 wide). At the default cap it leaves in a
    bucket without the convolutions, as soon as backward has passed it; with all four layers in one bucket (the
    earlier cap, 25 MB) it would leave only when backward ends, and under Horovod the last gradients queue behind."""
    layers = find_layers(MnistCNN(), (), "expand")  # conv1, conv2, fc1, fc2
    sizes = [packed_size(layer) for layer in layers]
    default = inspect.signature(KFACPreconditioner).parameters["bucket_cap_mb"].default
    assert sizes[2] > sum(sizes) / 2
    split = layer_buckets(layers, default)
    assert next(b for b in split if 2 in b) == [2] and sum(split, []) == [3, 2, 1, 0]
    assert layer_buckets(layers, 25.0) == [[3, 2, 1, 0]]


def test_buckets_are_consecutive_layers_from_the_last_within_the_cap() -> None:
    assert buckets([3, 5, 2, 4], 7) == [[3, 2], [1], [0]]
    assert buckets([3, 5, 2, 4], 100) == [[3, 2, 1, 0]]
    assert buckets([3, 50, 2], 10) == [[2], [1], [0]]  # a layer above the cap travels alone
    assert buckets([], 10) == []


@pytest.mark.parametrize("cap_mb", [25.0, 1e-9])
def test_two_ranks_get_the_direct_sums_over_ranks_and_passes(cap_mb: float) -> None:
    """Two passes a step on each of two ranks; rank 1 never reaches layer 0 (it joins with zero counts) and runs
    layer 3 a third time: after its bucket left (one bucket a layer) that pass stays on rank 1, before (one bucket
    for all) it travels. Every layer's statistics equal the direct sums of what each rank captured, bit for bit."""
    layers, wire = _layers(), Wire()
    collectives: list[dict[str, int]] = [defaultdict(int), defaultdict(int)]
    exchanges = [StatisticsExchange(Simulated(wire, r, 2), layers, 2, cap_mb, None, collectives[r]) for r in (0, 1)]
    captured: dict[tuple[int, int], list[BatchStatistics]] = defaultdict(list)
    for rank, exchange in enumerate(exchanges):
        for _ in range(2):
            for index in reversed(range(len(layers))):  # backward's order
                if rank == 1 and index == 0:
                    continue
                stats = _stats(layers[index], 100 * rank + 10 * index + len(captured[(rank, index)]), 3.0 + rank)
                captured[(rank, index)].append(stats)
                exchange.add(index, stats)
    late = _stats(layers[3], 999, 7.0)
    exchanges[1].add(3, late)
    kept = cap_mb < 1  # layer 3's bucket (the first) had left
    assert exchanges[0].extra_passes == [] and exchanges[1].extra_passes == ([3] if kept else [])
    for exchange in reversed(exchanges):  # rank 1 posts its last bucket (layer 0's, zeros) in reduce
        exchange.reduce()
    taken = [exchange.take() for exchange in exchanges]
    for rank in (0, 1):
        for index, layer in enumerate(layers):
            parts = [s for r in (0, 1) for s in captured[(r, index)]]
            want_a = sum((s.a_sum for s in parts[1:]), parts[0].a_sum.clone())
            want_g = sum((s.g_sum for s in parts[1:]), parts[0].g_sum.clone())
            counts = [sum(s.a_count for s in parts), sum(s.g_count for s in parts)]
            if index == 3 and (rank == 1 or not kept):
                want_a, want_g = want_a + late.a_sum, want_g + late.g_sum
                counts = [counts[0] + late.a_count, counts[1] + late.g_count]
            got = taken[rank][index]
            assert torch.equal(got.a_sum, want_a) and torch.equal(got.g_sum, want_g), (rank, layer.name)
            assert [float(got.a_count), float(got.g_count)] == counts, (rank, layer.name)
    assert collectives[0]["kfac.factors"] == collectives[1]["kfac.factors"] == (4 if kept else 1)
    assert exchanges[1].extra_passes == []  # take starts the next step afresh


def test_a_bucket_starts_once_its_layers_had_their_last_pass() -> None:
    layers = _layers()
    collectives: dict[str, int] = defaultdict(int)
    exchange = StatisticsExchange(Simulated(Wire(), 0, 2), layers, 2, 1e-9, None, collectives)
    last = len(layers) - 1
    exchange.add(last, _stats(layers[last], 0, 1.0))
    assert collectives["kfac.factors"] == 0  # one pass of two
    exchange.add(last, _stats(layers[last], 1, 1.0))
    assert collectives["kfac.factors"] == 1  # its bucket (the first: backward reaches the last layer first)
    exchange.add(0, _stats(layers[0], 2, 1.0))
    exchange.add(0, _stats(layers[0], 3, 1.0))
    assert collectives["kfac.factors"] == 1  # layer 0's bucket waits for the buckets before it


def test_a_bfloat16_wire_keeps_the_counts_exact() -> None:
    """Counts of 257 and 258 (bfloat16 holds neither) arrive as 515; the sums within bfloat16's rounding."""
    layers, wire = _layers(), Wire()
    collectives: list[dict[str, int]] = [defaultdict(int), defaultdict(int)]
    exchanges = [StatisticsExchange(Simulated(wire, r, 2), layers, 1, 1e-9, torch.bfloat16, collectives[r])
                 for r in (0, 1)]
    sent = {}
    for rank, exchange in enumerate(exchanges):
        for index in reversed(range(len(layers))):
            stats = _random_stats(layers[index], 10 * rank + index, 257.0 + rank)
            sent[(rank, index)] = stats.pack()
            exchange.add(index, stats)
    for exchange in exchanges:
        exchange.reduce()
    for index, got in exchanges[0].take().items():
        want = sent[(0, index)] + sent[(1, index)]
        packed = got.pack()
        assert packed.dtype == DTYPE and torch.equal(packed[-2:], want[-2:])
        assert 0 < float((packed[:-2] - want[:-2]).abs().max() / want[:-2].abs().max()) < 2e-2
    assert collectives[0]["kfac.factor_counts"] == 1


def test_a_communicator_that_cannot_sum_bfloat16_is_refused() -> None:
    with pytest.raises(ValueError, match="factor_comm_dtype bfloat16 needs a communicator that sums bfloat16"):
        StatisticsExchange(Simulated(Wire(), 0, 2, sums_bfloat16=False), _layers(), 1, 25.0, torch.bfloat16, {})


def test_one_rank_merges_the_passes_and_leaves_out_the_layers_not_run() -> None:
    layers = _layers()
    exchange = StatisticsExchange(Simulated(Wire(), 0, 1), layers, 2, 25.0, None, defaultdict(int))
    first, second = _stats(layers[1], 0, 2.0), _stats(layers[1], 1, 3.0)
    exchange.add(1, first)
    exchange.add(1, second)
    taken = exchange.take()
    assert list(taken) == [1] and float(taken[1].a_count) == 5.0
    assert torch.equal(taken[1].a_sum, first.a_sum + second.a_sum)
    assert exchange.take() == {}


@pytest.mark.mpi(min_size=2)
def test_bf16_factor_sums_carry_counts_bf16_cannot_hold() -> None:
    """One bucket per layer through the bf16 path over torch.distributed with counts of 257 + rank (bf16 rounds
    257 to 256): the counts arrive exact, the sums within bf16's rounding of MPI's own float64 Allreduce."""
    from mpi4py import MPI

    from hpcdl.runtime import world
    from kfac.torch_comm import TorchCommunicator

    world.init(use_horovod=HOROVOD, torch_distributed=True)
    comm = TorchCommunicator()
    layers = _layers()
    collectives: dict[str, int] = defaultdict(int)
    exchange = StatisticsExchange(comm, layers, 1, 1e-9, torch.bfloat16, collectives)
    sent = {}
    for index in reversed(range(len(layers))):
        layer = layers[index]
        stats = _random_stats(layer, 100 * comm.rank + index, 257.0 + comm.rank)
        sent[index] = stats.pack()
        exchange.add(index, stats)
    exchange.reduce()
    problems = []
    for index, got in sorted(exchange.take().items()):
        want = sent[index].clone()
        MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, want.numpy(), op=MPI.SUM)
        packed = got.pack()
        if packed.dtype != DTYPE or not torch.equal(packed[-2:], want[-2:]):
            problems.append(f"layer {index}: counts {packed[-2:].tolist()} != {want[-2:].tolist()} ({packed.dtype})")
        err = float((packed[:-2] - want[:-2]).abs().max() / want[:-2].abs().max())
        if not 0 < err < 2e-2:
            problems.append(f"layer {index}: sums {err:.1e} off MPI's float64 sums")
    if collectives["kfac.factor_counts"] != 1 or collectives["kfac.factors"] != len(layers):
        problems.append(f"collectives {dict(collectives)}")
    assert_all_ranks(not problems, "; ".join(problems))
