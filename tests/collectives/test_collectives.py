"""Our point-to-point allreduce algorithms against MPI's own MPI.Allreduce.

Run the MPI tests with (any size >= 2; CI uses 4 and 3):
    timeout 600 mpiexec --oversubscribe -n 4 .venv/bin/python -m pytest --with-mpi -m mpi tests/collectives/test_collectives.py
Every MPI test also runs on sub-communicators of every size from 1 to the world size, so one
4-rank run covers 1, 2, 3 and 4 ranks (powers of two and not). The unmarked tests cover one
rank (COMM_SELF) and the pure helpers without mpirun.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpcdl.collectives import ALGORITHMS, SUPPORTED_DTYPES, CollectiveArgumentError
from hpcdl.collectives.butterfly import Fold
from hpcdl.collectives.pointtopoint import chunk_bounds
from tests.support.mpi_harness import assert_all_ranks

pytestmark = pytest.mark.processes  # starts processes: not in the fast tier


OPS = {"SUM": MPI.SUM, "PROD": MPI.PROD, "MAX": MPI.MAX, "MIN": MPI.MIN}
DTYPES = ["int32", "int64", "float32", "float64"]
PRIME = 1009


# ---------------------------------------------------------------- helpers


def sample(rng: np.random.Generator, length: int, dtype: np.dtype, op: str) -> np.ndarray:
    """Test data that cannot overflow under ``op`` on a handful of ranks (so MPI and numpy must agree exactly)."""
    dtype = np.dtype(dtype)
    if op == "PROD":  # products of a few values in [0.5, 2] or {1, 2} (negatives where signed)
        values = rng.uniform(0.5, 2.0, length) if dtype.kind == "f" else rng.integers(1, 3, length)
        if dtype.kind != "u":
            values = values * rng.choice([-1, 1], length)
        return values.astype(dtype)
    if dtype.kind == "f":
        return rng.standard_normal(length).astype(dtype) * 100
    low = 0 if dtype.kind == "u" else -100
    return rng.integers(low, 100, length).astype(dtype)


def mismatch(ours: np.ndarray, reference: np.ndarray, comm: MPI.Comm, op: str, data: np.ndarray) -> str | None:
    """Why ``ours`` is not an acceptable allreduce result, or None.

    Integers, MAX and MIN must match MPI exactly. Float sums and products are compared with a
    bound for rounding in a different order: a few ulps of sum(|x|) per rank, or of |product|.
    """
    if ours.shape != reference.shape or ours.dtype != reference.dtype:
        return f"got {ours.shape} {ours.dtype}, expected {reference.shape} {reference.dtype}"
    if data.dtype.kind != "f" or op in ("MAX", "MIN"):
        wrong = np.flatnonzero(ours != reference)
        return None if wrong.size == 0 else f"{wrong.size} elements differ, first at {wrong[0]}: {ours[wrong[0]]} != {reference[wrong[0]]}"
    eps = np.finfo(data.dtype).eps
    ranks = comm.Get_size()
    if op == "SUM":
        magnitude = np.empty_like(data, dtype=np.float64)
        comm.Allreduce(np.abs(data.astype(np.float64)), magnitude, op=MPI.SUM)
    else:
        magnitude = np.abs(reference.astype(np.float64))
    tolerance = 2 * ranks * eps * magnitude
    error = np.abs(ours.astype(np.float64) - reference.astype(np.float64))
    worst = int(np.argmax(error - tolerance)) if error.size else 0
    return None if np.all(error <= tolerance) else f"error {error[worst]} > tolerance {tolerance[worst]} at {worst}"


def sub_communicators(comm: MPI.Comm):
    """For every k in 1..size: split into the first k ranks and the rest, and yield this rank's part."""
    for k in range(1, comm.Get_size() + 1):
        sub = comm.Split(color=0 if comm.Get_rank() < k else 1, key=comm.Get_rank())
        try:
            yield sub
        finally:
            sub.Free()


def identical_everywhere(result: np.ndarray, comm: MPI.Comm) -> bool:
    """Every rank of ``comm`` holds the same bits (our algorithms promise this; ranks must not drift apart)."""
    root_copy = result.copy()
    comm.Bcast([root_copy.view(np.uint8), MPI.BYTE], root=0)
    return bool(np.array_equal(root_copy.view(np.uint8), result.view(np.uint8)))


# ---------------------------------------------------------------- MPI tests (mpiexec -n 3 / -n 4)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_matches_mpi_allreduce(algorithm: str, op: str, dtype: str) -> None:
    world = MPI.COMM_WORLD
    problems = []
    for comm in sub_communicators(world):
        lengths = [0, 1, max(comm.Get_size() - 1, 1), PRIME]
        if comm.Get_size() == world.Get_size():
            lengths.append((3 << 20) // np.dtype(dtype).itemsize + 7)  # several MB, not a multiple of any size
        for length in lengths:
            rng = np.random.default_rng([world.Get_rank(), length, len(problems)])
            data = sample(rng, length, dtype, op)
            reference = np.empty_like(data)
            comm.Allreduce(data, reference, op=OPS[op])
            before = data.copy()
            ours = ALGORITHMS[algorithm](data, comm, OPS[op])
            why = mismatch(ours, reference, comm, op, data)
            if why is None and not identical_everywhere(ours, comm):
                why = "ranks hold different results"
            if why is None and (not np.array_equal(data, before) or np.shares_memory(ours, data)):
                why = "the input was modified or shares memory with the result"
            if why:
                problems.append(f"{comm.Get_size()} ranks, length {length}: {why}")
    assert_all_ranks(not problems, "; ".join(problems))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [str(d) for d in SUPPORTED_DTYPES])
def test_every_supported_dtype_sums_like_mpi(dtype: str) -> None:
    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(comm.Get_rank())
    kind = np.dtype(dtype).kind
    # Values small enough not to overflow: Open MPI 4.1's AVX ops saturate 8- and 16-bit sums
    # instead of wrapping (open-mpi/ompi#8045), so MPI is no reference for overflow there.
    top = 100 // comm.Get_size()
    data = (rng.standard_normal(PRIME) * 100 if kind == "f" else rng.integers(0, top, PRIME)).astype(dtype)
    reference = np.empty_like(data)
    comm.Allreduce(data, reference, op=MPI.SUM)
    problems = [f"{name}: {why}" for name, fn in ALGORITHMS.items() if (why := mismatch(fn(data, comm), reference, comm, "SUM", data))]
    assert_all_ranks(not problems, "; ".join(problems))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint16", "int32"])
def test_integer_overflow_wraps_around_like_c(dtype: str) -> None:
    """Reference: numpy's own wrapping sum of every rank's data, gathered (not MPI: see above)."""
    comm = MPI.COMM_WORLD
    top = np.iinfo(dtype).max
    data = np.random.default_rng(comm.Get_rank()).integers(top // 2, top, PRIME).astype(dtype)
    reference = np.sum(np.stack(comm.allgather(data)), axis=0, dtype=dtype)
    problems = [f"{name}: {why}" for name, fn in ALGORITHMS.items() if (why := mismatch(fn(data, comm), reference, comm, "SUM", data))]
    assert_all_ranks(not problems, "; ".join(problems))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_torch_tensor_in_torch_tensor_out(algorithm: str) -> None:
    comm = MPI.COMM_WORLD
    generator = torch.Generator().manual_seed(comm.Get_rank())
    tensor = torch.randn(7, 5, 3, generator=generator).transpose(0, 2)  # not contiguous
    before = tensor.clone()
    reference = np.empty(tensor.shape, dtype=np.float32)
    comm.Allreduce(np.ascontiguousarray(tensor.numpy()), reference, op=MPI.SUM)
    result = ALGORITHMS[algorithm](tensor, comm, MPI.SUM)
    problems = []
    if not isinstance(result, torch.Tensor) or result.shape != tensor.shape or result.dtype != tensor.dtype:
        problems.append(f"got {type(result).__name__} {getattr(result, 'shape', None)} {getattr(result, 'dtype', None)}")
    elif (why := mismatch(result.numpy(), reference, comm, "SUM", np.ascontiguousarray(tensor.numpy()))) is not None:
        problems.append(why)
    elif result.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr() or not torch.equal(tensor, before):
        problems.append("the input was reused or modified")
    assert_all_ranks(not problems, "; ".join(problems))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_average_is_the_sum_over_the_world_size(algorithm: str) -> None:
    world = MPI.COMM_WORLD
    problems = []
    for comm in sub_communicators(world):
        data = np.random.default_rng(world.Get_rank()).standard_normal(PRIME)
        total = np.empty_like(data)
        comm.Allreduce(data, total, op=MPI.SUM)
        ours = ALGORITHMS[algorithm](torch.from_numpy(data), comm, average=True).numpy()
        if not np.allclose(ours, total / comm.Get_size(), rtol=1e-12, atol=1e-12):
            problems.append(f"{comm.Get_size()} ranks: average differs from sum / size")
    assert_all_ranks(not problems, "; ".join(problems))


MISMATCHES = {
    # what one rank (the last) passes differently -> words the error must contain
    "length": (lambda data: data[:-1], "disagree"),
    "dtype": (lambda data: data.astype(np.float32), "disagree"),
    "not an array": (lambda data: data.tolist(), "expected a numpy array"),
    "unsupported dtype": (lambda data: data.astype(np.complex128), "unsupported dtype"),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", list(MISMATCHES))
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_mismatched_arguments_raise_on_every_rank(algorithm: str, case: str) -> None:
    comm = MPI.COMM_WORLD
    data = np.arange(PRIME, dtype=np.float64)
    change, words = MISMATCHES[case]
    if comm.Get_rank() == comm.Get_size() - 1:
        data = change(data)
    try:
        ALGORITHMS[algorithm](data, comm)
        outcome = "no error"
    except CollectiveArgumentError as error:
        message = str(error)
        outcome = "ok" if words in message and "\n" not in message and algorithm in message else f"unclear: {message}"
    # The communicator must still be usable afterwards: no half-sent messages left behind.
    after = ALGORITHMS[algorithm](np.ones(5), comm)
    if outcome == "ok" and not np.array_equal(after, np.full(5, float(comm.Get_size()))):
        outcome = "the next allreduce was wrong"
    assert_all_ranks(outcome == "ok", outcome)


@pytest.mark.mpi(min_size=2)
def test_different_ops_on_different_ranks_raise() -> None:
    comm = MPI.COMM_WORLD
    op = MPI.MAX if comm.Get_rank() == 0 else MPI.SUM
    with pytest.raises(CollectiveArgumentError, match="disagree"):
        ALGORITHMS["ring"](np.ones(3), comm, op)


@pytest.mark.mpi(min_size=2)
def test_messages_do_not_reach_the_callers_own_receives() -> None:
    """A pending receive for any source and tag on the caller's communicator must not catch our traffic."""
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    mailbox = np.full(4, -1.0)
    pending = comm.Irecv(mailbox, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
    results = [fn(np.full(4, 1.0), comm) for fn in ALGORITHMS.values()]
    comm.Send(np.full(4, 1000.0 + rank), dest=(rank + 1) % size, tag=7)
    pending.Wait()
    ok = np.array_equal(mailbox, np.full(4, 1000.0 + (rank - 1) % size)) and all(np.all(r == size) for r in results)
    assert_all_ranks(ok, f"mailbox {mailbox}")


# ---------------------------------------------------------------- one rank, and the helpers (no mpirun)


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_one_rank_returns_an_equal_new_buffer(algorithm: str, kind: str) -> None:
    original = np.arange(12, dtype=np.int64).reshape(3, 4)
    buf = original.copy() if kind == "numpy" else torch.from_numpy(original.copy())
    for op in OPS.values():
        result = ALGORITHMS[algorithm](buf, MPI.COMM_SELF, op)
        assert type(result) is type(buf)
        assert tuple(result.shape) == (3, 4) and result.dtype == buf.dtype
        assert np.array_equal(np.asarray(result), original)
        pointer = (lambda b: b.data_ptr()) if kind == "torch" else (lambda b: b.ctypes.data)
        assert pointer(result) != pointer(buf)


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_one_rank_average_and_empty_and_strided(algorithm: str) -> None:
    fn = ALGORITHMS[algorithm]
    data = np.linspace(-1, 1, 20).reshape(4, 5)
    assert np.array_equal(fn(data, MPI.COMM_SELF, average=True), data)
    assert fn(np.empty((0, 3), dtype=np.float32), MPI.COMM_SELF).shape == (0, 3)
    assert np.array_equal(fn(data.T, MPI.COMM_SELF), data.T)  # any strides in, the same values out


@pytest.mark.parametrize(
    ("buf", "kwargs", "words"),
    [
        ([1.0, 2.0], {}, "expected a numpy array or a CPU torch tensor, got list"),
        (np.ones(3, dtype=np.float16), {}, "unsupported dtype float16"),
        (np.ones(3, dtype=bool), {}, "unsupported dtype bool"),
        (torch.ones(3, dtype=torch.bfloat16), {}, "unsupported tensor dtype torch.bfloat16"),
        (np.ones(3), {"op": MPI.LAND}, "op must be one of"),
        (np.ones(3), {"op": MPI.MAX, "average": True}, "only makes sense with MPI.SUM"),
        (np.ones(3, dtype=np.int32), {"average": True}, "needs a floating-point buffer"),
        (np.ones(3), {"comm": "world"}, "intracommunicator"),
    ],
)
def test_bad_arguments_give_a_one_line_error(buf: object, kwargs: dict, words: str) -> None:
    kwargs = {"comm": MPI.COMM_SELF, **kwargs}
    for name, fn in ALGORITHMS.items():
        with pytest.raises(CollectiveArgumentError) as caught:
            fn(buf, **kwargs)
        assert words in str(caught.value) and name in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("length", [0, 1, 2, 3, 7, 10, 1009])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 5, 8])
def test_chunk_bounds_match_numpy_array_split(length: int, parts: int) -> None:
    bounds = chunk_bounds(length, parts)
    expected = np.cumsum([0] + [len(c) for c in np.array_split(np.arange(length), parts)])
    assert bounds.tolist() == expected.tolist()


@pytest.mark.parametrize("size", range(1, 34))
def test_fold_maps_the_remaining_ranks_onto_a_power_of_two(size: int) -> None:
    folds = [Fold(size, rank) for rank in range(size)]
    members = folds[0].members
    assert members & (members - 1) == 0 and members <= size < 2 * members
    staying = [f for f in folds if not f.sits_out]
    assert sorted(f.member_rank for f in staying) == list(range(members))
    assert all(f.real_rank(f.member_rank) == f.rank for f in staying)
    assert all(Fold(size, f.rank + 1).sits_out is False for f in folds if f.sits_out)  # handed to an odd neighbour
