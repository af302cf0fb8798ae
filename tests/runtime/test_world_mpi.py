"""Collective checks of the rank/world module and of Horovod against MPI's own collectives.

Run by `mpiexec -n 4 python -m pytest --with-mpi -m mpi`; each verdict is collective.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.backends import HOROVOD, needs_horovod
from tests.support.mpi_harness import assert_all_ranks

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture(scope="module")
def me():
    from hpcdl.runtime import world

    return world.init(use_horovod=HOROVOD)


@needs_horovod
def test_rank_size_and_local_rank_agree_with_mpi(me) -> None:
    import horovod.torch as hvd
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    ok = (
        me.rank == comm.Get_rank() == hvd.rank()
        and me.size == comm.Get_size() == hvd.size()
        and me.local_rank == node.Get_rank() == hvd.local_rank()
        and me.local_size == node.Get_size() == hvd.local_size()
        and me.device.type == "cpu"
        and me.threads >= 1
    )
    node.Free()
    assert_all_ranks(ok, f"world {me} vs MPI rank {comm.Get_rank()}/{comm.Get_size()}")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32, torch.float64])
@needs_horovod
def test_horovod_allreduce_sums_equal_mpi_allreduce(me, dtype) -> None:
    import horovod.torch as hvd
    from mpi4py import MPI

    generator = torch.Generator().manual_seed(1000 + me.rank)
    if dtype.is_floating_point:
        local = torch.randn(1031, generator=generator, dtype=dtype)
    else:
        local = torch.randint(-1000, 1000, (1031,), generator=generator, dtype=dtype)
    ours = hvd.allreduce(local, op=hvd.Sum, name=f"sum.{dtype}").numpy()
    reference = np.empty_like(local.numpy())
    MPI.COMM_WORLD.Allreduce(local.numpy(), reference, op=MPI.SUM)
    if dtype.is_floating_point:
        ok = np.allclose(ours, reference, rtol=1e-6 if dtype == torch.float32 else 1e-12, atol=1e-5)
    else:
        ok = np.array_equal(ours, reference)
    assert_all_ranks(ok, f"{dtype}: max difference {np.abs(ours - reference).max()}")


@needs_horovod
def test_broadcast_parameters_makes_models_identical(me) -> None:
    import horovod.torch as hvd
    from mpi4py import MPI

    from hpcdl.training.models import build_model

    torch.manual_seed(me.rank)  # a different initialisation on every rank
    model = build_model("resnet20", 10, 3)
    before = MPI.COMM_WORLD.allgather(float(sum(p.detach().sum() for p in model.parameters())))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    flat = torch.cat([t.flatten().double() for t in model.state_dict().values()]).numpy()
    root = MPI.COMM_WORLD.bcast(flat if me.rank == 0 else None, root=0)
    ok = len(set(before)) == me.size and np.array_equal(flat, root)
    assert_all_ranks(ok, "parameters differ from rank 0 after broadcast_parameters")


def test_training_in_process_ends_with_identical_replicas(me, tmp_path_factory) -> None:
    """A short digits run inside the test's ranks; parameters compared bit for bit across ranks."""
    from mpi4py import MPI

    from hpcdl.training.config import parse_config
    from hpcdl.training.train import train

    out = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("inproc")) if me.rank == 0 else None, root=0)
    result = train(parse_config(["--epochs", "2", "--output-dir", out, "--no-progress", "--stall-timeout", "0"]))
    flat = torch.cat([t.flatten().double() for t in result.model.state_dict().values()]).numpy()
    root = MPI.COMM_WORLD.bcast(flat if me.rank == 0 else None, root=0)
    ok = np.array_equal(flat, root) and result.summary["final_accuracy"] > 0.5
    assert_all_ranks(ok, f"rank {me.rank} parameters differ or accuracy {result.summary['final_accuracy']}")
