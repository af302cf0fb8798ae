"""Argument checking and buffer conversion shared by every allreduce algorithm.

Each algorithm reads the caller's data as one flat, contiguous numpy array and writes the
reduction into a new flat array. This module prepares both, and turns the result back into
what the caller passed (a numpy array or a CPU torch tensor of the same shape and dtype).

The checks are collective: if one rank passes a different length, dtype or op than the
others, or something unusable, a point-to-point algorithm would hang or silently mix up
bytes. So every rank first describes its arguments in one small MPI.Allreduce, and if the
ranks disagree every rank raises the same one-line CollectiveArgumentError.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

try:  # torch is optional for this module: numpy arrays work without it
    import torch
except ImportError:  # pragma: no cover - torch is a dependency of hpcdl
    torch = None  # type: ignore[assignment]


class CollectiveArgumentError(ValueError):
    """The ranks called a collective with arguments that cannot work together (raised on every rank)."""


# The dtypes the algorithms accept: the ones numpy reduces natively and MPI has a type for.
SUPPORTED_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(name)
    for name in (
        "int8", "int16", "int32", "int64",
        "uint8", "uint16", "uint32", "uint64",
        "float32", "float64",
    )
)  # fmt: skip

# MPI's reduction ops and the numpy ufuncs that compute them elementwise.
SUPPORTED_OPS: tuple[tuple[MPI.Op, str, np.ufunc], ...] = (
    (MPI.SUM, "SUM", np.add),
    (MPI.PROD, "PROD", np.multiply),
    (MPI.MAX, "MAX", np.maximum),
    (MPI.MIN, "MIN", np.minimum),
)

Combine = Callable[..., np.ndarray]  # a binary ufunc called as combine(a, b, out=a)


@dataclass
class Allreduce:
    """One validated allreduce call: the caller's data, the new result buffer, and how to give it back."""

    source: np.ndarray  # the caller's data, flat and contiguous (a view when possible): read, never written
    result: np.ndarray  # new, flat, uninitialised: the algorithm fills it with the reduction
    combine: np.ufunc
    comm: MPI.Comm
    average: bool
    _to_caller: Callable[[np.ndarray], Any]

    def finish(self) -> Any:
        """The result in the caller's type, shape and dtype (divided by the world size if averaging)."""
        if self.average:
            np.divide(self.result, self.comm.Get_size(), out=self.result)
        return self._to_caller(self.result)


def prepare(algorithm: str, buf: Any, comm: MPI.Comm, op: MPI.Op, average: bool) -> Allreduce:
    """Check the arguments on every rank together and return the call's source and result buffers.

    Collective: every rank of ``comm`` must call it. Raises CollectiveArgumentError on every
    rank when any rank's arguments are unusable or the ranks disagree.
    """
    if not isinstance(comm, MPI.Comm) or comm.Is_inter():
        # Nothing collective can be done without a usable intracommunicator; every rank sees this alike.
        raise CollectiveArgumentError(f"{algorithm}: comm must be an mpi4py intracommunicator, got {comm!r}")
    problem: str | None = None
    array = None
    to_caller: Callable[[np.ndarray], Any] = lambda result: result
    op_index = _op_index(op)
    try:
        array, to_caller = _as_numpy(buf)
        if op_index < 0:
            raise TypeError(f"op must be one of MPI.SUM, MPI.PROD, MPI.MAX, MPI.MIN, got {op!r}")
        if average and SUPPORTED_OPS[op_index][0] != MPI.SUM:
            raise TypeError(f"average=True only makes sense with MPI.SUM, got MPI.{SUPPORTED_OPS[op_index][1]}")
        if average and array.dtype.kind != "f":
            raise TypeError(f"average=True needs a floating-point buffer, got {array.dtype}")
    except TypeError as error:
        problem = str(error)

    _agree(algorithm, comm, problem, array, op_index, average)
    assert array is not None  # _agree raised otherwise
    # No working copy: algorithms read the caller's data where they first need it and write
    # `result = source (op) incoming` out of place, saving a full pass over memory (as MPI does).
    source = np.ascontiguousarray(array).reshape(-1)  # copies only if the caller's array is strided
    result = np.empty(array.size, dtype=array.dtype)
    return Allreduce(source, result, SUPPORTED_OPS[op_index][2], comm, average, to_caller)


def _op_index(op: Any) -> int:
    for index, (mpi_op, _, _) in enumerate(SUPPORTED_OPS):
        if isinstance(op, MPI.Op) and op == mpi_op:
            return index
    return -1


def _as_numpy(buf: Any) -> tuple[np.ndarray, Callable[[np.ndarray], Any]]:
    """A numpy view of ``buf`` and a function turning a flat result back into ``buf``'s type and shape."""
    shape: tuple[int, ...]
    if isinstance(buf, np.ndarray):
        array, shape = buf, buf.shape
        to_caller = lambda result: result.reshape(shape)  # noqa: E731
    elif torch is not None and isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise TypeError(
                f"expected a CPU torch tensor, got one on {buf.device} (use Horovod or NCCL for GPU tensors)"
            )
        try:
            array = buf.detach().resolve_conj().resolve_neg().numpy()
        except (TypeError, RuntimeError) as error:  # e.g. bfloat16 has no numpy dtype
            raise TypeError(f"unsupported tensor dtype {buf.dtype}: {error}") from None
        shape = tuple(buf.shape)
        to_caller = lambda result: torch.from_numpy(result.reshape(shape))  # noqa: E731
    else:
        raise TypeError(f"expected a numpy array or a CPU torch tensor, got {type(buf).__name__}")
    if array.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"unsupported dtype {array.dtype}; supported: {names}")
    return array, to_caller


def _agree(
    algorithm: str, comm: MPI.Comm, problem: str | None, array: np.ndarray | None, op_index: int, average: bool
) -> None:
    """Raise CollectiveArgumentError on every rank unless all ranks' arguments are usable and identical.

    One MPI.Allreduce(MAX) over (problem flag, x, -x) gives every rank both the maximum and the
    minimum of each field: the ranks agree exactly when they are equal. Only on disagreement is
    a second, pickled allgather spent on a message that says who passed what.
    """
    if array is None:
        fields = [1, -1, -1, op_index, int(average)]
    else:
        fields = [int(problem is not None), array.size, SUPPORTED_DTYPES.index(array.dtype), op_index, int(average)]
    if comm.Get_size() > 1:
        encoded = np.array(fields, dtype=np.int64)
        extremes = np.concatenate([encoded, -encoded])
        comm.Allreduce(MPI.IN_PLACE, extremes, op=MPI.MAX)
        highest, lowest = extremes[: len(fields)], -extremes[len(fields) :]
        if highest[0] == 0 and np.array_equal(highest, lowest):
            return
    elif problem is None:
        return

    mine = (problem, _describe(array, op_index, average))
    reports = comm.allgather(mine) if comm.Get_size() > 1 else [mine]
    problems = {rank: text for rank, (text, _) in enumerate(reports) if text is not None}
    if problems:
        parts = [f"rank {rank}: {text}" for rank, text in problems.items()]
        raise CollectiveArgumentError(f"{algorithm}: bad arguments on {'; '.join(parts)}")
    texts = [text for _, text in reports]
    raise CollectiveArgumentError(f"{algorithm}: ranks disagree on the buffer: {_group_by_text(texts)}")


def _describe(array: np.ndarray | None, op_index: int, average: bool) -> str:
    if array is None or op_index < 0:
        return "unusable arguments"
    text = f"{array.size} x {array.dtype}, op {SUPPORTED_OPS[op_index][1]}"
    return text + (", average" if average else "")


def _group_by_text(texts: list[str]) -> str:
    """'ranks 0,2,3: 10 x float32 ...; rank 1: 11 x float32 ...' (short even on thousands of ranks)."""
    groups: dict[str, list[int]] = {}
    for rank, text in enumerate(texts):
        groups.setdefault(text, []).append(rank)
    parts = []
    for text, ranks in groups.items():
        shown = ",".join(str(r) for r in ranks[:8]) + (f",... ({len(ranks)} ranks)" if len(ranks) > 8 else "")
        parts.append(f"{'rank' if len(ranks) == 1 else 'ranks'} {shown}: {text}")
    return "; ".join(parts)
