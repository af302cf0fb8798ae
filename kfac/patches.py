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
  shift, so every pair of rows is multiplied once, all pairs of a shift in one batched product,
  summed into their windows by a 0/1 matrix. About ``kh`` times fewer multiply-adds than the Gram of
  the unfolded patches, in 2 kh + 6 calls: on a GPU, where each call costs the host several
  microseconds, the number of calls matters as much as the multiply-adds.
- *autocorrelation* (stride 1, large inputs): see :func:`_autocorrelation_moment`.
- *unfold*: the Gram of the unfolded patches, a batch of examples at a time; the only method for 1x1
  kernels (a patch is one pixel).

Which is fastest depends on the machine more than on the shape: on a CPU core the row products and
the autocorrelation win by the multiply-adds they save, measured once into a fixed rule; on a GPU the
calls and the bytes moved count as well (an H200's: benchmarks/results/kfac_conv_methods_cuda.json). So
on any other device the first input of each shape times every method that applies and keeps the fastest,
like ``torch.backends.cudnn.benchmark`` (:func:`choose_method`); with deterministic algorithms on, or while
a graph is captured or compiled, the fixed rule decides. The methods are exact and agree to rounding.

The tests check each against ``F.unfold`` in float64.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kfac.precision import add_mm_, bmm, mm, result_dtype, wide_sum

# The autocorrelation's border strips cost a dozen small calls: it beats the row products only on larger
# inputs (on one CPU core, 3x3 kernels with 16 to 128 channels: from 2^17 to 2^19 input elements).
_AUTOCORRELATION_MIN_INPUT = 1 << 18
_PRODUCT_ELEMENTS = 1 << 22  # the largest (rows, width, width) stack of row products kept at once on a CPU
_DEVICE_PRODUCT_ELEMENTS = 1 << 26  # and on a GPU (256 MiB in float32)
_UNFOLD_BYTES = 1 << 28  # the unfolded patches of a batch are built this many bytes at a time

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

    ``x`` is the layer input (N, C, H, W); the result is (D, D) with D = C*kh*kw (+1), in x's dtype (float32
    for a half x: kfac.precision).
    """
    moment, sums, count = MOMENT_METHODS[choose_method(x, geometry, with_bias)](x, geometry, with_bias)
    if not with_bias:
        return moment
    assert sums is not None
    return bordered_moment(moment, sums, count)


def applicable_methods(x: Tensor, geometry: ConvGeometry) -> list[str]:
    """The methods that compute this input's moment, in the fixed rule's order of preference on a CPU."""
    if geometry.kernel == (1, 1):  # a patch is one pixel: nothing to share between kernel offsets
        return ["unfold"]
    return ["autocorrelation", "rows", "unfold"] if geometry.stride == (1, 1) else ["rows", "unfold"]


def fixed_method(x: Tensor, geometry: ConvGeometry) -> str:
    """The rule measured on one CPU core: the autocorrelation on large stride-1 inputs with little border to
    correct, the row products otherwise."""
    methods = applicable_methods(x, geometry)
    if methods[0] == "autocorrelation" and (
        x.numel() < _AUTOCORRELATION_MIN_INPUT or _border_share(x, geometry) > 1 / 3
    ):
        return methods[1]
    return methods[0]


_chosen: dict[tuple, str] = {}  # (shape, strides, dtype, device, geometry, bias, precision) -> the fastest


def choose_method(x: Tensor, geometry: ConvGeometry, with_bias: bool) -> str:
    """The method for this input: the fixed rule on a CPU, with deterministic algorithms, in a captured or
    compiled graph; elsewhere the fastest measured on the first input of its shape (then remembered)."""
    methods = applicable_methods(x, geometry)
    if len(methods) == 1:
        return methods[0]
    if (
        x.device.type == "cpu"
        or torch.are_deterministic_algorithms_enabled()
        or torch.compiler.is_compiling()
        or (x.is_cuda and torch.cuda.is_current_stream_capturing())
    ):
        return fixed_method(x, geometry)
    precision = torch.backends.cuda.matmul.fp32_precision  # TF32 or not changes which is fastest
    key = (tuple(x.shape), x.stride(), x.dtype, x.device, geometry, with_bias, precision)
    if key not in _chosen:
        _chosen[key] = min(methods, key=lambda name: method_seconds(name, x, geometry, with_bias))
    return _chosen[key]


def method_seconds(name: str, x: Tensor, geometry: ConvGeometry, with_bias: bool, repeats: int = 2) -> float:
    """The best of ``repeats`` timed runs of one method, after one untimed run (library heuristics, allocator)."""
    def finish() -> None:  # the device's queue drained, so that the clock sees the work itself
        if x.device.type != "cpu":
            torch.accelerator.synchronize(x.device)

    MOMENT_METHODS[name](x, geometry, with_bias)
    best = float("inf")
    for _ in range(repeats):
        finish()
        start = time.perf_counter()
        MOMENT_METHODS[name](x, geometry, with_bias)
        finish()
        best = min(best, time.perf_counter() - start)
    return best


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


def _unfold_moment(x: Tensor, geometry: ConvGeometry, with_bias: bool = True) -> tuple[Tensor, Tensor | None, float]:
    """The Gram of the unfolded patches, built for as many examples at a time as fit in _UNFOLD_BYTES, and with
    ``with_bias`` the patch sums (a pass over the input of its own: a GPU's 1x1 layers, ResNet-50's most, have none)."""
    if geometry.kernel == (1, 1) and not any(geometry.padding):  # the patches are the (strided) pixels
        sh, sw = geometry.stride
        pixels = x[:, :, ::sh, ::sw].movedim(1, -1).reshape(-1, x.shape[1])  # a view of a channels-last input
        return mm(pixels.T, pixels), wide_sum(pixels, 0) if with_bias else None, float(pixels.shape[0])
    padded = geometry.pad(x)
    n, c, height, width = padded.shape
    d = c * geometry.kernel[0] * geometry.kernel[1]
    positions = math.prod(geometry.output_size(height, width))
    step = max(1, _UNFOLD_BYTES // max(1, d * positions * padded.element_size()))
    moment = padded.new_zeros(d, d, dtype=result_dtype(padded))
    sums = padded.new_zeros(d, dtype=result_dtype(padded)) if with_bias else None
    for lo in range(0, n, step):
        columns = F.unfold(padded[lo : lo + step], geometry.kernel, dilation=geometry.dilation, stride=geometry.stride)
        features = columns.permute(1, 0, 2).reshape(d, -1)  # (C*kh*kw, examples*positions)
        add_mm_(moment, features, features.T)
        if sums is not None:
            sums += wide_sum(features, 1)
    return moment, sums, float(n * positions)


def _pieces_by_row(x: Tensor, geometry: ConvGeometry) -> Tensor:
    """pieces[r] = the kw-wide horizontal pieces of padded row r at every output column of every example.

    Shape (Hp, C*kw, N*Wo), features ordered (channel, kernel column): two copies (the padding, the pieces),
    whatever the input's layout, so that each row is one matrix of a batch and a range of rows one slab.
    """
    padded = geometry.pad(x)
    n, c, hp, wp = padded.shape
    (_, kw), (_, sw), (_, dw) = geometry.kernel, geometry.stride, geometry.dilation
    _, wo = geometry.output_size(hp, wp)
    span = dw * (kw - 1) + 1
    pieces = padded.permute(2, 1, 0, 3).unfold(3, span, sw)[..., ::dw]  # (Hp, C, N, Wo, kw), a view
    return pieces.permute(0, 1, 4, 2, 3).reshape(hp, c * kw, n * wo)


@cache
def _weight_order(c: int, kh: int, kw: int, device: torch.device) -> Tensor:
    """order[f] = the (kernel row, channel, kernel column) position of weight feature f = (channel, row, column)."""
    return torch.arange(c * kh * kw, device=device).view(kh, c, kw).transpose(0, 1).reshape(-1)


@cache
def _windows(kh: int, dh: int, sh: int, ho: int, hp: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """windows[i, r] = 1 where kernel row i reads padded row r for some output row (built once per shape)."""
    windows = torch.zeros(kh, hp, dtype=dtype)
    for i in range(kh):
        windows[i, dh * i : dh * i + sh * (ho - 1) + 1 : sh] = 1
    return windows.to(device)


@cache
def _block_index(kh: int, device: torch.device) -> Tensor:
    """Where block (i1, i2) lies in [row products by shift; their transposes]: shift i2 - i1's entry i1 above the
    diagonal, the transpose of shift i1 - i2's entry i2 below it."""
    offset = [sum(kh - s for s in range(shift)) for shift in range(kh)]
    upper = kh * (kh + 1) // 2
    index = [offset[i2 - i1] + i1 if i2 >= i1 else upper + offset[i1 - i2] + i2 for i1 in range(kh) for i2 in range(kh)]
    return torch.tensor(index, device=device)


def _row_gram_moment(x: Tensor, geometry: ConvGeometry, with_bias: bool) -> tuple[Tensor, Tensor | None, float]:
    """The patch moment from products of padded rows, in a few batched calls (see module doc).

    For each vertical shift s, every pair of rows s apart is multiplied once in one batched product, and the
    0/1 window matrix sums the products into each kernel row's block: block (i1, i1 + s) = Σ_r windows[i1, r]
    pieces[r] pieces[r + dh s]ᵀ. 2 kh + 6 calls in all (more only where a shift's products are split to bound
    their memory), whatever the stride, which is what a GPU's launch-bound hooks need.
    """
    pieces = _pieces_by_row(x, geometry)
    hp, width, long = pieces.shape
    (kh, kw), (sh, _), (dh, _) = geometry.kernel, geometry.stride, geometry.dilation
    c = width // kw
    ho = (hp - dh * (kh - 1) - 1) // sh + 1
    windows = _windows(kh, dh, sh, ho, hp, result_dtype(pieces), pieces.device)
    chunk = max(1, (_PRODUCT_ELEMENTS if pieces.device.type == "cpu" else _DEVICE_PRODUCT_ELEMENTS) // width**2)
    by_shift = []
    for shift in range(kh):
        step, used = dh * shift, kh - shift  # kernel rows i1 < used have a partner i1 + shift
        last = dh * (used - 1) + sh * (ho - 1) + 1  # rows [0, last) hold every window of these kernel rows
        total: Tensor | None = None
        for lo in range(0, last, chunk):
            hi = min(last, lo + chunk)
            products = bmm(pieces[lo:hi], pieces[lo + step : hi + step].transpose(1, 2))  # (rows, W, W)
            part = windows[:used, lo:hi] @ products.view(hi - lo, -1)
            total = part if total is None else total.add_(part)
        assert total is not None
        by_shift.append(total.view(used, width, width))
    upper = torch.cat(by_shift)
    blocks = torch.cat([upper, upper.transpose(1, 2)]).index_select(0, _block_index(kh, pieces.device))
    # (i1, i2, (channel, column), (channel, column)) -> rows and columns (i1, channel, column), then the weight's
    # (channel, row, column) by two gathers: on a CPU three times faster than one six-dimensional permuted copy
    order = _weight_order(c, kh, kw, pieces.device)
    moment = blocks.view(kh, kh, width, width).transpose(1, 2).reshape(kh * width, kh * width)
    moment = moment.index_select(0, order).index_select(1, order)
    sums_a = None
    if with_bias:
        per_row = windows @ wide_sum(pieces, 2)  # (kh, C*kw)
        sums_a = per_row.view(kh, c, kw).transpose(0, 1).reshape(-1)
    return moment, sums_a, float(ho * long)


def _outside(size: int, k: int, d: int, pad: int, out: int) -> list[list[int]]:
    """Per kernel offset, the image rows (or columns) its window of positions does not cover."""
    return [[r for r in range(size) if not d * i - pad <= r < d * i - pad + out] for i in range(k)]


def _border_share(x: Tensor, geometry: ConvGeometry) -> float:
    """How much border correction the autocorrelation needs, relative to the image (small images: a lot)."""
    return _border_share_of(x.shape[-2], x.shape[-1], geometry)


@cache
def _border_share_of(h: int, w: int, geometry: ConvGeometry) -> float:
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
    x = x.to(result_dtype(x))  # its products are convolutions' weight gradients, which would round to half
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


# The ways to compute a patch moment, by name; each returns (Σ a aᵀ, Σ a or None, the patch count).
MOMENT_METHODS: dict[str, Callable[[Tensor, ConvGeometry, bool], tuple[Tensor, Tensor | None, float]]] = {
    "autocorrelation": _autocorrelation_moment,
    "rows": _row_gram_moment,
    "unfold": _unfold_moment,
}
