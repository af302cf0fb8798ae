"""The alpha-beta fit against data made from a known alpha and B (no processes: fast tier).

An independent reference for the fitting code: timings generated from the ring formula with
chosen parameters, which the fit must give back, and a held-out size it must predict.
"""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl.bench import alphabeta, timing

SIZES = timing.message_sizes(1 << 20, 32 << 20)  # the network sweep's sizes: 1 to 32 MiB


def synthetic(truth: alphabeta.AlphaBeta, ranks: int, spread: float, seed: int = 0) -> list[float]:
    noise = np.random.default_rng(seed).uniform(1 - spread, 1 + spread, len(SIZES))
    return [truth.ring_seconds(n, ranks) * k for n, k in zip(SIZES, noise, strict=True)]


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_a_known_alpha_and_bandwidth_are_recovered(ranks: int) -> None:
    truth = alphabeta.AlphaBeta(alpha=300e-6, bandwidth=125e6)  # a 1 Gbit/s link with 0.3 ms per step
    fitted = alphabeta.fit_ring(SIZES, synthetic(truth, ranks, spread=0.0), ranks)
    assert fitted.alpha == pytest.approx(truth.alpha, rel=1e-6)
    assert fitted.bandwidth == pytest.approx(truth.bandwidth, rel=1e-9)


@pytest.mark.parametrize("ranks", [2, 4])
def test_the_held_out_size_is_predicted_within_the_noise(ranks: int) -> None:
    truth = alphabeta.AlphaBeta(alpha=300e-6, bandwidth=1.25e9)
    times = synthetic(truth, ranks, spread=0.02, seed=ranks)
    model, held = alphabeta.fit_and_hold_out(SIZES, times, ranks, held_out=32 << 20)
    assert held.measured == times[-1]
    assert held.predicted == pytest.approx(model.ring_seconds(32 << 20, ranks))
    assert abs(held.error) < 0.06  # 2 % noise on each point; extrapolated one size up
    assert model.bandwidth == pytest.approx(truth.bandwidth, rel=0.06)


def test_a_held_out_size_off_the_model_shows_a_large_error() -> None:
    """Timings that stop following the line (a stall from 32 MiB up) must not be predicted well."""
    truth = alphabeta.AlphaBeta(alpha=0.0, bandwidth=125e6)
    times = synthetic(truth, 2, spread=0.0)
    times[-1] *= 2
    _, held = alphabeta.fit_and_hold_out(SIZES, times, 2, held_out=32 << 20)
    assert held.error == pytest.approx(-0.5, rel=1e-6)


def test_the_held_out_size_must_be_measured_and_leave_two_to_fit() -> None:
    with pytest.raises(ValueError, match="exactly once"):
        alphabeta.fit_and_hold_out([1, 2, 3], [1.0, 2.0, 3.0], 2, held_out=5)
    with pytest.raises(ValueError, match="two other sizes"):
        alphabeta.fit_and_hold_out([1, 2], [1.0, 2.0], 2, held_out=2)
