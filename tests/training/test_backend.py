"""hpcdl.training.backend in one process: which errors mean a lost rank, the collectives' timeout, and DDP's
no_sync around every micro-batch but the last (a one-rank process group, no process started)."""

from __future__ import annotations

import importlib.util
import os
from argparse import Namespace
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hpcdl.runtime import rendezvous, world
from hpcdl.runtime.errors import UsageError
from hpcdl.training import backend as backends
from hpcdl.training.backend import Backend, HorovodBackend, TorchBackend, collective_timeout, for_config, is_lost_rank
from hpcdl.training.config import parse_config

HOROVOD = importlib.util.find_spec("horovod") is not None


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


def test_config_checks_ask_the_chosen_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend's flag rules are its own class's: config.validate asks whichever class --backend names."""
    class Third(TorchBackend):
        @classmethod
        def check_flags(cls, config: Any) -> None:
            raise UsageError("third backend refuses")

    monkeypatch.setitem(backends.BACKENDS, "torch", Third)
    with pytest.raises(UsageError, match="third backend refuses"):
        parse_config(["--backend", "torch"])
    if HOROVOD:
        assert isinstance(for_config(parse_config(["--backend", "horovod"]), 2), HorovodBackend)


@pytest.mark.parametrize("world_size, amp, cuda, message", [
    (3, "off", False, "power-of-two number of ranks \\(Horovod's Adasum\\), got 3"),
    (2, "bf16", True, "--use-adasum cannot be combined with --amp on CUDA"),
    (2, "bf16", False, None), (4, "off", True, None), (1, "bf16", True, None),
])
def test_adasum_world_rules_are_horovods(world_size: int, amp: str, cuda: bool, message: str | None) -> None:
    config = Namespace(use_adasum=True, amp=amp)
    if message is None:
        HorovodBackend.check_world(config, world_size, cuda)
    else:
        with pytest.raises(UsageError, match=message):
            HorovodBackend.check_world(config, world_size, cuda)
    TorchBackend.check_world(config, 3, cuda)  # checks nothing: --use-adasum is refused under torch before
    HorovodBackend.check_world(Namespace(use_adasum=False, amp=amp), 3, cuda)


def test_only_horovod_with_adasum_updates_inside_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    def never() -> torch.Tensor:
        raise AssertionError("the loop's own update runs")

    rule = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    assert Backend(2).apply_in_backward(rule, never) is None and TorchBackend(2).apply_in_backward(rule, never) is None
    assert HorovodBackend(2, adasum=False).apply_in_backward(rule, never) is None
    assert HorovodBackend(1, adasum=True).apply_in_backward(rule, never) is None  # one rank averages as usual
    monkeypatch.setenv("HOROVOD_TIMELINE", "DYNAMIC")
    assert TorchBackend(2).timeline() is None and HorovodBackend(1).timeline() is None


def test_only_horovod_starts_horovod_and_only_torch_starts_a_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[tuple[bool, bool, float | None]] = []
    monkeypatch.setattr(world, "init", lambda use_horovod, torch_distributed, timeout_seconds:
                        started.append((use_horovod, torch_distributed, timeout_seconds)))
    monkeypatch.setenv("HOROVOD_TIMELINE", "")  # recorded, so the teardown removes what the start sets
    monkeypatch.delenv("HOROVOD_TIMELINE")
    TorchBackend.start_world(Namespace(profile_steps="2:3"), 7.0)
    assert "HOROVOD_TIMELINE" not in os.environ
    HorovodBackend.start_world(Namespace(profile_steps="2:3"), None)
    assert os.environ.get("HOROVOD_TIMELINE") == "DYNAMIC"  # told before Horovod starts, so a window can follow
    assert started == [(False, True, 7.0), (True, False, None)]
    assert backends.named("torch") is TorchBackend and backends.named("horovod") is HorovodBackend
