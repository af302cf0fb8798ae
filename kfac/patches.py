"""Conv2d input patches (KFC's vectors a) and the sum of their outer products.

K-FAC for convolutions (Grosse & Martens 2016) treats each output position as a small linear
layer whose input is the unfolded patch of the (padded) input under the kernel. The A factor
needs the sum over every patch of a aᵀ. Materialising all patches (``F.unfold``) and taking
their Gram matrix costs ``positions x (C*kh*kw)^2`` multiply-adds, which on a ResNet is several
times the cost of the convolution itself.

:func:`patch_moment` computes the same sum with about ``kh`` times less work when the vertical
stride is 1: a patch is ``kh`` rows of ``kw``-wide horizontal pieces, and the product of the
pieces of row offset ``i1`` and ``i2`` summed over all output rows only depends on the shift
``i2 - i1`` and the range of input rows, so it is computed once per shift from one Gram over the
rows shared by every window (plus small corrections for the few rows at the ends).
Other strides fall back to ``F.unfold``, which the tests also use as the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class ConvGeometry:
    """What a Conv2d does spatially, with its padding spelled out as explicit amounts."""

    kernel: tuple[int, int]
    stride: tuple[int, int]
    dilation: tuple[int, int]
    padding: tuple[int, int, int, int]  # left, right, top, bottom: the order F.pad takes
    padding_mode: str  # F.pad's mode: 'constant', 'reflect', 'replicate' or 'circular'

    @classmethod
    def of(cls, conv: nn.Conv2d) -> "ConvGeometry":
        kh, kw = conv.kernel_size
        dh, dw = conv.dilation
        if isinstance(conv.padding, str):
            if conv.padding == "valid":
                top = bottom = left = right = 0
            else:  # 'same': PyTorch puts the odd extra pixel at the end (bottom/right)
                total_h, total_w = dh * (kh - 1), dw * (kw - 1)
                top, bottom = total_h // 2, total_h - total_h // 2
                left, right = total_w // 2, total_w - total_w // 2
        else:
            top = bottom = conv.padding[0]
            left = right = conv.padding[1]
        mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
        return cls(
            kernel=(kh, kw),
            stride=tuple(conv.stride),  # type: ignore[arg-type]
            dilation=(dh, dw),
            padding=(left, right, top, bottom),
            padding_mode=mode,
        )

    def pad(self, x: Tensor) -> Tensor:
        """The input as the convolution sees it, padding included."""
        if not any(self.padding):
            return x
        return F.pad(x, self.padding, mode=self.padding_mode)

    def output_size(self, padded_height: int, padded_width: int) -> tuple[int, int]:
        (kh, kw), (sh, sw), (dh, dw) = self.kernel, self.stride, self.dilation
        return (padded_height - dh * (kh - 1) - 1) // sh + 1, (padded_width - dw * (kw - 1) - 1) // sw + 1


def conv_patches(x: Tensor, geometry: ConvGeometry) -> Tensor:
    """Every patch as a row: shape (N, positions, C*kh*kw), features ordered like weight.view(out, -1)."""
    columns = F.unfold(geometry.pad(x), geometry.kernel, dilation=geometry.dilation, stride=geometry.stride)
    return columns.transpose(1, 2)


def patch_moment(x: Tensor, geometry: ConvGeometry, with_bias: bool) -> Tensor:
    """Sum over all patches of all examples of a aᵀ, a = [patch, 1] when ``with_bias``.

    ``x`` is the layer input (N, C, H, W); the result is (D, D) with D = C*kh*kw (+1), in x's dtype.
    """
    if geometry.stride[0] == 1 and geometry.kernel[0] > 1:
        moment, sums, count = _row_shift_moment(x, geometry, with_bias)
    else:
        moment, sums, count = _unfold_moment(geometry.pad(x), geometry)
    return bordered_moment(moment, sums, count) if with_bias else moment


def bordered_moment(moment: Tensor, sums: Tensor, count: float) -> Tensor:
    """[[Σ a aᵀ, Σ a], [Σ aᵀ, count]]: the moment of [a, 1] without building a column of ones."""
    d = moment.shape[0]
    out = moment.new_empty(d + 1, d + 1)
    out[:d, :d] = moment
    out[:d, d] = sums
    out[d, :d] = sums
    out[d, d] = count
    return out


def _unfold_moment(padded: Tensor, geometry: ConvGeometry) -> tuple[Tensor, Tensor, float]:
    columns = F.unfold(padded, geometry.kernel, dilation=geometry.dilation, stride=geometry.stride)
    features = columns.permute(1, 0, 2).reshape(columns.shape[1], -1)  # (C*kh*kw, N*positions)
    return features @ features.T, features.sum(1), float(features.shape[1])


def _row_pieces(x: Tensor, geometry: ConvGeometry) -> Tensor:
    """pieces[:, q] = the kw-wide horizontal piece at every output column of every example, for padded row q.

    Shape (C*kw, Hp, N*Wo), features ordered (channel, kernel column). The long axis is innermost
    so that any range of rows is one strided matrix for the BLAS, without copies. Zero padding is
    left as the zeros the tensor starts with instead of padding the input first.
    """
    n, c, h, w = x.shape
    (_, kw), (_, sw), (_, dw) = geometry.kernel, geometry.stride, geometry.dilation
    left, right, top, bottom = geometry.padding
    if geometry.padding_mode != "constant":
        x = geometry.pad(x)
        n, c, h, w = x.shape
        left = right = top = bottom = 0
    hp, wp = h + top + bottom, w + left + right
    _, wo = geometry.output_size(hp, wp)
    pieces = x.new_empty(c, kw, hp, n, wo)
    pieces[:, :, :top].zero_()
    pieces[:, :, top + h :].zero_()
    by_row = x.permute(1, 2, 0, 3)  # (C, H, N, W), a view
    for j in range(kw):
        first = j * dw - left  # input column read by output column 0 (negative: inside the padding)
        lo = max(0, min(wo, -(first // sw)))
        hi = max(lo, min(wo, (w - 1 - first) // sw + 1))
        inside = pieces[:, j, top : top + h]
        inside[..., :lo].zero_()
        inside[..., hi:].zero_()
        if lo < hi:
            start = first + sw * lo
            inside[..., lo:hi] = by_row[..., start : start + sw * (hi - lo - 1) + 1 : sw]
    return pieces.view(c * kw, hp, n * wo)


def _row_shift_moment(x: Tensor, geometry: ConvGeometry, with_bias: bool) -> tuple[Tensor, Tensor | None, float]:
    """The patch moment for vertical stride 1, sharing work between kernel rows (see module doc)."""
    pieces = _row_pieces(x, geometry)
    width, hp, _ = pieces.shape
    (kh, kw), (dh, _) = geometry.kernel, geometry.dilation
    c = width // kw
    ho = hp - dh * (kh - 1)
    n_wo = pieces.shape[2]

    def rows(lo: int, hi: int) -> Tensor:
        return pieces[:, lo:hi].reshape(width, -1)

    # blocks[i1, :, i2, :] = Σ over output rows r of pieces[:, r + dh*i1] pieces[:, r + dh*i2]ᵀ.
    # For one shift i2 - i1 every window [dh*i1, dh*i1 + ho) shares the core rows; only the few
    # rows at either end differ from window to window.
    blocks = pieces.new_empty(kh, width, kh, width)
    for shift in range(kh):
        step = dh * shift
        windows = kh - shift
        core_lo, core_hi = dh * (windows - 1), ho
        has_core = core_lo < core_hi
        core = rows(core_lo, core_hi) @ rows(core_lo + step, core_hi + step).T if has_core else None
        for i1 in range(windows):
            lo, hi = dh * i1, dh * i1 + ho
            ranges = [(lo, core_lo), (core_hi, hi)] if has_core else [(lo, hi)]
            block = core
            for a, b in ranges:
                if a < b:
                    part = rows(a, b) @ rows(a + step, b + step).T
                    block = part if block is None else block + part
            blocks[i1, :, i1 + shift, :] = block
            if shift:
                blocks[i1 + shift, :, i1, :] = block.T

    # Reorder features from (kernel row, channel, kernel column) to the weight's (channel, row, column).
    d = c * kh * kw
    moment = blocks.view(kh, c, kw, kh, c, kw).permute(1, 0, 2, 4, 3, 5).reshape(d, d)
    sums = None
    if with_bias:
        row_sums = pieces.sum(2)  # (C*kw, Hp)
        per_row = torch.stack([row_sums[:, dh * i : dh * i + ho].sum(1) for i in range(kh)])  # (kh, C*kw)
        sums = per_row.view(kh, c, kw).permute(1, 0, 2).reshape(d)
    return moment, sums, float(ho * n_wo)
