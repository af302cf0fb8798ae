"""K-FAC on several ranks equals K-FAC on one rank with the whole batch, under Horovod and under torch.distributed.

Run with
``timeout 900 mpiexec --oversubscribe -n 4 .venv/bin/python -m pytest --with-mpi -m mpi tests/kfac/test_kfac_mpi.py``.
Each rank trains a data-parallel model on its shard of every global batch: averaged gradients
(Horovod's DistributedOptimizer, or a sum-allreduce over torch.distributed's Gloo divided by the
ranks), then K-FAC (Horovod's communicator, or kfac.torch_comm's), then the step. The reference is
computed on every rank without any communication: the same model, K-FAC with a single-process
communicator, on the whole global batch. Verdicts are collective, so a failure never hangs.
"""

from __future__ import annotations

# tests/conftest.py sets HOROVOD_DYNAMIC_PROCESS_SETS=1 for the --with-mpi session (Horovod reads
# it when it starts), so K-FAC uses Horovod process sets for its rank groups; without it K-FAC falls
# back to mpi4py sub-communicators, tested below as well.
import contextlib
import copy
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac import KFACPreconditioner
from kfac.comm import Communicator, SingleProcess
from kfac.default_comm import default_communicator
from kfac.sharing import Sharing
from tests.support.backends import BACKENDS, HOROVOD, needs_horovod
from tests.support.mpi_harness import assert_all_ranks

pytestmark = pytest.mark.mpi(min_size=2)

STEPS = 5
PER_RANK = 4
DTYPE = torch.float64
SETTINGS = dict(factor_update_freq=1, inv_update_freq=2, damping=0.01, factor_decay=0.9, kl_clip=0.01, lr=0.1)


def _horovod():
    from hpcdl.runtime import world

    world.init()
    import horovod.torch as hvd

    return hvd


class TorchAveraging:
    """Horovod's DistributedOptimizer's part in these tests, over torch.distributed: ``synchronize`` replaces each
    gradient by its sum over the ranks divided by their number (Horovod's Average)."""

    def __init__(self, base: torch.optim.Optimizer) -> None:
        self.base = base

    def zero_grad(self) -> None:
        self.base.zero_grad()

    def synchronize(self) -> None:
        import torch.distributed as dist

        for group in self.base.param_groups:
            for p in group["params"]:
                if p.grad is None:  # a layer this rank's pass did not reach adds zeros, as under Horovod
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
                p.grad.div_(dist.get_world_size())

    def skip_synchronize(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def step(self) -> None:
        self.base.step()

    def state_dict(self) -> dict[str, Any]:
        return self.base.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.base.load_state_dict(state)


class DataParallel:
    """One backend's ranks, gradient averaging and K-FAC communicator."""

    def __init__(self, backend: str) -> None:
        from hpcdl.runtime import world

        self.backend = backend
        if backend == "horovod":
            self.hvd = _horovod()
        else:  # Horovod too where installed: the session's other tests share the world
            world.init(use_horovod=HOROVOD, torch_distributed=True)
        me = world.get()
        self.rank, self.size = me.rank, me.size

    def optimizer(self, base: torch.optim.Optimizer, model: nn.Module, passes: int = 1) -> Any:
        if self.backend == "horovod":
            return self.hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                                 backward_passes_per_step=passes)
        return TorchAveraging(base)

    def communicator(self) -> Communicator | None:
        """None: K-FAC's default, Horovod's in a Horovod job."""
        if self.backend == "horovod":
            return None
        from kfac.torch_comm import TorchCommunicator

        return TorchCommunicator()


@pytest.fixture(params=BACKENDS)
def dp(request: pytest.FixtureRequest) -> DataParallel:
    return DataParallel(request.param)


class Net(nn.Module):
    """Six preconditioned layers so that every one of 4 ranks owns work; ``extra`` is used on demand.

    conv3 and conv4 have one shape, so the ranks that hold both eigenbases precondition them
    in one batched product (the path ResNets take).
    """

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.conv2 = nn.Conv2d(6, 8, 3, stride=2, padding=1)
        self.conv3 = nn.Conv2d(8, 8, 3, padding="same", dilation=2, bias=False)
        self.conv4 = nn.Conv2d(8, 8, 3, padding="same", dilation=2, bias=False)
        self.fc1 = nn.Linear(8 * 4 * 4, 16)
        self.fc2 = nn.Linear(16, 5)
        self.extra = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        h = F.relu(self.conv1(x))
        h = F.relu(self.conv2(h))
        h = F.relu(self.conv3(h))
        h = F.relu(self.conv4(h)).flatten(1)
        h = torch.tanh(self.fc1(h))
        if use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.fc2(h)


def _model() -> Net:
    torch.manual_seed(0)
    return Net().to(DTYPE)


def _batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(size, 3, 8, 8, generator=g, dtype=DTYPE), torch.randint(0, 5, (size,), generator=g)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train_distributed(dp: DataParallel, fraction: float, passes: int = 1,
                       **extra) -> tuple[torch.Tensor, KFACPreconditioner]:
    model = _model()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer = dp.optimizer(base, model, passes)
    pre = KFACPreconditioner(
        model,
        grad_worker_fraction=fraction,
        skip_layers=["extra"],
        backward_passes_per_step=passes,
        communicator=dp.communicator(),
        **SETTINGS,
        **extra,
    )
    rank, size = dp.rank, dp.size
    for step in range(STEPS):
        x, y = _batch(step, PER_RANK * size)
        shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        optimizer.zero_grad()
        for part in torch.arange(shard.start, shard.stop).chunk(passes):  # gradient accumulation
            (F.cross_entropy(model(x[part]), y[part]) / passes).backward()
        optimizer.synchronize()
        pre.step()
        with optimizer.skip_synchronize():
            optimizer.step()
    return _flat(model), pre


def _train_single_process(size: int, **extra) -> torch.Tensor:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pre = KFACPreconditioner(model, communicator=SingleProcess(), skip_layers=["extra"], **SETTINGS, **extra)
    for step in range(STEPS):
        x, y = _batch(step, PER_RANK * size)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        optimizer.step()
    return _flat(model)


def _fractions(size: int) -> list[float]:
    fractions = [1.0 / size, 1.0]
    if size % 2 == 0 and size > 2:
        fractions.insert(1, 0.5)
    return fractions


def _same_on_all_ranks(tensor: torch.Tensor) -> bool:
    """Bit for bit, through MPI (the same check under either backend)."""
    from mpi4py import MPI

    return len(set(MPI.COMM_WORLD.allgather(tensor.detach().cpu().numpy().tobytes()))) == 1


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_every_grad_worker_fraction_equals_one_rank_on_the_global_batch(dp: DataParallel) -> None:
    reference = _train_single_process(dp.size)
    results, problems = {}, []
    for fraction in _fractions(dp.size):
        params, pre = _train_distributed(dp, fraction)
        results[fraction] = params
        if not _same_on_all_ranks(params):
            problems.append(f"fraction {fraction}: parameters differ between ranks")
        err = _rel(params, reference)
        if not err < 1e-5:
            problems.append(f"fraction {fraction}: relative error {err:.2e} against the 1-rank run")
        if not any(pre.assignment.is_grad_worker(i, dp.rank) for i in range(len(pre.layers))) and fraction == 1.0:
            problems.append("with fraction 1 every rank must precondition every layer")
        if fraction == 1.0 and not pre._held.batches:
            problems.append("with fraction 1, conv3 and conv4 should be preconditioned in one batched product")
    first = results[_fractions(dp.size)[0]]
    for fraction, params in results.items():
        if not _rel(params, first) < 1e-5:
            problems.append(f"fraction {fraction} disagrees with fraction {_fractions(dp.size)[0]}")
    assert_all_ranks(not problems, "; ".join(problems))


@pytest.mark.parametrize("method", ["newton", "inverse"])
def test_each_inverse_method_at_every_grad_worker_fraction_equals_one_rank(method: str, dp: DataParallel) -> None:
    """The owners' inverses reach every grad worker as upper triangles and are rebuilt bit for bit on every rank
    (Newton–Schulz warm-started from what the owner holds, its float64 iterations stopping at a residual of 1e-9;
    Cholesky), so the run equals the 1-rank run of the same method to 1e-5 and every rank holds the same."""
    reference = _train_single_process(dp.size, method=method)
    problems = []
    for fraction in _fractions(dp.size):
        params, pre = _train_distributed(dp, fraction, method=method)
        if not _same_on_all_ranks(params):
            problems.append(f"fraction {fraction}: parameters differ between ranks")
        if not _rel(params, reference) < 1e-5:
            problems.append(f"fraction {fraction}: relative error {_rel(params, reference):.2e} against the 1-rank run")
        if method == "newton" and pre.stats["newton"].get("warm", 0) == 0 and pre.assignment.owned_factors(dp.rank):
            problems.append(f"fraction {fraction}: an owner never warm-started")
    assert_all_ranks(not problems, "; ".join(problems))


def test_gradient_accumulation_on_every_rank_equals_one_rank(dp: DataParallel) -> None:
    params, _ = _train_distributed(dp, 1.0 / dp.size, passes=2)
    err = _rel(params, _train_single_process(dp.size))
    assert_all_ranks(err < 1e-5 and _same_on_all_ranks(params), f"relative error {err:.2e}")


def test_memory_optimal_ranks_keep_only_their_layers_decompositions(dp: DataParallel) -> None:
    _, pre = _train_distributed(dp, 1.0 / dp.size)
    rank = dp.rank
    problems = []
    for i, layer in enumerate(pre.layers):
        mine = pre.assignment.is_grad_worker(i, rank)
        if mine != (pre._held.pairs[i] is not None):
            problems.append(f"{layer.name}: worker={mine} but holds decomposition={pre._held.pairs[i] is not None}")
        if mine and pre.assignment.a_owner[i] != rank:
            problems.append(f"{layer.name}: the only grad worker must own its factors")
    assert_all_ranks(not problems, "; ".join(problems))


@needs_horovod
def test_mpi4py_groups_give_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without Horovod process sets, K-FAC's groups are mpi4py sub-communicators: same numbers."""
    from kfac.comm import HorovodCommunicator

    dp = DataParallel("horovod")
    if dp.size % 2 or dp.size < 4:
        pytest.skip("needs an even number of ranks, at least 4, for a group that is neither one rank nor all")
    monkeypatch.setattr(HorovodCommunicator, "_process_sets", lambda self, partition: None)
    params, pre = _train_distributed(dp, 0.5)
    reference = _train_single_process(dp.size)
    ok = type(pre._worker_group).__name__ == "_MpiGroup" and _rel(params, reference) < 1e-5
    assert_all_ranks(ok and _same_on_all_ranks(params), f"mpi4py groups: {type(pre._worker_group).__name__}")


def test_torch_groups_are_process_groups_of_their_own() -> None:
    """Under torch.distributed a group that is neither one rank nor all is a new_group of its ranks."""
    dp = DataParallel("torch")
    if dp.size % 2 or dp.size < 4:
        pytest.skip("needs an even number of ranks, at least 4")
    pre = KFACPreconditioner(_model(), grad_worker_fraction=0.5, communicator=dp.communicator(), **SETTINGS)
    group = pre._worker_group
    ok = type(group).__name__ == "_TorchGroup" and group._group is not None and len(group.ranks) == dp.size // 2
    assert_all_ranks(ok, f"{type(group).__name__} of ranks {group.ranks}")


@needs_horovod
def test_both_backends_end_with_the_same_weights() -> None:
    """Horovod and torch.distributed, same shards and K-FAC settings: the same weights (to rounding: the sums may
    be added in another order), not merely both near the one-rank reference."""
    fraction = 1.0 / 2 if DataParallel("torch").size % 2 == 0 else 1.0
    a, _ = _train_distributed(DataParallel("horovod"), fraction)
    b, _ = _train_distributed(DataParallel("torch"), fraction)
    assert_all_ranks(_rel(a, b) < 1e-12, f"relative difference {_rel(a, b):.2e}")


@needs_horovod
def test_process_sets_are_used_when_horovod_allows_them() -> None:
    hvd = _horovod()
    if hvd.size() % 2 or hvd.size() < 4:
        pytest.skip("needs an even number of ranks, at least 4")
    try:
        hvd.add_process_set([0, 1, 2, 3][: hvd.size() - 1])  # probe: raises if dynamic sets are off
    except ValueError:
        pytest.skip("Horovod started before HOROVOD_DYNAMIC_PROCESS_SETS=1 was set in this session")
    pre = KFACPreconditioner(_model(), grad_worker_fraction=0.5, **SETTINGS)
    assert_all_ranks(type(pre._worker_group).__name__ == "_HorovodGroup", type(pre._worker_group).__name__)


def test_a_branch_used_on_one_rank_only_does_not_break_step(dp: DataParallel) -> None:
    """Rank 0 runs the extra layer, the others do not: factors come from rank 0's rows alone."""
    rank, size = dp.rank, dp.size
    model = _model()
    optimizer = dp.optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    pre = KFACPreconditioner(model, grad_worker_fraction=1.0 / size, communicator=dp.communicator(), **SETTINGS)
    extra = next(i for i, layer in enumerate(pre.layers) if layer.name == "extra")
    x, y = _batch(0, PER_RANK * size)
    shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    optimizer.zero_grad()
    F.cross_entropy(model(x[shard], use_extra=(rank == 0)), y[shard]).backward()
    optimizer.synchronize()
    pre.step()
    with optimizer.skip_synchronize():
        optimizer.step()

    # Rank 0's input to the extra layer, recomputed with the initial weights.
    with torch.no_grad():
        start = _model()
        h = F.relu(start.conv3(F.relu(start.conv2(F.relu(start.conv1(x[:PER_RANK]))))))
        h = torch.tanh(start.fc1(F.relu(start.conv4(h)).flatten(1)))
        rows = torch.cat([h, torch.ones(PER_RANK, 1, dtype=DTYPE)], dim=1)
        want_a = rows.T @ rows / PER_RANK
    got_a = pre.a_factors[extra]
    ok = got_a is not None and _rel(got_a, want_a) < 1e-10
    assert_all_ranks(ok and _same_on_all_ranks(_flat(model)), "extra layer's A factor")


def _train_with_skips(dp: DataParallel, steps: list[int], skipped: set[int]) -> KFACPreconditioner:
    """Distributed training where the steps in ``skipped`` overflow (inf in a gradient, found_inf=1)."""
    model = _model()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer = dp.optimizer(base, model)
    pre = KFACPreconditioner(model, grad_worker_fraction=1.0 / dp.size, skip_layers=["extra"],
                             communicator=dp.communicator(), **SETTINGS)
    rank = dp.rank
    for step in steps:
        x, y = _batch(step, PER_RANK * dp.size)
        shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        optimizer.zero_grad()
        F.cross_entropy(model(x[shard]), y[shard]).backward()
        optimizer.synchronize()
        if step in skipped:
            model.fc2.weight.grad[0, 0] = float("inf")
        pre.step(found_inf=torch.tensor(1.0 if step in skipped else 0.0))
        if step not in skipped:
            with optimizer.skip_synchronize():
                optimizer.step()
    return pre


def test_a_skipped_step_leaves_no_trace_in_the_factors_on_any_rank(dp: DataParallel) -> None:
    with_skip = _train_with_skips(dp, [0, 1, 2, 3], {2})
    without = _train_with_skips(dp, [0, 1, 3], set())
    pairs = zip(with_skip.a_factors + with_skip.g_factors, without.a_factors + without.g_factors, strict=True)
    ok = all((a is None) == (b is None) and (a is None or torch.equal(a, b)) for a, b in pairs)
    assert_all_ranks(ok, "factors of a run with a skipped step differ from a run without it")


def _broadcast_from_each(sharing: Sharing, group, name: str, payloads: dict[int, tuple]) -> dict:
    """The reference for sharing: every member broadcasts its payload in turn with MPI's own Bcast on the
    group's ranks (what K-FAC did before one allgather replaced the broadcasts)."""
    from mpi4py import MPI

    from kfac.comm import buffer_to_tensors, tensors_to_buffer

    world = MPI.COMM_WORLD
    sub = world.Create_group(world.Get_group().Incl(list(group.ranks)))
    received = {}
    for member in group.ranks:
        shapes, tensors, dtype = payloads[member]
        size = sum(torch.Size(shape).numel() for shape in shapes)
        buffer = (tensors_to_buffer(tensors, dtype, torch.device("cpu")) if member == sharing.rank
                  else torch.zeros(size, dtype=dtype))
        if size:
            sub.Bcast(buffer.numpy(), root=group.ranks.index(member))
        received[member] = buffer_to_tensors(buffer, shapes) if shapes else []
    sub.Free()
    return received


def test_collectives_per_step_one_per_group_and_phase_and_one_per_bucket(dp: DataParallel) -> None:
    size = dp.size
    problems = []
    for fraction in _fractions(size):
        for cap_mb, buckets in ((25.0, 1), (1e-9, 6)):  # one bucket for all six layers; one per layer
            _, pre = _train_distributed(dp, fraction, bucket_cap_mb=cap_mb)
            inverse_updates = len(range(0, STEPS, SETTINGS["inv_update_freq"]))
            want = {"kfac.factors": STEPS * buckets,
                    "kfac.decompositions": inverse_updates if fraction > 1 / size else 0,
                    "kfac.directions": STEPS if fraction < 1 else 0}
            got = {kind: pre.collectives.get(kind, 0) for kind in want}
            if got != want:
                problems.append(f"fraction {fraction}, cap {cap_mb} MB: {got}, expected {want}")
    assert_all_ranks(not problems, "; ".join(problems))


def test_bf16_payload_stays_close_to_fp32_and_identical_on_every_rank(dp: DataParallel) -> None:
    """Decompositions and directions in bfloat16 on the wire: every rank applies the same rounded
    values (replicas stay identical) and training stays near the fp32 run (bf16 keeps 8 bits)."""
    problems = []
    for fraction in _fractions(dp.size):
        full, _ = _train_distributed(dp, fraction)
        half, pre = _train_distributed(dp, fraction, comm_dtype=torch.bfloat16)
        err = _rel(half, full)
        if not 0 < err < 2e-2:
            problems.append(f"fraction {fraction}: bf16 payload moved the parameters by {err:.1e} (0 < e < 2e-2)")
        if not _same_on_all_ranks(half):
            problems.append(f"fraction {fraction}: bf16 replicas differ")
    assert_all_ranks(not problems, "; ".join(problems))


def test_bf16_factor_sums_stay_within_bf16_rounding_with_exact_counts(dp: DataParallel) -> None:
    """Factor statistics summed in bfloat16 (torch.distributed; Horovod refuses it at construction): every
    rank's factors stay within bf16's rounding of the fp32 sums, replicas stay identical, the counts travel
    in the statistics' own precision (one more small collective per factor update)."""
    if dp.backend == "horovod":
        try:
            _train_distributed(dp, 1.0, factor_comm_dtype=torch.bfloat16)
            refused = ""
        except ValueError as error:
            refused = str(error)
        assert_all_ranks("cannot" in refused, f"Horovod took bfloat16 factor sums: {refused!r}")
        return
    problems = []
    for fraction in _fractions(dp.size):
        full, pre_full = _train_distributed(dp, fraction)
        half, pre = _train_distributed(dp, fraction, factor_comm_dtype=torch.bfloat16)
        for side in ("a_factors", "g_factors"):
            for i, (f, h) in enumerate(zip(getattr(pre_full, side), getattr(pre, side), strict=True)):
                err = _rel(h, f)
                # bf16 keeps 8 bits (4e-3 a rounding), and 5 steps on a trajectory the rounding moved add to it;
                # zero would mean no bf16 at all (the rounding alone is held by the next test)
                if not 0 < err < 3e-2:
                    problems.append(f"fraction {fraction}: {side}[{i}] is {err:.1e} off the fp32 sums")
        err = _rel(half, full)
        if not 0 < err < 2e-2:
            problems.append(f"fraction {fraction}: bf16 factor sums moved the parameters by {err:.1e}")
        if not _same_on_all_ranks(half):
            problems.append(f"fraction {fraction}: replicas differ")
        if pre.collectives["kfac.factor_counts"] != STEPS:  # one per factor update, whatever the buckets
            problems.append(f"fraction {fraction}: collectives {dict(pre.collectives)}")
    assert_all_ranks(not problems, "; ".join(problems))


def _world_groups(hvd: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Any]]:
    """The whole world as each kind of K-FAC group under Horovod: a process set, and an mpi4py sub-communicator
    (what K-FAC falls back to without dynamic process sets)."""
    from kfac.comm import HorovodCommunicator as Comm

    world = tuple(range(hvd.size()))
    yield "horovod", Comm(hvd).groups([world])
    with monkeypatch.context() as patch:
        patch.setattr(Comm, "_process_sets", lambda self, partition: None)
        yield "mpi4py", Comm(hvd)._mpi_group([world], world)


@needs_horovod
def test_groups_gather_what_mpi_allgatherv_gathers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both group kinds (Horovod process sets, mpi4py sub-communicators) against MPI's own Allgatherv, with a
    member that sends nothing and a bfloat16 payload."""
    from mpi4py import MPI

    hvd = _horovod()
    rank, size = hvd.rank(), hvd.size()

    sizes = [0 if r == 1 else r + 2 for r in range(size)]
    mine = torch.arange(sizes[rank], dtype=torch.float64) + 100 * rank
    counts = sizes
    want = torch.zeros(sum(sizes), dtype=torch.float64)
    MPI.COMM_WORLD.Allgatherv(mine.numpy(), (want.numpy(), counts))
    problems = []
    for kind, group in _world_groups(hvd, monkeypatch):
        for dtype in (torch.float64, torch.bfloat16):
            parts = group.wait_gathered(group.allgather_async(mine.to(dtype), sizes, f"test.gather.{kind}.{dtype}"))
            got = torch.cat(parts).to(torch.float64)
            if [p.numel() for p in parts] != sizes or not torch.equal(got, want.to(dtype).to(torch.float64)):
                problems.append(f"{kind} {dtype}: {got.tolist()} != {want.tolist()}")
    assert_all_ranks(not problems, "; ".join(problems))


def _alltoall_splits(size: int) -> list[list[int]]:
    """splits[r][j]: what rank r sends rank j; uneven, some zero, and rank 1 sends nothing at all."""
    return [[0 if r == 1 else (r + 2 * j) % 3 for j in range(size)] for r in range(size)]


@needs_horovod
def test_groups_exchange_what_mpi_alltoallv_exchanges(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both group kinds (Horovod process sets, mpi4py sub-communicators) against MPI's own Alltoallv, with a
    member that sends nothing and a bfloat16 payload."""
    from mpi4py import MPI

    hvd = _horovod()
    rank, size = hvd.rank(), hvd.size()

    splits = _alltoall_splits(size)
    send, recv = splits[rank], [splits[k][rank] for k in range(size)]
    mine = torch.arange(sum(send), dtype=torch.float64) + 100 * rank
    want = torch.zeros(sum(recv), dtype=torch.float64)
    MPI.COMM_WORLD.Alltoallv((mine.numpy(), send), (want.numpy(), recv))
    problems = []
    for kind, group in _world_groups(hvd, monkeypatch):
        for dtype in (torch.float64, torch.bfloat16):
            got = group.wait_alltoall(group.alltoall_async(mine.to(dtype), send, recv,
                                                           f"test.alltoall.{kind}.{dtype}"))
            if got.dtype != dtype or not torch.equal(got, want.to(dtype)):
                problems.append(f"{kind} {dtype}: {got.tolist()} != {want.tolist()}")
    assert_all_ranks(not problems, "; ".join(problems))


def _payload(member: int, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """What ``member`` sends, known on every rank (seeded by the member): no two elements alike."""
    g = torch.Generator().manual_seed(7 + member)
    return [torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) for shape in shapes]


def test_every_sharing_rule_moves_the_same_bits(dp: DataParallel) -> None:
    """gather_from_each by allgather, sum and scatter hands every rank exactly what each member sent (through the
    wire's precision), for fp64, fp32 and a bfloat16 wire, with members that send nothing, a total below the
    group's size and one dominant member; scatter counts as two collectives."""
    size, rank = dp.size, dp.rank
    comm = dp.communicator() or default_communicator()
    group = comm.groups([tuple(range(size))])
    collectives: dict[str, int] = defaultdict(int)
    layouts = {
        "uneven": {m: [] if m == 1 else [(m + 1, 3), (2,)] for m in range(size)},
        "total below W": {m: [(1,)] if m == 0 else [] for m in range(size)},
        "one dominant": {m: [(40, 7), (3,)] if m == size - 1 else [(1,)] if m == 0 else [] for m in range(size)},
    }
    problems = []
    for dtype, wire in ((torch.float64, None), (torch.float32, None), (torch.float32, torch.bfloat16)):
        sharing = Sharing(rank, lambda: torch.device("cpu"), wire, collectives)
        for label, shapes in layouts.items():
            sent = {m: _payload(m, shapes[m], dtype) for m in range(size)}
            want = {m: [t.to(wire or dtype).to(dtype) for t in sent[m]] for m in range(size)}
            payloads = {m: (shapes[m], sent[m] if m == rank else None, dtype) for m in range(size)}
            for rule in ("allgather", "sum", "scatter"):
                sharing.rule = rule
                before = collectives["test.share"]
                got = sharing.gather_from_each(group, "test.share", payloads)
                issued = collectives["test.share"] - before
                same = all(len(got[m]) == len(want[m]) and all(
                    g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)
                    for g, w in zip(got[m], want[m], strict=True)) for m in range(size))
                if not same or issued != (2 if rule == "scatter" else 1):
                    problems.append(f"{dtype} wire {wire} {label} {rule}: equal {same}, {issued} collectives")
    assert_all_ranks(not problems, "; ".join(problems))


def test_factor_examples_on_n_ranks_equal_one_rank_accumulating_n_passes(dp: DataParallel) -> None:
    """factor_examples is the step's budget over ranks and passes: N ranks taking their shares equal one process
    whose N accumulated passes are the N ranks' shards (the shares of 6 on 4 ranks: 2, 2, 1, 1)."""
    size, budget = dp.size, 6
    distributed, _ = _train_distributed(dp, 1.0, factor_examples=budget)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pre = KFACPreconditioner(model, communicator=SingleProcess(), skip_layers=["extra"], factor_examples=budget,
                             backward_passes_per_step=size, **SETTINGS)
    for step in range(STEPS):
        x, y = _batch(step, PER_RANK * size)
        optimizer.zero_grad()
        for shard in torch.arange(PER_RANK * size).chunk(size):
            (F.cross_entropy(model(x[shard]), y[shard]) / size).backward()
        pre.step()
        optimizer.step()
    all_examples, _ = _train_distributed(dp, 1.0)
    err, differs = _rel(distributed, _flat(model)), _rel(distributed, all_examples)
    assert_all_ranks(err < 1e-5 and differs > 1e-6,
                     f"against one process with {size} passes: {err:.1e}; against all examples: {differs:.1e}")


@pytest.mark.parametrize("rule", ["allgather", "sum", "scatter"])
def test_both_sharing_collectives_equal_the_broadcasts_bit_for_bit(rule: str, dp: DataParallel,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Decompositions (every fraction) and preconditioned gradients (fraction < 1), shared per group by the
    allgather, the zero-padded sum or scatter (an alltoall then an allgather of equal chunks), give exactly the
    parameters that one MPI broadcast per group member gives (fp64)."""
    problems = []
    for fraction in _fractions(dp.size):
        with monkeypatch.context() as patch:
            patch.setattr(Sharing, "rule", rule)
            forced, _ = _train_distributed(dp, fraction)
        with monkeypatch.context() as patch:
            patch.setattr(Sharing, "gather_from_each", _broadcast_from_each)
            broadcast, _ = _train_distributed(dp, fraction)
        if not torch.equal(forced, broadcast):
            problems.append(f"fraction {fraction}: {rule} and broadcasts differ by {_rel(forced, broadcast):.1e}")
    assert_all_ranks(not problems, "; ".join(problems))


def test_share_by_takes_the_cheaper_collective() -> None:
    from kfac.sharing import SCATTER_OVERHEAD_ELEMENTS as extra
    from kfac.sharing import share_by

    assert share_by([10, 10, 10, 10]) == "allgather"  # balanced: W·max = Σ
    assert share_by([100, 0, 0, 0]) == "sum"  # one owner: W·max = 4Σ > 2Σ
    assert share_by([10, 10, 0, 0]) == "allgather"  # W·max = 2Σ: a tie goes to the gather
    assert share_by([100, 0, 0, 0], "allgather") == "allgather"
    assert share_by([0, 0, 0, 0]) == "allgather"  # nothing to share: the gather sends nothing
    # a few large owners: max + Σ beats 2Σ and W·max once the saving pays for scatter's second collective
    big = 4 * extra
    assert share_by([big, big, 0, 0, 0, 0, 0, 0]) == "scatter"  # 8·big, 4·big, 3·big + extra
    assert share_by([100, 100, 0, 0, 0, 0, 0, 0]) == "sum"  # too small to pay for a second collective
    assert share_by([big, extra - 1, 0, 0, 0, 0, 0, 0]) == "sum"  # saves Σ - max < extra over the sum
    assert share_by([big, extra + 1, 0, 0, 0, 0, 0, 0]) == "scatter"
    assert share_by([big] * 8) == "allgather"  # balanced: W·max = Σ < max + Σ
    assert share_by([1, 0], "scatter") == "scatter"
    with pytest.raises(ValueError, match="rule"):
        share_by([1, 0], "reduce")


def _steps(dp: DataParallel, model: nn.Module, optimizer: Any, pre: KFACPreconditioner, steps: range) -> None:
    for step in steps:
        x, y = _batch(step, PER_RANK * dp.size)
        shard = slice(dp.rank * PER_RANK, (dp.rank + 1) * PER_RANK)
        optimizer.zero_grad()
        F.cross_entropy(model(x[shard]), y[shard]).backward()
        optimizer.synchronize()
        pre.step()
        with optimizer.skip_synchronize():
            optimizer.step()


@pytest.mark.parametrize("late", [False, True], ids=["now", "late"])
def test_a_resume_between_inverse_updates_is_exact_and_loads_on_one_rank(dp: DataParallel, late: bool) -> None:
    """With fraction 1/world each rank holds only its layers' decompositions, yet any rank's state is complete:
    stopped after step 3 (inverse updates every 2nd step) and resumed on the same ranks, the run ends bit-identical
    to the one never stopped; loaded on one process, the state gives each layer the decomposition its grad worker
    held, bit for bit."""
    stop, total = 3, 6

    def built() -> tuple[nn.Module, Any, KFACPreconditioner]:
        model = _model()
        optimizer = dp.optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model)
        pre = KFACPreconditioner(model, grad_worker_fraction=1.0 / dp.size, skip_layers=["extra"],
                                 communicator=dp.communicator(), late_decompositions=late, **SETTINGS)
        return model, optimizer, pre

    model, optimizer, pre = built()
    _steps(dp, model, optimizer, pre, range(stop))
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
             "optimizer": copy.deepcopy(optimizer.state_dict()), "kfac": pre.state_dict()}  # momentum: live
    held = [None if d is None else [t.clone() for side in d for t in side] for d in pre._held.pairs]
    _steps(dp, model, optimizer, pre, range(stop, total))

    single = KFACPreconditioner(_model(), skip_layers=["extra"], communicator=SingleProcess(),
                                late_decompositions=late, **SETTINGS)
    single.load_state_dict(saved["kfac"])
    single._restore_decompositions()  # what its next step() does first
    problems = []
    for i, mine in enumerate(held):
        if mine is not None and not all(torch.equal(a, b) for a, b in
                                        zip(mine, [t for side in single._held.pairs[i] for t in side], strict=True)):
            problems.append(f"{pre.layers[i].name}: the decomposition restored on one process differs")

    model2, optimizer2, pre2 = built()
    model2.load_state_dict(saved["model"])
    optimizer2.load_state_dict(saved["optimizer"])
    pre2.load_state_dict(saved["kfac"])
    _steps(dp, model2, optimizer2, pre2, range(stop, total))
    if not torch.equal(_flat(model2), _flat(model)):
        problems.append(f"resumed at step {stop}: {_rel(_flat(model2), _flat(model)):.1e} off the run never stopped")
    assert_all_ranks(not problems, "; ".join(problems))
