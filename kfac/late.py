"""LateDecompositions: one inverse update's decompositions computed in the background, installed at the next.

With ``late_decompositions`` a training step does not wait for the decompositions it starts: a worker thread
computes them (on a GPU in a side stream, so that the training step's kernels overlap them) while training goes on
with the previous ones, and the next inverse update takes them. One batch is in flight at most.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from kfac.decompose import Recoveries, Results

Compute = Callable[[], tuple[Results, Recoveries]]


class LateDecompositions:
    """The background runner and the one batch in flight: (its layers, its future, the device it runs on)."""

    def __init__(self) -> None:
        self._runner: ThreadPoolExecutor | None = None
        self._side_stream: Any = None
        self._pending: tuple[list[int], Future, torch.device] | None = None

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def start(self, layers: list[int], compute: Compute, device: torch.device, inputs: Sequence[Tensor]) -> None:
        """Run ``compute`` (this rank's decompositions of ``layers``) in the background. On a GPU it runs in the
        side stream once the current stream's work so far is done; ``inputs``, the factors it reads, are marked
        as used there so that their memory is not reused before it finishes."""
        assert self._pending is None, "take() or discard() the decompositions in flight first"
        if self._runner is None:
            self._runner = ThreadPoolExecutor(1, thread_name_prefix="kfac-late")
        ready = None
        if device.type == "cuda":
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(device)
            ready = torch.cuda.current_stream(device).record_event()
            for tensor in inputs:
                tensor.record_stream(self._side_stream)

        def run() -> tuple[Results, Recoveries, Any]:
            if ready is None:
                return (*compute(), None)
            with torch.cuda.stream(self._side_stream):
                self._side_stream.wait_event(ready)
                results, recoveries = compute()
                return results, recoveries, self._side_stream.record_event()

        self._pending = (layers, self._runner.submit(run), device)

    def take(self) -> tuple[list[int], Results, Recoveries] | None:
        """The batch in flight, once computed, usable by the current stream; None when none is in flight."""
        if self._pending is None:
            return None
        layers, future, device = self._pending
        self._pending = None
        results, recoveries, done = future.result()
        if done is not None:  # the side stream's results, used from now on by the current stream
            current = torch.cuda.current_stream(device)
            current.wait_event(done)
            for decomposition in results.values():
                for tensor in decomposition:
                    tensor.record_stream(current)
        return layers, results, recoveries

    def discard(self) -> None:
        """Wait for the batch in flight (its thread must not outlive its use) and drop it."""
        if self._pending is not None:
            self._pending[1].result()
            self._pending = None
