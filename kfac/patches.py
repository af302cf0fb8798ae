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
    padded = geometry.pad(x)
    if geometry.stride[0] == 1 and geometry.kernel[0] > 1:
        moment, sums, count = _row_shift_moment(padded, geometry)
    else:
        moment, sums, count = _unfold_moment(padded, geometry)
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


def _row_shift_moment(padded: Tensor, geometry: ConvGeometry) -> tuple[Tensor, Tensor, float]:
    """The patch moment for vertical stride 1, sharing work between kernel rows (see module doc)."""
    n, c, hp, wp = padded.shape
    (kh, kw), (_, sw), (dh, dw) = geometry.kernel, geometry.stride, geometry.dilation
    ho, wo = geometry.output_size(hp, wp)
    width = c * kw

    # pieces[:, q] = for input row q, the kw-wide horizontal piece at every output column of every
    # example: shape (C*kw, Hp, N*Wo), features ordered (channel, kernel column). The long axis is
    # innermost so that a range of rows is one strided matrix for the BLAS, without copies.
    by_row = padded.permute(1, 2, 0, 3)  # (C, Hp, N, Wp)
    shifted = [by_row[..., j * dw : j * dw + sw * (wo - 1) + 1 : sw] for j in range(kw)]
    pieces = torch.stack(shifted, dim=1).reshape(width, hp, n * wo)

    # blocks[i1, :, i2, :] = Σ over output rows r of pieces[:, r + dh*i1] pieces[:, r + dh*i2]ᵀ
    blocks = padded.new_empty(kh, width, kh, width)
    for shift in range(kh):
        step = dh * shift
        windows = kh - shift  # first kernel rows i1 = 0 .. windows-1; window i1 covers rows [dh*i1, dh*i1 + ho)
        core_lo, core_hi = dh * (windows - 1), ho  # rows inside every window
        union_hi = dh * (windows - 1) + ho
        if core_lo < core_hi:
            lhs = pieces[:, core_lo:core_hi].reshape(width, -1)
            rhs = pieces[:, core_lo + step : core_hi + step].reshape(width, -1)
            core = lhs @ rhs.T
            edge_rows = [q for q in range(union_hi) if not core_lo <= q < core_hi]
        else:
            core = padded.new_zeros(width, width)
            edge_rows = list(range(union_hi))
        if edge_rows:
            idx = torch.tensor(edge_rows, device=padded.device)
            lhs_edges = pieces[:, idx].transpose(0, 1)  # (E, C*kw, N*Wo)
            rhs_edges = pieces[:, idx + step].transpose(0, 1)
            edges = torch.bmm(lhs_edges, rhs_edges.transpose(1, 2))
        for i1 in range(windows):
            lo, hi = dh * i1, dh * i1 + ho
            inside = [e for e, q in enumerate(edge_rows) if lo <= q < hi]
            block = core + edges[inside].sum(0) if inside else core
            blocks[i1, :, i1 + shift, :] = block
            if shift:
                blocks[i1 + shift, :, i1, :] = block.T

    # Reorder features from (kernel row, channel, kernel column) to the weight's (channel, row, column).
    d = c * kh * kw
    moment = blocks.view(kh, c, kw, kh, c, kw).permute(1, 0, 2, 4, 3, 5).reshape(d, d)
    row_sums = pieces.sum(2)  # (C*kw, Hp)
    sums = torch.stack([row_sums[:, dh * i : dh * i + ho].sum(1) for i in range(kh)])  # (kh, C*kw)
    sums = sums.view(kh, c, kw).permute(1, 0, 2).reshape(d)
    return moment, sums, float(n * ho * wo)
