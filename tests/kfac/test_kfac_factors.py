"""Triangle packing, per-step statistics and running averages."""

from __future__ import annotations

import torch

from kfac.factors import BatchStatistics, pack_upper, running_average, unpack_upper, upper_size


def _sym(n: int) -> torch.Tensor:
    m = torch.randn(n, n, dtype=torch.float64)
    return m + m.T


def test_upper_triangle_round_trip_halves_the_numbers() -> None:
    for n in (1, 2, 7):
        m = _sym(n)
        packed = pack_upper(m)
        assert packed.numel() == upper_size(n) == n * (n + 1) // 2
        torch.testing.assert_close(unpack_upper(packed, n), m)
    assert pack_upper(torch.tensor([[1.0, 2.0], [2.0, 3.0]])).tolist() == [1.0, 2.0, 3.0]


def test_statistics_travel_in_one_buffer_and_add_up_like_the_sums() -> None:
    parts = [BatchStatistics(_sym(4), 3.0, _sym(2), 6.0), BatchStatistics(_sym(4), 5.0, _sym(2), 10.0)]
    summed = BatchStatistics.unpack(parts[0].pack() + parts[1].pack(), 4, 2)
    merged = BatchStatistics.merge(parts)
    for stats in (summed, merged):
        torch.testing.assert_close(stats.a_sum, parts[0].a_sum + parts[1].a_sum)
        torch.testing.assert_close(stats.g_sum, parts[0].g_sum + parts[1].g_sum)
        assert (stats.a_count, stats.g_count) == (8.0, 16.0)
    empty = BatchStatistics.empty_buffer(4, 2, torch.float32, torch.device("cpu"))
    assert empty.numel() == parts[0].pack().numel() and not empty.any()


def test_running_average_starts_with_the_first_batch() -> None:
    first, second = torch.ones(2, 2), torch.full((2, 2), 3.0)
    average = running_average(None, first, 0.9)
    assert average is not first and torch.equal(average, first)
    torch.testing.assert_close(running_average(average, second, 0.9), torch.full((2, 2), 0.9 + 0.1 * 3.0))
