"""Datasets held in memory as integer images: uint8 (C, H, W) tensors plus int64 labels.

The new pipeline reads ``images``/``labels`` directly (and moves them to the device once);
``__getitem__`` serves the older per-sample DataLoader path with normalised float images.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from hpcdl.data.spec import Normalization
from hpcdl.runtime.errors import UsageError


@dataclass
class DataBundle:
    train: Dataset
    test: Dataset
    num_classes: int
    channels: int
    image_size: int


class ImageTensors(Dataset):
    """Images (N, C, H, W) of an integer dtype with labels (N,), and the normalisation they need."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, norm: Normalization,
                 transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.images, self.labels, self.norm, self.transform = images, labels.long(), norm, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[index]
        if self.transform is not None:
            image = self.transform(image)
        mean = torch.tensor(self.norm.mean).view(-1, 1, 1)
        std = torch.tensor(self.norm.std).view(-1, 1, 1)
        return (image.float() / self.norm.max_value - mean) / std, self.labels[index]


def validate_images(source: str, images: torch.Tensor, labels: torch.Tensor, num_classes: int,
                    shape: tuple[int, int, int] | None = None) -> None:
    """Shape, dtype and label range of a loaded dataset, with one line naming where it came from."""
    if images.dtype != torch.uint8:
        raise UsageError(f"{source}: images are {images.dtype}, expected uint8")
    if images.ndim != 4 or (shape is not None and tuple(images.shape[1:]) != shape):
        expected = f"(N, {', '.join(map(str, shape))})" if shape else "(N, C, H, W)"
        raise UsageError(f"{source}: images have shape {tuple(images.shape)}, expected {expected}")
    if labels.ndim != 1 or len(labels) != len(images):
        raise UsageError(f"{source}: {len(labels)} labels for {len(images)} images")
    if len(labels) == 0:
        raise UsageError(f"{source}: no samples")
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= num_classes:
        raise UsageError(f"{source}: labels range over {low}..{high}, expected 0..{num_classes - 1}")
