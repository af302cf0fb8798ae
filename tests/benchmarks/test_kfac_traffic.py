"""benchmarks/kfac_traffic.py: the byte model equals what hpcdl's K-FAC really hands to its collectives.

Each rank of a 4-rank job is played in this process by a loopback communicator that reports rank r of 4
(sums and gathers bring nothing from other ranks, so the numbers are meaningless but every collective the
real rank would issue is issued, with its real size). The counts of the real preconditioner, wrapped by the
benchmark's counting communicator, must equal the model for every rank and grad-worker fraction: the model
then stands for K-FAC's traffic where no run can be made (ResNet-50 at 1,024 ranks).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import pytest
import torch

from hpcdl.training.models import build_model
from kfac import KFACPreconditioner
from kfac.comm import Group, Handle, SingleProcess
from tests.support.scripts import load_benchmark


@pytest.fixture(scope="module")
def traffic() -> ModuleType:
    return load_benchmark("kfac_traffic")


class LoopbackGroup(Group):
    """This rank's group: a gather returns zeros for the other members' parts, a sum changes nothing, an alltoall
    brings zeros."""

    def __init__(self, ranks: Sequence[int], rank: int) -> None:
        super().__init__(ranks)
        self.rank = rank

    def allgather_async(self, tensor: torch.Tensor, sizes: Sequence[int], name: str) -> Handle:
        return [tensor if r == self.rank else tensor.new_zeros(n) for r, n in zip(self.ranks, sizes, strict=True)]

    def wait_gathered(self, handle: Handle) -> list[torch.Tensor]:
        return handle

    def allreduce_sum_async(self, tensor: torch.Tensor, name: str) -> Handle:
        return tensor

    def wait_sum(self, handle: Handle) -> torch.Tensor:
        return handle

    def alltoall_async(self, tensor: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                       name: str) -> Handle:
        return tensor.new_zeros(sum(recv_splits))

    def wait_alltoall(self, handle: Handle) -> torch.Tensor:
        return handle


class Loopback(SingleProcess):
    """Rank ``rank`` of ``size`` as far as K-FAC can tell; nothing arrives from the other ranks."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def groups(self, partition: Sequence[Sequence[int]]) -> Group:
        return LoopbackGroup(next(group for group in partition if self.rank in group), self.rank)


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.25])
@pytest.mark.parametrize("rank", [0, 3])
@pytest.mark.parametrize("method", ["eigen", "newton"])
def test_the_byte_model_equals_the_counted_collectives_of_every_kind(traffic: ModuleType, fraction: float,
                                                                     rank: int, method: str) -> None:
    torch.manual_seed(0)
    model = build_model("mnist_cnn", 10, 1)
    comm = traffic.CountingCommunicator(Loopback(rank, 4))
    preconditioner = KFACPreconditioner(model, factor_update_freq=1, inv_update_freq=1, grad_worker_fraction=fraction,
                                        communicator=comm, lr=0.1, method=method)
    steps = 2
    for _ in range(steps):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.randn(8, 1, 28, 28)), torch.randint(0, 10, (8,))).backward()
        preconditioner.step()
    expected = traffic.kfac_round_bytes(traffic.Layers.of(model), 4, fraction, rank, method)
    for kind in traffic.KINDS:
        counted_bytes, rounds = comm.tally.get(kind, [0, 0])
        assert rounds == (steps if expected[kind] else 0), kind
        assert counted_bytes == steps * expected[kind], kind
    assert expected["factors"] > 0 and (expected["directions"] > 0) == (fraction < 1)


def test_the_check_names_a_round_the_model_gets_wrong(traffic: ModuleType) -> None:
    run = dict(fraction=0.5, rank=1, counted={"factors": dict(bytes=200, rounds=2)},
               model_round_bytes=dict(factors=100, decompositions=0, directions=0))
    assert traffic.check_counts(dict(runs=[run])) == []
    run["model_round_bytes"]["factors"] = 101
    assert traffic.check_counts(dict(runs=[run])) == [
        "fraction 0.5 rank 1 factors: counted 100 B a round, the model says 101"]


def test_at_scale_the_ring_terms_follow_the_alpha_beta_model(traffic: ModuleType) -> None:
    layers = traffic.resnet50_layers()
    assert len(layers.a_dims) == 54 and layers.parameters == 25_557_032  # torchvision's ResNet-50
    net = traffic.network(100, 1.0)
    small, large = (traffic.step_seconds(net, layers, n, 1.0, 1, 1) for n in (64, 1024))
    # the gradients' ring: the bandwidth term hardly grows, the latency term does
    assert large["gradients"] > small["gradients"]
    assert large["gradients"] < 2 * small["gradients"]
    # ResNet-50's 54 layers on 1,024 ranks: a few owners, so scatter (an alltoall to equal chunks, then their ring
    # allgather) beats the broadcasts (NCCL's ring broadcast pays W-1 hop latencies for each of the 1,024 members),
    # a ring allgatherv and the sum of zero-padded slots
    old = traffic.step_seconds(net, layers, 1024, 1.0, 1, 1, "broadcasts", "nccl")
    assert large["decompositions"] < old["decompositions"] / 5
    by_kind = traffic.member_parts(layers, 1024, 1.0)
    assert traffic.step_seconds(net, layers, 1024, 1.0, 1, 1, parts=by_kind) == large  # predict hands them in
    parts = by_kind["decompositions"][0]
    assert traffic.share_by(parts) == "scatter"
    chunk = -(-sum(parts) // 1024) * 4
    assert large["decompositions"] == pytest.approx(
        1023 * net.alpha + max(parts) * 4 / net.bandwidth + 1023 * (net.alpha + chunk / net.bandwidth))
    assert large["decompositions"] < net.ring_seconds(sum(parts) * 4, 1024)


def test_share_seconds_price_each_design_as_its_algorithm(traffic: ModuleType) -> None:
    net = traffic.network(8, 10.0)  # 1 GB/s, 10 us
    balanced, lopsided = [1e6] * 4, [4e6, 0, 0, 0]
    assert traffic.share_seconds(net, balanced, "one collective") == pytest.approx(3 * (10e-6 + 1e-3))  # ring gather
    assert traffic.share_seconds(net, lopsided, "one collective") == pytest.approx(net.ring_seconds(4e6, 4))  # sum
    # two large owners of eight: scatter, a pairwise alltoall (the largest part leaves its owner) then a ring
    # allgather of eight equal chunks of Σ / 8
    two = [4e6, 4e6, 0, 0, 0, 0, 0, 0]
    assert traffic.share_seconds(net, two, "one collective") == pytest.approx(7 * 10e-6 + 4e6 / 1e9
                                                                               + 7 * (10e-6 + 1e6 / 1e9))
    # share_by decides in elements: two 200 kB parts are 50,000 fp32 elements each (scatter would save fewer than
    # SCATTER_OVERHEAD_ELEMENTS over the sum) but 100,000 bfloat16 ones (it saves more)
    small = [2e5, 2e5, 0, 0, 0, 0, 0, 0]
    assert traffic.share_seconds(net, small, "one collective") == pytest.approx(net.ring_seconds(4e5, 8))
    assert traffic.share_seconds(net, small, "one collective", element_bytes=2) == pytest.approx(
        7 * 10e-6 + 2e5 / 1e9 + 7 * (10e-6 + 5e4 / 1e9))
    # broadcasts: one per member, a member with nothing still sends one number
    assert traffic.share_seconds(net, lopsided, "broadcasts", "nccl") == pytest.approx(
        4 * 3 * 10e-6 + (4e6 + 3 * 4) / 1e9)
