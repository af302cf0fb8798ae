"""Conv2d input patches (KFC's vectors a) and the sum of their outer products.

K-FAC for convolutions (Grosse & Martens 2016) treats each output position as a small linear
layer whose input is the unfolded patch of the (padded) input under the kernel. The A factor
needs the sum over every patch of a aᵀ. Materialising all patches (``F.unfold``) and taking
their Gram matrix costs ``positions x (C*kh*kw)^2`` multiply-adds, which on a ResNet is several
times the cost of the convolution itself.

:func:`patch_moment` computes the same sum without materialising the patches, exactly:

- *row products* (any stride): a patch is ``kh`` rows of ``kw``-wide horizontal pieces. The block
  of kernel rows ``i1`` and ``i2`` is a sum, over the padded rows ``r`` that kernel row ``i1``
  reads, of piece[r] piece[r + dh (i2 - i1)]ᵀ. Each such product depends only on the row and the
  shift, so every pair of rows is multiplied once: the rows all windows of a shift read in one
  product with a long inner axis, the rows at the ends in one batched product, summed into their
  windows by a 0/1 matrix. About ``kh`` times fewer multiply-adds than the Gram of the unfolded
  patches, a few products per kernel row and no loop over positions.
- *autocorrelation* (stride 1, large inputs): see :func:`_autocorrelation_moment`.
- 1x1 kernels: the Gram of the (strided) pixels, through ``F.unfold``.

The tests check each against ``F.unfold`` in float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# The autocorrelation's border strips cost a dozen small calls: it beats the row products only on larger
# inputs (on one CPU core, 3x3 kernels with 16 to 128 channels: from 2^17 to 2^19 input elements).
_AUTOCORRELATION_MIN_INPUT = 1 << 18
_PRODUCT_ELEMENTS = 1 << 22  # the largest (rows, width, width) stack of row products kept at once

@dataclass(frozen=True)
class ConvGeometry:
    """What a Conv2d does spatially, with its padding spelled out as explicit amounts."""

    kernel: tuple[int, int]
    stride: tuple[int, int]
    dilation: tuple[int, int]
    padding: tuple[int, int, int, int]  # left, right, top, bottom: the order F.pad takes
    padding_mode: str  # F.pad's mode: 'constant', 'reflect', 'replicate' or 'circular'

    @classmethod
    def of(cls, conv: nn.Conv2d) -> ConvGeometry:
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
    sums: Tensor | None
    if geometry.kernel == (1, 1):  # a patch is one pixel: nothing to share between kernel offsets
        moment, sums, count = _unfold_moment(geometry.pad(x), geometry)
    elif (
        geometry.stride == (1, 1) and x.numel() >= _AUTOCORRELATION_MIN_INPUT and _border_share(x, geometry) <= 1 / 3
    ):
        moment, sums, count = _autocorrelation_moment(x, geometry, with_bias)
    else:
        moment, sums, count = _row_gram_moment(x, geometry, with_bias)
    if not with_bias:
        return moment
    assert sums is not None
    return bordered_moment(moment, sums, count)


def mean_patches(x: Tensor, geometry: ConvGeometry) -> Tensor:
    """Each example's patch averaged over the output positions: (N, C*kh*kw), features ordered like
    weight.view(out, -1). K-FAC-reduce's a; computed as a correlation of every input channel with a
    kernel of ones the size of the output grid (the convolution's stride as its dilation and its dilation
    as the stride), so no patch is materialised: N·C·kh·kw·positions additions."""
    (kh, kw), (sh, sw), (dh, dw) = geometry.kernel, geometry.stride, geometry.dilation
    padded = geometry.pad(x)
    n, c, height, width = padded.shape
    ho, wo = geometry.output_size(height, width)
    ones = padded.new_ones(1, 1, ho, wo)
    sums = F.conv2d(padded.reshape(n * c, 1, height, width), ones, stride=(dh, dw), dilation=(sh, sw))
    return sums[:, 0, :kh, :kw].reshape(n, c * kh * kw) / (ho * wo)


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

    Shape (C*kw, Hp, N*Wo), features ordered (channel, kernel column). The long axis is innermost, so
    that any range of rows is one strided matrix and each row one matrix of a batch, without copies.
    Zero padding is written as zeros in place instead of padding the input first; any input layout
    (channels-last too) is read through a view.
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


@cache
def _weight_order(c: int, kh: int, kw: int, device: torch.device) -> Tensor:
    """order[f] = the (kernel row, channel, kernel column) position of weight feature f = (channel, row, column)."""
    return torch.arange(c * kh * kw, device=device).view(kh, c, kw).transpose(0, 1).reshape(-1)


def _row_gram_moment(x: Tensor, geometry: ConvGeometry, with_bias: bool) -> tuple[Tensor, Tensor | None, float]:
    """The patch moment from products of padded rows, each pair of rows multiplied once (see module doc)."""
    pieces = _row_pieces(x, geometry)
    width, hp, long = pieces.shape
    (kh, kw), (sh, _), (dh, _) = geometry.kernel, geometry.stride, geometry.dilation
    c = width // kw
    ho = (hp - dh * (kh - 1) - 1) // sh + 1
    # windows[i, r] = 1 where kernel row i reads padded row r for some output row.
    windows = pieces.new_zeros(kh, hp)
    for i in range(kh):
        windows[i, dh * i : dh * i + sh * (ho - 1) + 1 : sh] = 1
    # Rows per batched product: its (rows, width, width) result stays within 16 MiB (or kh² rows, if more).
    chunk = max(kh * kh, _PRODUCT_ELEMENTS // (width * width))

    def product(lo: int, hi: int, step: int) -> Tensor:
        """Σ over rows lo..hi-1 of pieces[:, r] pieces[:, r + step]ᵀ: one product with a long inner axis."""
        return pieces[:, lo:hi].reshape(width, -1) @ pieces[:, lo + step : hi + step].reshape(width, -1).T

    # blocks[i1, :, i2, :] = Σ over output rows t of pieces[:, sh*t + dh*i1] pieces[:, sh*t + dh*i2]ᵀ
    #                      = Σ_r windows[i1, r] pieces[:, r] pieces[:, r + dh*(i2 - i1)]ᵀ for i2 >= i1.
    # With vertical stride 1 the rows every window of a shift reads (the core) take one product; the few
    # rows at either end take one product each, in a batch, and are added to the windows that read them.
    blocks = pieces.new_empty(kh, width, kh, width)
    for shift in range(kh):
        step, used = dh * shift, kh - shift  # kernel rows i1 < used have a partner i1 + shift
        last = dh * (used - 1) + sh * (ho - 1) + 1  # rows [0, last) hold every window of these kernel rows
        core_lo, core_hi = (dh * (used - 1), ho) if sh == 1 else (0, 0)
        has_core = core_lo < core_hi
        sums = pieces.new_zeros(used, width * width)
        for a, b in [(0, core_lo), (core_hi, last)] if has_core else [(0, last)]:
            for lo in range(a, b, chunk):
                hi = min(b, lo + chunk)
                rows = pieces[:, lo:hi].transpose(0, 1)
                products = torch.bmm(rows, pieces[:, lo + step : hi + step].permute(1, 2, 0))
                sums.addmm_(windows[:used, lo:hi], products.view(hi - lo, -1))
        if has_core:
            sums += product(core_lo, core_hi, step).view(1, -1)
        for i1, block in enumerate(sums.view(used, width, width)):
            blocks[i1, :, i1 + shift] = block
            if shift:
                blocks[i1 + shift, :, i1] = block.T

    # Reorder features from (kernel row, channel, kernel column) to the weight's (channel, row, column): two
    # gathers of whole rows and of columns, several times faster than one six-dimensional permuted copy.
    order = _weight_order(c, kh, kw, pieces.device)
    moment = blocks.view(kh * width, kh * width).index_select(0, order).index_select(1, order)
    sums_a = None
    if with_bias:
        per_row = pieces.sum(2) @ windows.T  # (C*kw, kh)
        sums_a = per_row.view(c, kw, kh).permute(0, 2, 1).reshape(-1)
    return moment, sums_a, float(ho * long)


def _outside(size: int, k: int, d: int, pad: int, out: int) -> list[list[int]]:
    """Per kernel offset, the image rows (or columns) its window of positions does not cover."""
    return [[r for r in range(size) if not d * i - pad <= r < d * i - pad + out] for i in range(k)]


def _border_share(x: Tensor, geometry: ConvGeometry) -> float:
    """How much border correction the autocorrelation needs, relative to the image (small images: a lot)."""
    h, w = x.shape[-2:]
    left, right, top, bottom = geometry.padding if geometry.padding_mode == "constant" else (0, 0, 0, 0)
    if geometry.padding_mode != "constant":
        h, w = h + sum(geometry.padding[2:]), w + sum(geometry.padding[:2])
    (kh, kw), (dh, dw) = geometry.kernel, geometry.dilation
    ho, wo = h + top + bottom - dh * (kh - 1), w + left + right - dw * (kw - 1)
    rows = set(sum(_outside(h, kh, dh, top, ho), []))
    cols = set(sum(_outside(w, kw, dw, left, wo), []))
    return len(rows) / h + len(cols) / w


def _weight_gradient(grad_output: Tensor, input: Tensor, kernel: tuple[int, int], dilation: tuple[int, int]) -> Tensor:
    """Σ over examples and positions of grad_output[c] x input[c', shifted]: a convolution's weight gradient.

    With no padding and output size = input size - dilation*(kernel-1), entry [c, c', a, b] is
    Σ_{n,y,x} grad_output[n, c, y, x] input[n, c', y + a*dh, x + b*dw]. Computed by the convolution
    library (oneDNN on CPU, cuDNN on GPU), which runs these products near the machine's peak.
    """
    c_out, c_in = grad_output.shape[1], input.shape[1]
    weight = grad_output.new_empty(c_out, c_in, *kernel)
    return torch.ops.aten.convolution_backward(
        grad_output, input, weight, None, [1, 1], [0, 0], list(dilation), False, [0, 0], 1, [False, True, False]
    )[1]


def _autocorrelation_moment(x: Tensor, geometry: ConvGeometry, with_bias: bool) -> tuple[Tensor, Tensor | None, float]:
    """The patch moment for stride 1 from the input's spatial autocorrelation.

    The block of Σ a aᵀ for kernel offsets o1, o2 is Σ over the window of positions seen by
    offset o1 of x[p] x[p + (o2 - o1)]. Summed over the whole image, that only depends on the shift
    o2 - o1: weight-gradient calls compute it for every shift at once ((2kh-1)(2kw-1) shifts, half of
    them as transposes of the other half, instead of (kh kw)² offset pairs). Each window misses a few
    image rows and columns at the border; their products are subtracted (rows over the full width,
    columns only over the window's rows, so that corners are not subtracted twice).
    """
    left, right, top, bottom = geometry.padding
    if geometry.padding_mode != "constant":  # non-zero padding is part of the image
        x = geometry.pad(x)
        left = right = top = bottom = 0
    n, c, h, w = x.shape
    (kh, kw), (dh, dw) = geometry.kernel, geometry.dilation
    ho, wo = h + top + bottom - dh * (kh - 1), w + left + right - dw * (kw - 1)
    eh, ew = dh * (kh - 1), dw * (kw - 1)  # the largest shifts
    shifts = (2 * kh - 1, 2 * kw - 1)

    # full[a, b] = Σ_p x[p] x[p + ((a - kh + 1) dh, (b - kw + 1) dw)]ᵀ; downward shifts computed, upward ones
    # are their transposes: Σ_p x[p] x[p - s]ᵀ = (Σ_p x[p] x[p + s]ᵀ)ᵀ. Zeros wherever a shift leaves the image.
    below = F.pad(x, (ew, ew, 0, eh))
    down = _weight_gradient(x, below, (kh, 2 * kw - 1), (dh, dw)).permute(2, 3, 0, 1)  # (kh, 2kw-1, C, C)
    up = down[1:].flip(0, 1).transpose(2, 3)
    full = torch.cat([up, down])  # (2kh-1, 2kw-1, C, C)

    def around_row(image: Tensor, r: int, e_rows: int, e_cols: int) -> Tensor:
        """Rows r - e_rows .. r + e_rows of the image, zero beyond its edges, columns padded by e_cols."""
        height = image.shape[2]
        lo, hi = max(0, r - e_rows), min(height, r + e_rows + 1)
        return F.pad(image[:, :, lo:hi], (e_cols, e_cols, lo - (r - e_rows), r + e_rows + 1 - hi))

    rows_out = _outside(h, kh, dh, top, ho)
    cols_out = _outside(w, kw, dw, left, wo)
    border_rows = sorted(set(sum(rows_out, [])))
    border_cols = sorted(set(sum(cols_out, [])))
    row_windows = {r: around_row(x, r, eh, ew) for r in border_rows}
    row_products = {
        r: _weight_gradient(x[:, :, r : r + 1].contiguous(), row_windows[r], shifts, (dh, dw)).permute(2, 3, 0, 1)
        for r in border_rows
    }
    xt = x.transpose(2, 3)  # columns as rows of the transposed image: thin column strips convolve slowly
    col_products = {
        q: _weight_gradient(
            xt[:, :, q : q + 1].contiguous(), around_row(xt, q, ew, eh), shifts[::-1], (dw, dh)
        ).permute(3, 2, 0, 1)
        for q in border_cols
    }
    corners = {}
    if border_rows and border_cols:  # one position's products, where a border row and a border column meet
        pairs = [(r, q) for r in border_rows for q in border_cols]
        centre = torch.stack([x[:, :, r, q] for r, q in pairs]).permute(0, 2, 1)  # (P, C, N)
        around = torch.stack([row_windows[r][:, :, ::dh, q : q + 2 * ew + 1 : dw] for r, q in pairs], dim=1)
        around = around.reshape(n, len(pairs), -1).transpose(0, 1)  # (P, N, C * shifts)
        products = torch.bmm(centre, around).view(len(pairs), c, c, *shifts).permute(0, 3, 4, 1, 2)
        corners = dict(zip(pairs, products, strict=False))

    zero = full.new_zeros(full.shape)

    # What window (i1, j1) must not count: its border rows (full width), plus its border columns
    # without the corners already in those rows.
    by_row = torch.stack([sum((row_products[r] for r in rows), zero) for rows in rows_out])  # (kh, ...)
    by_col = torch.stack([sum((col_products[q] for q in cols), zero) for cols in cols_out])  # (kw, ...)
    missing = by_row[:, None] + by_col[None, :]
    for i1 in range(kh):
        for j1 in range(kw):
            for q in cols_out[j1]:
                for r in rows_out[i1]:
                    missing[i1, j1] -= corners[(r, q)]

    # blocks[i1, j1, i2, j2] = (full - missing[i1, j1])[shift], shift index (i2 - i1 + kh - 1, j2 - j1 + kw - 1)
    o1, p1, o2, p2 = torch.meshgrid(*(torch.arange(k, device=x.device) for k in (kh, kw, kh, kw)), indexing="ij")
    a_shift, b_shift = o2 - o1 + kh - 1, p2 - p1 + kw - 1
    blocks = full[a_shift, b_shift] - missing[o1, p1, a_shift, b_shift]  # (kh, kw, kh, kw, C, C)
    d = c * kh * kw
    moment = blocks.permute(4, 0, 1, 5, 2, 3).reshape(d, d)  # features (channel, row, column)
    moment = (moment + moment.T) / 2  # equal up to rounding; keep it exactly symmetric

    sums = None
    if with_bias:
        image = x.sum(0)  # (C, H, W)
        per_offset = []
        for i in range(kh):
            r0, r1 = max(0, dh * i - top), min(h, dh * i - top + ho)
            for j in range(kw):
                q0, q1 = max(0, dw * j - left), min(w, dw * j - left + wo)
                per_offset.append(image[:, r0:r1, q0:q1].sum((1, 2)))
        sums = torch.stack(per_offset, dim=1).reshape(d)  # (C, kh*kw) -> features (channel, row, column)
    return moment, sums, float(n * ho * wo)
