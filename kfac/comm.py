"""The collectives K-FAC needs, for one process or for a Horovod job (torch.distributed's: kfac.torch_comm;
which one a preconditioner takes by default: kfac.default_comm).

Two kinds of operation, all asynchronous: a sum-allreduce over all ranks (the factor statistics,
started during backward), and inside a group of ranks an allgather, a sum-allreduce, or an alltoall
followed by an allgather of equal chunks (each member's decompositions, or its preconditioned
gradients, to every other member: one or two collectives per group and phase, whatever the group's
size; the preconditioner picks which by the payloads' balance). Groups
come from :meth:`Communicator.groups`, which every rank calls with the same partition of the ranks
at construction time. Every rank issues its collectives in the same order, which NCCL requires and
Horovod tolerates.

Inside a Horovod job, groups are Horovod process sets; adding them after ``hvd.init`` needs
``HOROVOD_DYNAMIC_PROCESS_SETS=1`` in the environment before Horovod starts. Without it, groups
fall back to mpi4py sub-communicators (the same ranks Horovod uses), with a one-time warning.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

Handle = Any


class Group(ABC):
    """The ranks of one group that this rank belongs to."""

    def __init__(self, ranks: Sequence[int]) -> None:
        self.ranks = tuple(ranks)

    @abstractmethod
    def allgather_async(self, tensor: Tensor, sizes: Sequence[int], name: str) -> Handle:
        """Start gathering every member's 1-D ``tensor``; ``sizes`` are the members' lengths in
        group order (known on every rank, zero allowed), ``tensor`` has this rank's length."""

    @abstractmethod
    def wait_gathered(self, handle: Handle) -> list[Tensor]:
        """Finish an allgather: every member's tensor, in group order (this rank's own included)."""

    @abstractmethod
    def allreduce_sum_async(self, tensor: Tensor, name: str) -> Handle:
        """Start summing ``tensor`` in place over the group's members (integer dtypes included)."""

    @abstractmethod
    def wait_sum(self, handle: Handle) -> Tensor:
        """Finish a group allreduce and return the summed tensor."""

    @abstractmethod
    def alltoall_async(self, tensor: Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                       name: str) -> Handle:
        """Start an alltoallv: this rank sends the next ``send_splits[j]`` elements of its 1-D ``tensor`` to
        member j and receives ``recv_splits[k]`` elements from member k (both in group order, zero allowed,
        known beforehand: no sizes travel)."""

    @abstractmethod
    def wait_alltoall(self, handle: Handle) -> Tensor:
        """Finish an alltoallv: what every member sent this rank, concatenated in group order."""


class Communicator(ABC):
    rank: int = 0
    size: int = 1
    # Whether allreduce_sum_async can sum bfloat16 tensors (Horovod 0.28's cannot: it aborts).
    sums_bfloat16: bool = True

    @abstractmethod
    def allreduce_sum_async(self, tensor: Tensor, name: str) -> Handle:
        """Start summing ``tensor`` in place over all ranks."""

    @abstractmethod
    def wait(self, handle: Handle) -> Tensor:
        """Finish an allreduce and return the summed tensor."""

    @abstractmethod
    def groups(self, partition: Sequence[Sequence[int]]) -> Group:
        """Collective: set up every group of ``partition`` (all ranks, same order); return this rank's."""


class _SoloGroup(Group):
    """A group of one: gathering returns the tensor itself."""

    def allgather_async(self, tensor: Tensor, sizes: Sequence[int], name: str) -> Handle:
        return tensor

    def wait_gathered(self, handle: Handle) -> list[Tensor]:
        return [handle]

    def allreduce_sum_async(self, tensor: Tensor, name: str) -> Handle:
        return tensor

    def wait_sum(self, handle: Handle) -> Tensor:
        return handle

    def alltoall_async(self, tensor: Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                       name: str) -> Handle:
        return tensor

    def wait_alltoall(self, handle: Handle) -> Tensor:
        return handle


class SingleProcess(Communicator):
    """No distribution: sums and broadcasts over one rank change nothing."""

    def allreduce_sum_async(self, tensor: Tensor, name: str) -> Handle:
        return tensor

    def wait(self, handle: Handle) -> Tensor:
        return handle

    def groups(self, partition: Sequence[Sequence[int]]) -> Group:
        return _SoloGroup((0,))


# Horovod refuses to add a process set twice; several preconditioners in one job share them.
_PROCESS_SETS: dict[tuple[int, ...], Any] = {}
_WARNED_NO_PROCESS_SETS = False


class _HorovodGroup(Group):
    def __init__(self, ranks: Sequence[int], hvd: Any, process_set: Any) -> None:
        super().__init__(ranks)
        self._hvd = hvd
        self._process_set = process_set

    def allgather_async(self, tensor: Tensor, sizes: Sequence[int], name: str) -> Handle:
        # Horovod's allgather is an allgatherv along dim 0 (lengths may differ, zero included). Its MPI
        # operations know no bfloat16: the same bits travel as int16 (a gather only moves them).
        bits = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
        return self._hvd.allgather_async(bits, name=name, process_set=self._process_set), sizes, tensor.dtype

    def wait_gathered(self, handle: Handle) -> list[Tensor]:
        hvd_handle, sizes, dtype = handle
        return list(self._hvd.synchronize(hvd_handle).view(dtype).split(list(sizes)))

    def allreduce_sum_async(self, tensor: Tensor, name: str) -> Handle:
        return self._hvd.allreduce_async_(tensor, name=name, op=self._hvd.Sum, process_set=self._process_set), tensor

    def wait_sum(self, handle: Handle) -> Tensor:
        hvd_handle, tensor = handle
        self._hvd.synchronize(hvd_handle)
        return tensor

    def alltoall_async(self, tensor: Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                       name: str) -> Handle:
        # bfloat16 travels as its int16 bits, as in the allgather; the splits are element counts along dim 0.
        bits = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
        splits = torch.tensor(list(send_splits), dtype=torch.int32)
        hvd_handle = self._hvd.alltoall_async(bits, splits=splits, name=name, process_set=self._process_set)
        return hvd_handle, sum(recv_splits), tensor.dtype

    def wait_alltoall(self, handle: Handle) -> Tensor:
        hvd_handle, expected, dtype = handle
        output, _received_splits = self._hvd.synchronize(hvd_handle)
        if output.numel() != expected:
            raise RuntimeError(f"alltoall received {output.numel()} elements, the splits promised {expected}")
        return output.view(dtype)


class _MpiGroup(Group):
    """A group as an mpi4py sub-communicator; tensors go through host memory."""

    def __init__(self, ranks: Sequence[int], comm: Any) -> None:
        super().__init__(ranks)
        self._comm = comm

    @staticmethod
    def _host_buffers(tensor: Tensor, received: int) -> tuple[Any, Any, Tensor]:
        """numpy views to send ``tensor`` and receive ``received`` elements of its dtype, and the receiving
        tensor; numpy has no bfloat16, so bf16 moves as the same bits in int16."""
        host = tensor.detach().contiguous().cpu()
        out = torch.empty(received, dtype=host.dtype)
        if host.dtype == torch.bfloat16:
            return host.view(torch.int16).numpy(), out.view(torch.int16).numpy(), out
        return host.numpy(), out.numpy(), out

    def allgather_async(self, tensor: Tensor, sizes: Sequence[int], name: str) -> Handle:
        send, recv, out = self._host_buffers(tensor, sum(sizes))
        request = self._comm.Iallgatherv(send, (recv, list(sizes)))
        return request, out, list(sizes), tensor.device

    def wait_gathered(self, handle: Handle) -> list[Tensor]:
        request, out, sizes, device = handle
        request.Wait()
        return list(out.to(device).split(sizes))

    def allreduce_sum_async(self, tensor: Tensor, name: str) -> Handle:
        from mpi4py import MPI

        host = tensor.detach().cpu() if tensor.device.type != "cpu" else tensor
        return self._comm.Iallreduce(MPI.IN_PLACE, host.numpy(), op=MPI.SUM), tensor, host

    def wait_sum(self, handle: Handle) -> Tensor:
        request, tensor, host = handle
        request.Wait()
        if host is not tensor:
            tensor.copy_(host)
        return tensor

    def alltoall_async(self, tensor: Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                       name: str) -> Handle:
        send, recv, out = self._host_buffers(tensor, sum(recv_splits))
        request = self._comm.Ialltoallv((send, list(send_splits)), (recv, list(recv_splits)))
        return request, out, tensor.device

    def wait_alltoall(self, handle: Handle) -> Tensor:
        request, out, device = handle
        request.Wait()
        return out.to(device)


class HorovodCommunicator(Communicator):
    """Collectives of a running Horovod job (``hvd.init`` done, more than one rank)."""

    sums_bfloat16 = False  # Horovod 0.28 aborts on a bfloat16 allreduce (its MPI and Gloo ops know no bf16)

    def __init__(self, hvd: Any) -> None:
        self._hvd = hvd
        self.rank = hvd.rank()
        self.size = hvd.size()

    def allreduce_sum_async(self, tensor: Tensor, name: str) -> Handle:
        return self._hvd.allreduce_async_(tensor, name=name, op=self._hvd.Sum), tensor

    def wait(self, handle: Handle) -> Tensor:
        hvd_handle, tensor = handle
        self._hvd.synchronize(hvd_handle)
        return tensor

    def groups(self, partition: Sequence[Sequence[int]]) -> Group:
        groups = [tuple(sorted(group)) for group in partition]
        mine = next(group for group in groups if self.rank in group)
        if len(mine) == 1 and all(len(group) == 1 for group in groups):
            return _SoloGroup(mine)
        if len(mine) == self.size:
            return _HorovodGroup(mine, self._hvd, self._hvd.global_process_set)
        sets = self._process_sets(groups)
        if sets is not None:
            return _HorovodGroup(mine, self._hvd, sets[mine])
        return self._mpi_group(groups, mine)

    def _process_sets(self, partition: list[tuple[int, ...]]) -> dict[tuple[int, ...], Any] | None:
        """Horovod process sets for every group, or None when Horovod cannot add them now."""
        global _WARNED_NO_PROCESS_SETS
        try:
            for group in partition:
                if group not in _PROCESS_SETS:
                    _PROCESS_SETS[group] = self._hvd.add_process_set(list(group))
        except ValueError as error:  # same on every rank: dynamic sets off, or a set someone else added
            if not _WARNED_NO_PROCESS_SETS and self.rank == 0:
                warnings.warn(
                    f"K-FAC uses mpi4py sub-communicators for its rank groups ({error}); set "
                    "HOROVOD_DYNAMIC_PROCESS_SETS=1 before Horovod starts to use Horovod process sets",
                    stacklevel=3,
                )
            _WARNED_NO_PROCESS_SETS = True
            return None
        return {group: _PROCESS_SETS[group] for group in partition}

    def _mpi_group(self, partition: list[tuple[int, ...]], mine: tuple[int, ...]) -> Group:
        from mpi4py import MPI

        color = partition.index(mine)
        return _MpiGroup(mine, MPI.COMM_WORLD.Split(color, key=self.rank))


def chunk_overlaps(sizes: Sequence[int]) -> tuple[list[list[int]], int]:
    """How members' parts meet equal chunks: (``overlaps[i][j]``, the elements of member i's part in chunk j; C).

    The parts, concatenated in member order (T elements), are cut into W = len(sizes) chunks of
    C = ceil(T / W) elements; chunk j is elements [j·C, (j+1)·C) of the total, so the last chunks are
    shorter or empty (their holders pad them with zeros to C). Row i is what member i sends to each
    member in the alltoall that hands member j chunk j; column j is what member j receives from each.
    """
    width = len(sizes)
    total = sum(sizes)
    chunk = -(-total // width) if width else 0
    overlaps: list[list[int]] = []
    start = 0
    for size in sizes:
        end = start + size
        overlaps.append([max(0, min(end, (j + 1) * chunk) - max(start, j * chunk)) for j in range(width)])
        start = end
    return overlaps, chunk


def tensors_to_buffer(tensors: Sequence[Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Concatenate flattened tensors into one buffer (an empty one for no tensors)."""
    if not tensors:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat([t.reshape(-1).to(dtype) for t in tensors])


def buffer_to_tensors(buffer: Tensor, shapes: Sequence[Sequence[int]]) -> list[Tensor]:
    """The inverse of :func:`tensors_to_buffer` for tensors of the given shapes."""
    out, offset = [], 0
    for shape in shapes:
        numel = 1
        for size in shape:
            numel *= size
        out.append(buffer[offset : offset + numel].view(*shape))
        offset += numel
    if offset != buffer.numel():
        raise ValueError(f"buffer holds {buffer.numel()} numbers, shapes need {offset}")
    return out
