"""How a job averages its gradients over the ranks: Horovod or torch.distributed, behind one interface.

The job (hpcdl.training.job) asks its backend to broadcast the initial state and to wrap the model
and the update rule; the loop (hpcdl.training.loop) asks it which micro-batches accumulate without
communicating, to finish the allreduce before K-FAC and the update, and for the context the update
runs in. hpcdl's own coordination (errors agreed on every rank, the stall watchdog, the stop flag,
metrics and checkpoint broadcasts) runs beside it, over MPI or, in a torch job that torchrun or plain
srun started, over a Gloo group of its own (hpcdl.runtime.coordination).

* :class:`HorovodBackend`: Horovod's DistributedOptimizer allreduces in backward hooks (fp16
  compression, Adasum, ``backward_passes_per_step`` accumulation); ``synchronize`` waits for them.
* :class:`TorchBackend`: DistributedDataParallel (bucketed allreduces overlapping backward) on a
  process group started from MPI's ranks or from the environment (hpcdl.runtime.rendezvous): NCCL
  on GPUs, Gloo on CPUs. Buffers
  (BatchNorm's running statistics) are not broadcast each step, as under Horovod: each rank keeps
  its own and rank 0's are saved. Accumulation skips the allreduce with ``no_sync``;
  ``--fp16-allreduce`` is torch's fp16 compression hook.

Both average the same way (each gradient's sum over ranks divided by their number, in an order fixed
per tensor), so a checkpoint written under one resumes under the other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn

from hpcdl.training.config import TrainConfig

T = TypeVar("T")


class Backend:
    """What is common: nothing to wrap or wait for on one rank."""

    name = "none"

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def broadcast_parameters(self, model: nn.Module) -> None:
        """Rank 0's parameters and buffers on every rank."""

    def wrap_optimizer(self, update_rule: torch.optim.Optimizer, model: nn.Module,
                       config: TrainConfig) -> torch.optim.Optimizer:
        return update_rule

    def wrap_model(self, model: nn.Module, config: TrainConfig) -> nn.Module:
        """The module the loop calls (``model`` may be compiled; the bare model stays the one checkpointed)."""
        return model

    def accumulating(self, model: nn.Module, micro_batches: Iterable[T]) -> Iterator[T]:
        """The micro-batches of one step; those before the last run without communicating."""
        yield from micro_batches

    def synchronize(self, optimizer: torch.optim.Optimizer) -> None:
        """Wait until the averaged gradients are in ``.grad`` (before K-FAC and the update)."""

    def stepping(self, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager[Any]:
        """The context ``optimizer.step()`` runs in, after :meth:`synchronize`."""
        return contextlib.nullcontext()

    def kfac_communicator(self) -> Any:
        """K-FAC's collectives (a ``kfac.comm.Communicator``), or None for K-FAC's default."""
        return None

    def describe(self) -> str:
        return self.name


class HorovodBackend(Backend):
    name = "horovod"

    def broadcast_parameters(self, model: nn.Module) -> None:
        """Horovod broadcasts contiguous tensors: call before the model turns channels_last."""
        import horovod.torch as hvd

        hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    def wrap_optimizer(self, update_rule: torch.optim.Optimizer, model: nn.Module,
                       config: TrainConfig) -> torch.optim.Optimizer:
        import horovod.torch as hvd

        return hvd.DistributedOptimizer(
            update_rule,
            named_parameters=model.named_parameters(),
            compression=keep_layout(hvd.Compression.fp16 if config.fp16_allreduce else hvd.Compression.none),
            backward_passes_per_step=config.batches_per_allreduce,
            op=hvd.Adasum if config.use_adasum else hvd.Average,
        )

    def synchronize(self, optimizer: Any) -> None:
        if self.world_size > 1:  # one rank has nothing to average (synchronize would still copy every gradient)
            optimizer.synchronize()

    def stepping(self, optimizer: Any) -> contextlib.AbstractContextManager[Any]:
        return optimizer.skip_synchronize()  # synchronized above; step() would otherwise wait again


class TorchBackend(Backend):
    name = "torch"

    def broadcast_parameters(self, model: nn.Module) -> None:
        import torch.distributed as dist

        if self.world_size > 1:
            for tensor in model.state_dict().values():
                dist.broadcast(tensor, src=0)

    def wrap_model(self, model: nn.Module, config: TrainConfig) -> nn.Module:
        if self.world_size == 1:
            return model  # nothing to average: DDP would only copy every gradient through its buckets
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        device = next(model.parameters()).device
        # Buffers synchronised once, at construction (as Horovod's broadcast_parameters does), not every forward.
        ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                      forward_sync_buffers=False)
        if config.fp16_allreduce:
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return ddp

    def accumulating(self, model: nn.Module, micro_batches: Iterable[T]) -> Iterator[T]:
        parts = list(micro_batches)
        for index, part in enumerate(parts):
            last = index == len(parts) - 1
            skip = model.no_sync() if isinstance(model, nn.parallel.DistributedDataParallel) and not last \
                else contextlib.nullcontext()
            with skip:  # the caller's forward and backward of ``part`` run inside
                yield part

    def kfac_communicator(self) -> Any:
        if self.world_size == 1:
            return None
        from kfac.torch_comm import TorchCommunicator

        return TorchCommunicator()

    def describe(self) -> str:
        import torch.distributed as dist

        return f"torch ({dist.get_backend()})" if dist.is_initialized() else "torch"


def collective_timeout(stall_timeout: float) -> float | None:
    """How long a torch.distributed collective waits for a peer before raising: past the stall watchdog's own
    verdicts (hpcdl.runtime.watchdog), which name the culprit, so they come first; torch's default without it."""
    if stall_timeout <= 0:
        return None
    return stall_timeout + max(10.0, stall_timeout / 2) + 30.0


def for_config(config: TrainConfig, world_size: int) -> Backend:
    """The backend ``--backend`` names."""
    return TorchBackend(world_size) if config.backend == "torch" else HorovodBackend(world_size)


def keep_layout(base: Any) -> Any:
    """Horovod's compression ``base`` for gradients of any memory layout.

    Horovod allreduces contiguous tensors only, and a channels_last model has channels_last
    gradients: they cross as contiguous copies and come back in their parameter's layout (a fused
    optimizer given a gradient of another layout than its parameter updates the wrong elements).
    """

    class KeepLayout:
        @staticmethod
        def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
            nhwc = tensor.dim() == 4 and not tensor.is_contiguous()
            compressed, context = base.compress(tensor.contiguous())
            return compressed, (context, nhwc)

        @staticmethod
        def decompress(tensor: torch.Tensor, context: Any) -> torch.Tensor:
            inner, nhwc = context
            out = base.decompress(tensor, inner)
            return out.contiguous(memory_format=torch.channels_last) if nhwc else out

    return KeepLayout


def lost_rank_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean another rank of the job is gone: Horovod shut down under this one, or a
    torch.distributed collective failed or timed out (Gloo: a peer closed its connection; NCCL: an error or
    the watchdog's timeout)."""
    import torch.distributed as dist

    kinds: list[type[BaseException]] = [dist.DistError]
    try:
        from horovod.common.exceptions import HorovodInternalError
    except ImportError:  # an install without Horovod
        pass
    else:
        kinds.append(HorovodInternalError)
    return tuple(kinds)


GLOO_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting", "Broken pipe")


def is_lost_rank(exc: BaseException) -> bool:
    """Whether ``exc`` says another rank is gone (see :func:`lost_rank_errors`; Gloo raises a plain RuntimeError
    from some paths, recognised by its message)."""
    if isinstance(exc, lost_rank_errors()):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and "gloo" in text.lower() and any(s in text for s in GLOO_PEER_LOST)
