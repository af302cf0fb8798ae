"""hpcdl.training.backend in one process: which errors mean a lost rank, the collectives' timeout, and DDP's
no_sync around every micro-batch but the last (a one-rank process group, no process started)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hpcdl.runtime import rendezvous
from hpcdl.training.backend import TorchBackend, collective_timeout, for_config, is_lost_rank
from hpcdl.training.config import parse_config


def test_gloo_and_nccl_failures_are_a_lost_rank_and_a_bug_is_not() -> None:
    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                        "[127.0.0.1]:18845. This is typically caused by a remote worker crashing.")
    assert is_lost_rank(gloo)
    # Gloo's own timeout, as torch 2.13 raises it when a peer stops answering (a frozen rank, the watchdog off)
    assert is_lost_rank(RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
                                     "Timed out waiting 3000ms for recv operation to complete"))
    assert is_lost_rank(dist.DistBackendError("NCCL error: remote process exited or there was a network error"))
    assert not is_lost_rank(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_lost_rank(ValueError("gloo Connection closed by peer"))  # only what torch raises


@pytest.mark.parametrize("stall", [4.0, 20.0, 300.0])
def test_torch_times_out_after_the_stall_watchdog_has_spoken(stall: float) -> None:
    """The watchdog (hpcdl.runtime.watchdog) names the culprit; torch's own timeout is only the last resort."""
    interval = max(0.2, min(5.0, stall / 5))
    backstop = stall + max(10.0, stall / 2) + max(5.0, 2 * interval)  # StallWatchdog's last verdict
    assert collective_timeout(stall) > backstop
    assert collective_timeout(0) is None  # the watchdog off: torch's default


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{rendezvous.free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ddp_communicates_only_after_the_last_micro_batch(one_rank_group: None) -> None:
    model = nn.parallel.DistributedDataParallel(nn.Linear(3, 2))
    syncing = [model.require_backward_grad_sync for _ in TorchBackend(2).accumulating(model, range(4))]
    assert syncing == [False, False, False, True]
    assert list(TorchBackend(2).accumulating(nn.Linear(3, 2), "ab")) == ["a", "b"]  # no DDP: nothing to skip


def test_the_torch_backend_wraps_the_model_and_not_the_optimizer(one_rank_group: None) -> None:
    config = parse_config(["--backend", "torch", "--fp16-allreduce"])
    backend = for_config(config, world_size=2)
    model = nn.Linear(3, 2)
    rule = torch.optim.SGD(model.parameters(), lr=0.1)
    assert backend.wrap_optimizer(rule, model, config) is rule and backend.kfac_communicator() is not None
    wrapped = backend.wrap_model(model, config)
    assert isinstance(wrapped, nn.parallel.DistributedDataParallel) and wrapped.module is model
    assert for_config(config, world_size=1).wrap_model(model, config) is model  # one rank: nothing to average
