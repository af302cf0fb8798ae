"""Datasets held in memory as integer images: uint8 (N, C, H, W) tensors plus int64 labels."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpcdl.runtime.errors import UsageError


@dataclass
class ImageTensors:
    """One split: images (N, C, H, W) of an integer dtype and labels (N,)."""

    images: torch.Tensor
    labels: torch.Tensor

    def __post_init__(self) -> None:
        self.labels = self.labels.long()

    def __len__(self) -> int:
        return len(self.labels)


@dataclass
class TensorSplits:
    """A dataset small enough for memory: its training and test splits."""

    train: ImageTensors
    test: ImageTensors
    num_classes: int


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
