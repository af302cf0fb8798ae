"""Augmentation and normalisation, written once for the CPU and the GPU.

The JPEG views (``resized_crop_params`` + ``train_view`` / ``eval_view``) are plain tensor functions
used on whichever device holds the decoded image: CPU loader workers call them after
libjpeg-turbo decoding, the main process calls them on CUDA after nvJPEG decoding, with the same
per-sample parameters, so both paths have the same semantics. The CIFAR crop and flip run on a
whole batch at once with one gather. Every random draw takes an explicit generator.
"""

from __future__ import annotations

import math

import torch
from torchvision.transforms.v2 import functional as F

from hpcdl.data.spec import Normalization

SCALE, RATIO = (0.08, 1.0), (3.0 / 4.0, 4.0 / 3.0)  # RandomResizedCrop's defaults
EVAL_CROP_FRACTION = 0.875  # resize to 256, centre-crop 224


def resized_crop_params(height: int, width: int, generator: torch.Generator) -> tuple[int, int, int, int]:
    """(top, left, h, w) drawn exactly as torchvision's ``RandomResizedCrop.get_params`` draws them
    (same distribution, same sequence of draws), but from ``generator`` instead of the global RNG."""
    area = height * width
    log_ratio = torch.log(torch.tensor(RATIO))  # float32, as torchvision computes it
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(SCALE[0], SCALE[1], generator=generator).item()
        draw = torch.empty(1).uniform_(float(log_ratio[0]), float(log_ratio[1]), generator=generator)
        aspect_ratio = torch.exp(draw).item()
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, size=(1,), generator=generator).item())
            left = int(torch.randint(0, width - w + 1, size=(1,), generator=generator).item())
            return top, left, h, w
    in_ratio = float(width) / float(height)  # fallback: a centre crop of the whole image
    if in_ratio < min(RATIO):
        w, h = width, int(round(width / min(RATIO)))
    elif in_ratio > max(RATIO):
        h, w = height, int(round(height * max(RATIO)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def flip_draw(generator: torch.Generator) -> bool:
    """RandomHorizontalFlip's draw (``torch.rand(1) < 0.5``) from ``generator``."""
    return bool(torch.rand(1, generator=generator).item() < 0.5)


def sample_train_params(height: int, width: int, seed: int) -> tuple[tuple[int, int, int, int], bool]:
    """The crop and flip of one training sample, from its own seed (so they do not depend on which
    worker, device or batch handles it)."""
    generator = torch.Generator().manual_seed(seed)
    crop = resized_crop_params(height, width, generator)
    return crop, flip_draw(generator)


def train_view(image: torch.Tensor, crop: tuple[int, int, int, int], flip: bool, size: int) -> torch.Tensor:
    """RandomResizedCrop(size) with the given crop, then the flip: uint8 (C, H, W) -> uint8 (C, size, size)."""
    top, left, h, w = crop
    out = F.resized_crop(image, top, left, h, w, [size, size], antialias=True)
    return F.horizontal_flip(out) if flip else out


def eval_view(image: torch.Tensor, size: int) -> torch.Tensor:
    """Resize the shorter side to size/0.875, then a centre crop of size: the usual evaluation view."""
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
