"""The alpha-beta cost model of allreduce, fitted to measurements and used to extrapolate.

A message of n bytes between two ranks costs alpha + n / B: a fixed latency alpha and a
bandwidth B. The ring allreduce makes 2(N-1) such steps of n/N bytes each, so

    T_ring(n, N)  = 2(N-1) * alpha + 2(N-1)/N * n / B
    T_naive(n, N) = 2(N-1) * (alpha + n / B)      (rank 0 receives, then sends, N-1 full buffers)

The ring's bandwidth term hardly grows with N; its latency term does. Fitting alpha and B to
a ring measured on a few ranks, then swapping in a real network's numbers, tells a user what a
gradient allreduce will cost at 64 or 4,096 ranks before they queue the job.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

RESNET50_PARAMETERS = 25_557_032  # torchvision's resnet50: the "25.6 M float32 values" of a gradient
RESNET50_GRADIENT_BYTES = RESNET50_PARAMETERS * 4


@dataclass(frozen=True)
class AlphaBeta:
    alpha: float  # seconds per message step
    bandwidth: float  # bytes per second

    def ring_seconds(self, nbytes: float, ranks: int) -> float:
        if ranks < 2:
            return 0.0
        return 2 * (ranks - 1) * self.alpha + 2 * (ranks - 1) / ranks * nbytes / self.bandwidth

    def naive_seconds(self, nbytes: float, ranks: int) -> float:
        return 2 * (ranks - 1) * (self.alpha + nbytes / self.bandwidth)


def network(gigabits_per_second: float, latency_microseconds: float) -> AlphaBeta:
    """An interconnect described the way vendors do: link rate in Gb/s and latency in microseconds."""
    return AlphaBeta(latency_microseconds * 1e-6, gigabits_per_second * 1e9 / 8)


def fit_ring(nbytes: Sequence[float], seconds: Sequence[float], ranks: int) -> AlphaBeta:
    """Least-squares alpha and B of the ring model from ring timings on ``ranks`` ranks.

    At fixed N the model is a straight line T = a + b n with a = 2(N-1) alpha and
    b = 2(N-1) / (N B). The fit minimises relative error (each row divided by its time), so the
    microsecond latencies of small messages count as much as the large messages' bandwidth.
    """
    if ranks < 2:
        raise ValueError("the ring model needs at least 2 ranks")
    n = np.asarray(nbytes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if n.shape != t.shape or n.size < 2 or np.any(t <= 0):
        raise ValueError("need at least two (bytes, positive seconds) pairs")
    design = np.stack([np.ones_like(n), n], axis=1) / t[:, None]
    (intercept, slope), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    steps = 2 * (ranks - 1)
    alpha = max(intercept, 0.0) / steps
    bandwidth = steps / ranks / slope if slope > 0 else float("inf")
    return AlphaBeta(alpha, bandwidth)


@dataclass(frozen=True)
class HeldOut:
    """A size left out of the fit, and what the model fitted to the others predicts for it."""

    nbytes: float
    measured: float  # seconds
    predicted: float  # seconds

    @property
    def error(self) -> float:
        """Relative error of the prediction: +0.10 means 10 % slower predicted than measured."""
        return (self.predicted - self.measured) / self.measured


def fit_and_hold_out(
    nbytes: Sequence[float], seconds: Sequence[float], ranks: int, held_out: float
) -> tuple[AlphaBeta, HeldOut]:
    """Fit the ring model to every size but ``held_out``, then predict ``held_out``.

    A model is only worth extrapolating with if it predicts a size it never saw; the fit itself
    says nothing about that (two parameters fit any two points).
    """
    pairs = list(zip(nbytes, seconds, strict=True))
    kept = [(n, t) for n, t in pairs if n != held_out]
    left_out = [t for n, t in pairs if n == held_out]
    if len(left_out) != 1:
        raise ValueError(f"the held-out size {held_out:g} B must be measured exactly once")
    if len(kept) < 2:
        raise ValueError("need at least two other sizes to fit")
    model = fit_ring([n for n, _ in kept], [t for _, t in kept], ranks)
    return model, HeldOut(held_out, left_out[0], model.ring_seconds(held_out, ranks))
