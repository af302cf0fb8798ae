"""Triangle packing, per-step statistics, running averages and the factor update."""

from __future__ import annotations

import pytest
import torch

from kfac.factors import (
    BatchStatistics,
    RunningFactors,
    batch_averages,
    pack_upper,
    running_average,
    unpack_upper,
    upper_size,
    usable,
)


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


def _stats(seed: int, count: float | torch.Tensor = 4.0, poison: float | None = None) -> BatchStatistics:
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(3, 3, generator=g), torch.randn(2, 2, generator=g)
    a, b = a @ a.T, b @ b.T
    if poison is not None:
        b[1, 0] = poison
    return BatchStatistics(a, count, b, count)


def test_running_factors_average_usable_batches_and_leave_out_the_others() -> None:
    decay, factors = 0.75, RunningFactors(2)
    s0, s1 = _stats(0), _stats(1, poison=float("nan"))
    factors.update({0: s0, 1: s1}, decay, 1.0, None)
    torch.testing.assert_close(factors.a[0], s0.a_sum / 4)
    torch.testing.assert_close(factors.g[0], s0.g_sum / 4)
    assert factors.a[1] is None and factors.g[1] is None  # a non-finite first batch starts nothing
    assert int(factors.skipped) == 1

    a0, g0 = factors.a[0], factors.g[0]
    before = a0.clone()
    s0, s1 = _stats(2, count=2.0), _stats(3)
    factors.update({0: s0, 1: s1}, decay, 2.0, None)  # a loss scale of 2: G is divided by 2² as well
    torch.testing.assert_close(factors.a[0], decay * before + (1 - decay) * s0.a_sum / 2)
    torch.testing.assert_close(factors.g[0], decay * g0 + (1 - decay) * s0.g_sum / (2 * 4))
    assert torch.equal(a0, before)  # replaced, not mutated: a decomposition may still read the old factor
    torch.testing.assert_close(factors.g[1], s1.g_sum / (4 * 4))
    assert int(factors.skipped) == 1

    kept = [f.clone() for f in factors.a + factors.g]
    factors.update({0: _stats(4), 1: _stats(5)}, decay, 1.0, torch.tensor(1.0))  # the optimizer skips this step
    assert all(torch.equal(x, y) for x, y in zip(kept, factors.a + factors.g, strict=True))
    assert int(factors.skipped) == 3

    s1 = _stats(6)
    factors.update({0: _stats(7, count=torch.tensor(0.0)), 1: s1}, decay, 1.0, torch.tensor(0.0))  # 0/0 on layer 0
    assert torch.equal(factors.a[0], kept[0]) and torch.equal(factors.g[0], kept[2])
    torch.testing.assert_close(factors.a[1], decay * kept[1] + (1 - decay) * s1.a_sum / 4)
    assert int(factors.skipped) == 4

    factors.update({0: _stats(8, count=0.0)}, decay, 1.0, None)  # counts on the host: nothing ran, nothing counted
    assert torch.equal(factors.a[0], kept[0]) and int(factors.skipped) == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_usable_is_false_exactly_when_an_entry_is_not_finite(dtype: torch.dtype) -> None:
    """Every position of several sizes (vectorised bodies and their tails), against torch.isfinite."""
    huge = torch.finfo(dtype).max
    for n in (1, 3, 8, 13):
        for value in (float("nan"), float("inf"), -float("inf"), huge, -huge):
            for position in range(n * n):
                a = torch.ones(n, n, dtype=dtype)
                a.view(-1)[position] = value
                g = torch.full((2, 2), -huge, dtype=dtype)
                batches = [(0, a, g), (1, g, a.T.contiguous())]
                expected = bool(torch.isfinite(a).all())
                assert [bool(v) for v in usable(batches, None)] == [expected, expected], (n, value, position)
                assert [bool(v) for v in usable(batches, torch.tensor(1.0))] == [False, False]


@pytest.mark.parametrize("counts", ["numbers", "tensors", "mixed"])
@pytest.mark.parametrize("scale", [1.0, 8.0, "tensor"])
def test_the_batch_averages_of_all_layers_at_once_are_each_layer_s(counts: str, scale) -> None:
    """Two multi-tensor divisions give what each layer's own averages() gives, bit for bit: counts as numbers
    (this rank's shapes), as 0-dim tensors (after an allreduce) or both, the loss scale a number or a tensor; a
    layer whose counts known on the host are 0 is left out."""
    torch.manual_seed(3)
    loss_scale = torch.tensor(16.0) if scale == "tensor" else scale

    def count(value: float, k: int) -> float | torch.Tensor:
        tensor = counts == "tensors" or (counts == "mixed" and k % 2 == 1)
        return torch.tensor(value, dtype=torch.float64) if tensor else value

    summed = {k: BatchStatistics(_sym(3 + k), count(5.0 + k, k), _sym(2 + k), count(7.0 * (k + 1), k)) for k in range(4)}
    summed[5] = BatchStatistics(_sym(2), 0.0, _sym(2), 0.0)  # nothing ran
    got = batch_averages(summed, loss_scale)
    assert [index for index, _, _ in got] == [0, 1, 2, 3]
    for index, a, g in got:
        want = summed[index].averages(loss_scale)
        assert want is not None and torch.equal(a, want[0]) and torch.equal(g, want[1])
