"""Augmentation and normalisation, written once for the CPU and the GPU.

The JPEG views (``train_params`` + ``train_view`` / ``eval_view``) are plain tensor functions used
on whichever device holds the decoded image: CPU loader workers call them after libjpeg-turbo
decoding, the device-decode thread calls them on CUDA after nvJPEG decoding. The crop and flip of
a sample come from the sample's own seed through a counter-based generator (splitmix64), so a
whole batch's parameters are drawn in a few numpy operations on the host, and a sample gets the
same crop whether it is drawn alone (in a worker) or with its batch (on the device thread). The
CIFAR crop and flip run on a whole batch at once with one gather, from a torch generator.

torchvision is imported inside the JPEG views: importing it costs a second (it loads torch's compiler
stack), which a run on in-memory data should not pay at start-up.
"""

from __future__ import annotations

import numpy as np
import torch

from hpcdl.data.spec import Normalization

SCALE, RATIO = (0.08, 1.0), (3.0 / 4.0, 4.0 / 3.0)  # RandomResizedCrop's defaults
ATTEMPTS = 10  # RandomResizedCrop's tries before it falls back to a centre crop
EVAL_CROP_FRACTION = 0.875  # resize to 256, centre-crop 224
_GOLDEN, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def uniforms(seeds: np.ndarray, count: int) -> np.ndarray:
    """(N, count) floats uniform in [0, 1): draw j of seed s is splitmix64(s + (j + 1) * golden), so each
    sample's draws depend on its seed alone, never on the batch it is drawn with."""
    with np.errstate(over="ignore"):
        z = seeds.astype(np.uint64)[:, None] + np.arange(1, count + 1, dtype=np.uint64) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


def train_params(heights: np.ndarray, widths: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    """RandomResizedCrop's (top, left, h, w) and RandomHorizontalFlip's flip for a batch: (N, 5) int64.

    The algorithm of torchvision's ``RandomResizedCrop.get_params`` (area fraction uniform in SCALE,
    log aspect ratio uniform in log RATIO, up to ATTEMPTS tries, then a centre crop clamped to RATIO)
    and a fair flip, evaluated for all samples at once from their seeds."""
    heights, widths = np.asarray(heights, np.int64), np.asarray(widths, np.int64)
    u = uniforms(np.asarray(seeds), 2 * ATTEMPTS + 3)
    area = (heights * widths)[:, None].astype(np.float64)
    target_area = area * (SCALE[0] + (SCALE[1] - SCALE[0]) * u[:, :ATTEMPTS])
    log_lo, log_hi = np.log(RATIO[0]), np.log(RATIO[1])
    aspect = np.exp(log_lo + (log_hi - log_lo) * u[:, ATTEMPTS:2 * ATTEMPTS])
    w = np.rint(np.sqrt(target_area * aspect)).astype(np.int64)
    h = np.rint(np.sqrt(target_area / aspect)).astype(np.int64)
    fits = (w > 0) & (w <= widths[:, None]) & (h > 0) & (h <= heights[:, None])
    first = fits.argmax(axis=1)
    rows = np.arange(len(heights))
    found = fits[rows, first]
    crop_h, crop_w = h[rows, first], w[rows, first]
    in_ratio = widths / heights  # the fallback: a centre crop of the whole image, clamped to RATIO
    fallback_w = np.where(in_ratio < RATIO[0], widths,
                          np.where(in_ratio > RATIO[1], np.rint(heights * RATIO[1]).astype(np.int64), widths))
    fallback_h = np.where(in_ratio < RATIO[0], np.rint(widths / RATIO[0]).astype(np.int64), heights)
    crop_h, crop_w = np.where(found, crop_h, fallback_h), np.where(found, crop_w, fallback_w)
    top = np.where(found, np.floor(u[:, -3] * (heights - crop_h + 1)).astype(np.int64), (heights - crop_h) // 2)
    left = np.where(found, np.floor(u[:, -2] * (widths - crop_w + 1)).astype(np.int64), (widths - crop_w) // 2)
    flip = (u[:, -1] < 0.5).astype(np.int64)
    return np.stack([top, left, crop_h, crop_w, flip], axis=1)


def train_view(image: torch.Tensor, crop: tuple[int, int, int, int], flip: bool, size: int) -> torch.Tensor:
    """RandomResizedCrop(size) with the given crop, then the flip: uint8 (C, H, W) -> uint8 (C, size, size)."""
    from torchvision.transforms.v2 import functional as F

    top, left, h, w = crop
    out = F.resized_crop(image, top, left, h, w, [size, size], antialias=True)
    return F.horizontal_flip(out) if flip else out


def eval_view(image: torch.Tensor, size: int) -> torch.Tensor:
    """Resize the shorter side to size/0.875, then a centre crop of size: the usual evaluation view."""
    from torchvision.transforms.v2 import functional as F

    resized = F.resize(image, [int(round(size / EVAL_CROP_FRACTION))], antialias=True)
    return F.center_crop(resized, [size, size])


def draw_crop_flip(n: int, padding: int, generator: torch.Generator,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per image: top and left offsets uniform in 0..2*padding, and a fair flip; (N, 1) tensors on ``device``."""
    top = torch.randint(0, 2 * padding + 1, (n, 1), generator=generator, device=device)
    left = torch.randint(0, 2 * padding + 1, (n, 1), generator=generator, device=device)
    flip = torch.rand(n, 1, generator=generator, device=device) < 0.5
    return top, left, flip


def apply_crop_flip(images: torch.Tensor, padding: int, top: torch.Tensor, left: torch.Tensor,
                    flip: torch.Tensor) -> torch.Tensor:
    """Zero-pad (N, C, H, W) by ``padding``, crop H x W at (top, left), flip where asked: one gather.

    The flip is folded into the column indices, so crop and flip cost one pass over the batch.
    """
    n, _, h, w = images.shape
    device = images.device
    padded = torch.nn.functional.pad(images, (padding, padding, padding, padding))
    cols = torch.arange(w, device=device).expand(n, w)
    cols = torch.where(flip, w - 1 - cols, cols) + left  # (N, W)
    rows = torch.arange(h, device=device).expand(n, h) + top  # (N, H)
    batch = torch.arange(n, device=device).view(n, 1, 1)
    out = padded.permute(0, 2, 3, 1)[batch, rows.unsqueeze(2), cols.unsqueeze(1)]  # (N, H, W, C)
    return out.permute(0, 3, 1, 2).contiguous()


def pad_crop_flip(images: torch.Tensor, padding: int, generator: torch.Generator) -> torch.Tensor:
    """RandomCrop(H, padding) + RandomHorizontalFlip for a whole batch, on its device, from ``generator``."""
    top, left, flip = draw_crop_flip(len(images), padding, generator, images.device)
    return apply_crop_flip(images, padding, top, left, flip)


class Normalizer:
    """uint8 (or float) images -> float32 ``(x / max - mean) / std`` as one multiply-add on the device."""

    def __init__(self, norm: Normalization, device: torch.device, channels_last: bool) -> None:
        std = torch.tensor(norm.std, dtype=torch.float32)
        mean = torch.tensor(norm.mean, dtype=torch.float32)
        self.scale = (1.0 / (norm.max_value * std)).view(1, -1, 1, 1).to(device)
        self.shift = (-mean / std).view(1, -1, 1, 1).to(device)
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        out = torch.addcmul(self.shift, images.to(torch.float32), self.scale)
        return out.contiguous(memory_format=self.memory_format)
