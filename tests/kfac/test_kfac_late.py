"""kfac.late: decompositions computed in the background, taken whole at the next inverse update."""

from __future__ import annotations

import threading

import pytest
import torch

from kfac.late import LateDecompositions


def test_start_returns_before_the_work_is_done_and_take_waits_for_it() -> None:
    release, ran_on = threading.Event(), []
    factor = torch.randn(4, 4, dtype=torch.float64)

    def compute():
        assert release.wait(30), "start() waited for the work it should have left running"
        ran_on.append(threading.current_thread().name)
        return {(0, "A"): (factor @ factor.T,)}, {(0, "A"): "diagonal"}

    late = LateDecompositions()
    late.start([0], compute, torch.device("cpu"), [factor])
    assert late.in_flight and ran_on == []  # the work waits on ``release``: start returned without it
    release.set()
    layers, results, recoveries = late.take()
    assert layers == [0] and recoveries == {(0, "A"): "diagonal"}
    assert torch.equal(results[(0, "A")][0], factor @ factor.T)
    assert ran_on[0].startswith("kfac-late") and ran_on[0] != threading.current_thread().name
    assert not late.in_flight and late.take() is None


def test_discard_waits_for_the_work_and_drops_it() -> None:
    finished = []

    def compute():
        threading.Event().wait(0.2)
        finished.append(True)
        return {}, {}

    late = LateDecompositions()
    late.discard()  # nothing in flight: nothing to do
    late.start([1, 2], compute, torch.device("cpu"), [])
    late.discard()
    assert finished == [True] and late.take() is None
    late.start([3], lambda: ({}, {}), torch.device("cpu"), [])  # free for the next batch
    assert late.take() == ([3], {}, {})


def test_a_second_batch_waits_for_the_first_to_be_taken() -> None:
    late = LateDecompositions()
    late.start([0], lambda: ({}, {}), torch.device("cpu"), [])
    with pytest.raises(AssertionError, match="in flight"):
        late.start([1], lambda: ({}, {}), torch.device("cpu"), [])
    late.discard()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the side stream")
def test_on_a_gpu_the_side_stream_s_results_equal_the_current_stream_s() -> None:
    """The side stream waits for the factor written just before start(), and take() hands its results to the
    current stream: the same eigendecomposition as computed in the current stream."""
    device = torch.device("cuda")
    x = torch.randn(256, 64, device=device, dtype=torch.float64)
    factor = x.T @ x  # queued on the current stream just before start()
    late = LateDecompositions()
    late.start([0], lambda: ({(0, "A"): tuple(torch.linalg.eigh(factor))}, {}), device, [factor])
    _, results, _ = late.take()
    want = torch.linalg.eigh(x.T @ x)
    pairs = zip(results[(0, "A")], want, strict=True)
    assert all(torch.allclose(got, expected, rtol=1e-12, atol=1e-12) for got, expected in pairs)
