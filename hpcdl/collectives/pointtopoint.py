"""Point-to-point building blocks the allreduce algorithms are made of.

Everything here moves raw bytes of contiguous numpy slices with mpi4py's buffer
(upper-case) API: no pickling, no per-element Python work. Reductions are numpy ufuncs
writing into preallocated memory (``combine(a, b, out=a)``).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from hpcdl.collectives.arguments import Combine

# Received data is reduced in segments of this size, so that what has just arrived is still
# in cache when it is added, and the scratch buffer stays small however large the message.
SEGMENT_BYTES = 1 << 20

_TAG = 4242  # our messages travel on a private duplicate of the caller's communicator (see private_comm)


def as_bytes(array: np.ndarray) -> list:
    """An mpi4py message spec for a contiguous array's raw bytes (any dtype, zero copies)."""
    return [array, MPI.BYTE]


_private_keyval: int | None = None


def private_comm(comm: MPI.Comm) -> MPI.Comm:
    """A duplicate of ``comm`` cached on it, so our messages never match the caller's own receives.

    Libraries built from point-to-point calls should not send on the user's communicator: a
    user's pending MPI.ANY_TAG receive could take our data. The duplicate is made once per
    communicator (collectively, on first use) and freed together with it.
    """
    global _private_keyval
    if comm.Get_size() == 1:
        return comm
    if _private_keyval is None:
        _private_keyval = MPI.Comm.Create_keyval(delete_fn=_free_private)
    private = comm.Get_attr(_private_keyval)
    if private is None:
        private = comm.Dup()
        comm.Set_attr(_private_keyval, private)
    return private  # type: ignore[return-value]


def _free_private(comm: MPI.Comm, keyval: int, private: MPI.Comm) -> None:
    if not MPI.Is_finalized() and private != MPI.COMM_NULL:
        private.Free()


def chunk_bounds(length: int, parts: int) -> np.ndarray:
    """Offsets splitting ``length`` elements into ``parts`` contiguous chunks whose sizes differ by at most one.

    Chunk i is [bounds[i], bounds[i + 1]); the first ``length % parts`` chunks get the extra element,
    and chunks are empty when there are fewer elements than parts.
    """
    base, extra = divmod(length, parts)
    sizes = np.full(parts, base, dtype=np.int64)
    sizes[:extra] += 1
    return np.concatenate([[0], np.cumsum(sizes)])


def segment_count(longest: int, itemsize: int) -> int:
    """How many segments a message of ``longest`` elements is cut into (at least one: empty messages still pair up)."""
    per_segment = max(1, SEGMENT_BYTES // itemsize)
    return max(1, -(-longest // per_segment))


def sendrecv_reduce(
    comm: MPI.Comm,
    send: np.ndarray,
    dest: int,
    mine: np.ndarray,
    out: np.ndarray,
    source: int,
    combine: Combine,
    segments: int,
) -> None:
    """Send ``send`` to ``dest`` while receiving ``source``'s data; ``out = mine (op) received``.

    ``out`` may be ``mine`` (reduce in place) or another buffer of the same length (reduce out of
    place, which spares a copy of the caller's data). Both messages are cut into the same number
    of ``segments`` (the caller makes sure that the sender and the receiver of each message agree
    on it), and each received segment is reduced straight away through a small scratch buffer.
    """
    send_step = -(-send.size // segments)
    mine_step = -(-mine.size // segments)
    scratch = np.empty(mine_step, dtype=mine.dtype)
    for index in range(segments):
        part = slice(index * mine_step, (index + 1) * mine_step)
        incoming = scratch[: mine[part].size]
        comm.Sendrecv(
            as_bytes(send[index * send_step : (index + 1) * send_step]), dest, _TAG, as_bytes(incoming), source, _TAG
        )
        combine(mine[part], incoming, out=out[part])


def sendrecv(comm: MPI.Comm, send: np.ndarray, dest: int, receive: np.ndarray, source: int) -> None:
    """Send ``send`` to ``dest`` while receiving ``source``'s data into ``receive`` (no reduction)."""
    comm.Sendrecv(as_bytes(send), dest, _TAG, as_bytes(receive), source, _TAG)


def send(comm: MPI.Comm, data: np.ndarray, dest: int) -> None:
    comm.Send(as_bytes(data), dest, _TAG)


def receive(comm: MPI.Comm, into: np.ndarray, source: int) -> None:
    comm.Recv(as_bytes(into), source, _TAG)


def isend(comm: MPI.Comm, data: np.ndarray, dest: int) -> MPI.Request:
    return comm.Isend(as_bytes(data), dest, _TAG)
