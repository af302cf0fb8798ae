"""Conv patch moments against F.unfold, and patch geometry against the convolution itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kfac.patches as patches
from kfac.patches import (
    MOMENT_METHODS,
    ConvGeometry,
    _row_gram_moment,
    applicable_methods,
    bordered_moment,
    choose_method,
    conv_patches,
    fixed_method,
    patch_moment,
)

CASES = [
    dict(kernel_size=3, stride=1, padding=1, dilation=1),
    dict(kernel_size=3, stride=2, padding=1, dilation=2),  # the acceptance case
    dict(kernel_size=3, stride=1, padding=2, dilation=2),
    dict(kernel_size=(3, 2), stride=(1, 2), padding=(2, 1), dilation=(2, 1)),
    dict(kernel_size=5, stride=1, padding=0, dilation=1),
    dict(kernel_size=3, stride=(1, 3), padding=(1, 0), dilation=(3, 1)),
    dict(kernel_size=3, stride=1, padding=4, dilation=4),  # windows share no rows
    dict(kernel_size=1, stride=2, padding=0, dilation=1),
    dict(kernel_size=(2, 3), stride=(3, 1), padding=(1, 1), dilation=1),
]


def _unfold_reference(x: torch.Tensor, conv: nn.Conv2d, with_bias: bool) -> torch.Tensor:
    """Σ a aᵀ over every patch, from F.unfold on the explicitly padded input."""
    geometry = ConvGeometry.of(conv)
    padded = F.pad(x, geometry.padding, mode=geometry.padding_mode)
    patches = F.unfold(padded, conv.kernel_size, dilation=conv.dilation, stride=conv.stride)
    rows = patches.transpose(1, 2).reshape(-1, patches.shape[1])
    if with_bias:
        rows = torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=rows.dtype)], dim=1)
    return rows.T @ rows


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k[0]}{v}" for k, v in c.items()))
@pytest.mark.parametrize("with_bias", [True, False])
def test_patch_moment_matches_unfold(case: dict, with_bias: bool) -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, **case).double()
    x = torch.randn(2, 3, 9, 11, dtype=torch.float64)
    got = patch_moment(x, ConvGeometry.of(conv), with_bias)
    want = _unfold_reference(x, conv, with_bias)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "case",
    CASES + [dict(kernel_size=3, padding=1), dict(kernel_size=5, padding=2, dilation=2)],
    ids=lambda c: "-".join(f"{k[0]}{v}" for k, v in c.items()),
)
@pytest.mark.parametrize("mode", ["zeros", "reflect"])
def test_each_method_matches_unfold_where_it_applies(case: dict, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """patch_moment picks a method by device, shape and stride; each one is checked on its own here, the unfolded
    patches' Gram also built one example at a time (its memory bound) and from a channels-last input."""
    torch.manual_seed(2)
    conv = nn.Conv2d(3, 4, padding_mode=mode, **case).double()
    geometry = ConvGeometry.of(conv)
    if mode == "reflect" and any(p >= s for p, s in zip(geometry.padding, (11, 11, 9, 9), strict=False)):
        pytest.skip("reflect padding must be smaller than the image")
    x = torch.randn(3, 3, 9, 11, dtype=torch.float64)
    want = _unfold_reference(x, conv, True)
    names = applicable_methods(x, geometry)
    assert ("autocorrelation" in names) == (geometry.stride == (1, 1) and geometry.kernel != (1, 1))
    for name in names:
        for layout in (x, x.to(memory_format=torch.channels_last)):
            got = bordered_moment(*MOMENT_METHODS[name](layout, geometry, True))
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=name)
    monkeypatch.setattr(patches, "_UNFOLD_BYTES", 1)  # one example at a time
    torch.testing.assert_close(bordered_moment(*MOMENT_METHODS["unfold"](x, geometry, True)), want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", [dict(kernel_size=1), dict(kernel_size=1, stride=2), dict(kernel_size=3, padding=1),
                                  dict(kernel_size=3, stride=2, padding=1)], ids=lambda c: str(c))
def test_without_a_bias_no_method_sums_the_patches(case: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer without a bias (ResNet-50's convolutions) needs no patch sums: every method returns none (a sum is a
    pass over the input of its own on a GPU) and the moment of the bare patches. The sums are counted by
    kfac.patches.wide_sum, which every method sums through."""
    conv = nn.Conv2d(3, 4, bias=False, **case).double()
    geometry = ConvGeometry.of(conv)
    x = torch.randn(2, 3, 9, 8, dtype=torch.float64)
    want = _unfold_reference(x, conv, False)
    summed = []
    real_sum = patches.wide_sum
    monkeypatch.setattr(patches, "wide_sum", lambda t, dim: summed.append(t.shape) or real_sum(t, dim))
    for name in applicable_methods(x, geometry):
        moment, sums, _ = MOMENT_METHODS[name](x, geometry, False)
        assert sums is None, name
        torch.testing.assert_close(moment, want, rtol=1e-10, atol=1e-10, msg=name)
    assert summed == []
    MOMENT_METHODS["unfold"](x, geometry, True)
    assert summed, "the stand-in sees the sums a bias needs"


def test_patch_moment_matches_unfold_with_padding_numbers_as_used_by_pytorch() -> None:
    """With plain integer padding the reference is F.unfold's own padding."""
    conv = nn.Conv2d(2, 2, 3, stride=1, padding=1, dilation=2).double()
    x = torch.randn(3, 2, 7, 6, dtype=torch.float64)
    patches = F.unfold(x, 3, dilation=2, padding=1, stride=1).transpose(1, 2).reshape(-1, 18)
    torch.testing.assert_close(patch_moment(x, ConvGeometry.of(conv), False), patches.T @ patches)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize(
    "case",
    [
        dict(kernel_size=4, padding="same"),
        dict(kernel_size=(3, 2), padding="same", dilation=(2, 3)),
        dict(kernel_size=3, padding="valid"),
        dict(kernel_size=3, padding=2, padding_mode="reflect"),
        dict(kernel_size=3, padding=1, padding_mode="circular", stride=(1, 2)),
        dict(kernel_size=3, padding=1, padding_mode="replicate"),
        dict(kernel_size=3, stride=2, padding=1, dilation=2),
    ],
)
def test_patches_reproduce_the_convolution(case: dict) -> None:
    """weight.view(out, -1) @ patch + bias is the conv output: the geometry is the conv's own."""
    torch.manual_seed(1)
    conv = nn.Conv2d(3, 5, **case).double()
    x = torch.randn(2, 3, 10, 9, dtype=torch.float64)
    geometry = ConvGeometry.of(conv)
    patches = conv_patches(x, geometry)  # (N, L, C*kh*kw)
    out = conv(x)
    rebuilt = patches @ conv.weight.reshape(5, -1).T + conv.bias
    torch.testing.assert_close(rebuilt.transpose(1, 2).reshape(out.shape), out)
    # and the fast moment agrees with these patches, padding modes included
    rows = torch.cat(
        [
            patches.reshape(-1, patches.shape[2]),
            torch.ones(patches.shape[0] * patches.shape[1], 1, dtype=torch.float64),
        ],
        1,
    )
    torch.testing.assert_close(patch_moment(x, geometry, True), rows.T @ rows)


def test_same_padding_puts_the_odd_pixel_at_the_end() -> None:
    geometry = ConvGeometry.of(nn.Conv2d(1, 1, (4, 3), padding="same", dilation=(1, 2)))
    assert geometry.padding == (2, 2, 1, 2)  # left, right, top, bottom


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k[0]}{v}" for k, v in c.items()))
@pytest.mark.parametrize("mode", ["zeros", "reflect"])
def test_reduce_factors_match_unfold_means_and_summed_gradients(case: dict, mode: str) -> None:
    """K-FAC-reduce's statistics against F.unfold: A is |T| times the Gram of each example's mean patch
    (bordered by the patches' sum and count, as expand's), G the Gram of each example's position-summed
    output gradient; the counts are expand's."""
    from kfac.layers import Conv2dLayer

    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, padding_mode=mode, **case).double()
    x = torch.randn(5, 3, 13, 11, dtype=torch.float64)
    geometry = ConvGeometry.of(conv)
    columns = F.unfold(F.pad(x, geometry.padding, mode=geometry.padding_mode), conv.kernel_size,
                       dilation=conv.dilation, stride=conv.stride)  # (N, D, T)
    positions = columns.shape[2]
    means = torch.cat([columns.mean(2), torch.ones(5, 1, dtype=x.dtype)], dim=1)
    reduce, expand = Conv2dLayer("c", conv, "reduce"), Conv2dLayer("c", conv)
    a, a_count = reduce.a_moment(x)
    torch.testing.assert_close(a, positions * means.T @ means, rtol=1e-12, atol=1e-10)
    assert a_count == expand.a_moment(x)[1] == 5
    grad = torch.randn_like(conv(x))
    g, g_count = reduce.g_moment(grad)
    summed = grad.sum((2, 3))
    torch.testing.assert_close(g, summed.T @ summed, rtol=1e-12, atol=1e-10)
    assert g_count == expand.g_moment(grad)[1] == 5 * positions
    assert not torch.allclose(a, expand.a_moment(x)[0])  # a different approximation, not expand again


def test_an_unknown_conv_approximation_is_refused() -> None:
    from kfac.layers import Conv2dLayer

    with pytest.raises(ValueError, match="expand"):
        Conv2dLayer("c", nn.Conv2d(1, 1, 3), "average")


def _dense_moment(x: torch.Tensor, conv: nn.Conv2d, with_bias: bool) -> torch.Tensor:
    """Σ a aᵀ in float64, one explicit outer product per patch (patches cut out of the padded input by slicing)."""
    geometry = ConvGeometry.of(conv)
    padded = F.pad(x.double(), geometry.padding, mode=geometry.padding_mode)
    (kh, kw), (sh, sw), (dh, dw) = conv.kernel_size, conv.stride, conv.dilation
    ho, wo = geometry.output_size(*padded.shape[-2:])
    d = x.shape[1] * kh * kw + int(with_bias)
    total = torch.zeros(d, d, dtype=torch.float64)
    for t in range(ho):
        for u in range(wo):
            window = padded[:, :, sh * t : sh * t + dh * (kh - 1) + 1 : dh, sw * u : sw * u + dw * (kw - 1) + 1 : dw]
            a = window.reshape(x.shape[0], -1)
            if with_bias:
                a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], 1)
            total += torch.einsum("ni,nj->ij", a, a)
    return total


LAYER_CASES = [
    dict(kernel_size=3, padding=1),
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=1),
    dict(kernel_size=1, stride=2),
    dict(kernel_size=5),
    dict(kernel_size=3, padding=2, dilation=2),
    dict(kernel_size=(3, 5), stride=(2, 1), padding=(0, 2)),
    dict(kernel_size=3, padding=1, padding_mode="reflect"),
]


@pytest.mark.parametrize("case", LAYER_CASES, ids=lambda c: "-".join(f"{k[0]}{v}" for k, v in c.items()))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("channels_last", [False, True])
def test_layer_a_statistics_match_explicit_outer_products(case: dict, bias: bool, channels_last: bool) -> None:
    """Conv2dLayer's A statistics in float32 (whichever method it picks) against float64 outer products."""
    from kfac.layers import Conv2dLayer

    torch.manual_seed(3)
    conv = nn.Conv2d(4, 6, bias=bias, **case)
    x = torch.randn(3, 4, 10, 9)
    if channels_last:
        conv, x = conv.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    moment, count = Conv2dLayer("c", conv).a_moment(x)
    want = _dense_moment(x, conv, bias)
    assert count == 3 and moment.dtype == torch.float32
    torch.testing.assert_close(moment.double(), want, rtol=1e-5, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("chunk", [1, 1 << 22])
def test_row_products_in_chunks_of_rows_add_up_to_the_same_moment(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A small product budget splits the rows into several batched products (bounded memory); the sum is the same."""
    import kfac.patches as patches

    monkeypatch.setattr(patches, "_PRODUCT_ELEMENTS", chunk)
    torch.manual_seed(4)
    conv = nn.Conv2d(3, 2, 3, padding=1, dilation=(2, 1)).double()
    x = torch.randn(2, 3, 14, 7, dtype=torch.float64)
    got = bordered_moment(*_row_gram_moment(x, ConvGeometry.of(conv), True))
    torch.testing.assert_close(got, _dense_moment(x, conv, True), rtol=1e-10, atol=1e-10)


def test_on_a_cpu_a_large_input_takes_the_autocorrelation_and_a_small_one_the_row_products() -> None:
    """The fixed rule (measured on one core), and that both give the dense moment (float64, a ResNet-shaped layer)."""
    torch.manual_seed(5)
    conv = nn.Conv2d(16, 16, 3, padding=1).double()
    geometry = ConvGeometry.of(conv)
    large = torch.randn(patches._AUTOCORRELATION_MIN_INPUT // (16 * 16 * 16), 16, 16, 16, dtype=torch.float64)
    assert [choose_method(x, geometry, True) for x in (large, large[:2])] == ["autocorrelation", "rows"]
    for x in (large, large[:2]):
        torch.testing.assert_close(patch_moment(x, geometry, True), _unfold_reference(x, conv, True),
                                   rtol=1e-10, atol=1e-8)
    one_by_one = ConvGeometry.of(nn.Conv2d(16, 16, 1))
    assert applicable_methods(large, one_by_one) == ["unfold"] == [choose_method(large, one_by_one, True)]


def test_elsewhere_the_fastest_method_measured_on_the_first_input_of_a_shape_is_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Off the CPU each shape's first input times every method that applies, once; deterministic algorithms take the
    fixed rule instead (the timing could pick differently from run to run). Tensors on 'meta' stand in for a GPU's."""
    timed: list[tuple[str, tuple[int, ...]]] = []
    cost = {"autocorrelation": 3.0, "rows": 2.0, "unfold": 1.0}

    def seconds(name: str, x: torch.Tensor, geometry: ConvGeometry, with_bias: bool, repeats: int = 2) -> float:
        timed.append((name, tuple(x.shape)))
        return cost[name]

    monkeypatch.setattr(patches, "method_seconds", seconds)
    monkeypatch.setattr(patches, "_chosen", {})
    geometry = ConvGeometry.of(nn.Conv2d(8, 8, 3, padding=1))
    x = torch.empty(4, 8, 32, 32, device="meta")
    assert choose_method(x, geometry, True) == "unfold"
    assert sorted(timed) == [("autocorrelation", (4, 8, 32, 32)), ("rows", (4, 8, 32, 32)), ("unfold", (4, 8, 32, 32))]
    cost["rows"] = 0.5  # a remembered shape is not timed again
    assert choose_method(x, geometry, True) == "unfold" and len(timed) == 3
    assert choose_method(x[:2], geometry, True) == "rows" and len(timed) == 6
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert choose_method(x[:3], geometry, True) == fixed_method(x[:3], geometry) == "rows" and len(timed) == 6


def test_method_seconds_times_a_method_on_the_cpu() -> None:
    geometry = ConvGeometry.of(nn.Conv2d(4, 4, 3, padding=1))
    assert 0 < patches.method_seconds("rows", torch.randn(2, 4, 8, 8), geometry, True, repeats=1) < 10


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_method_timed_for_each_shape_gives_the_exact_moment(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA each shape's first input is timed once per method and the fastest kept; the moment it gives
    equals the float64 reference (IEEE products), and stays within 1e-3 of it with TF32 products."""
    from kfac.precision import fp32_products

    monkeypatch.setattr(patches, "_chosen", {})
    torch.manual_seed(7)
    for conv, shape in ((nn.Conv2d(16, 8, 3, padding=1), (4, 16, 20, 20)), (nn.Conv2d(8, 8, 3, stride=2, padding=1),
                        (4, 8, 17, 17)), (nn.Conv2d(8, 4, 1), (4, 8, 9, 9))):
        x = torch.randn(shape, dtype=torch.float64)
        want = _unfold_reference(x, conv.double(), True)
        geometry = ConvGeometry.of(conv)
        for precision, tolerance in (("ieee", 1e-5), ("tf32", 1e-3)):
            on_gpu = x.float().cuda().to(memory_format=torch.channels_last)
            with fp32_products(precision):
                got = patch_moment(on_gpu, geometry, True)
                assert choose_method(on_gpu, geometry, True) in applicable_methods(x, geometry)
            error = float((got.double().cpu() - want).norm() / want.norm())
            assert error < tolerance, (conv, precision, error)
    assert len(patches._chosen) == 4  # the two 3x3 shapes, once per precision; 1x1 has one method, never timed
