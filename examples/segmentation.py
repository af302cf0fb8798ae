"""Segmentation on generated images, a task that is not classification: which pixels belong to a rectangle.

    mpirun -np 2 .venv/bin/python -m hpcdl.train --task examples.segmentation:task --kfac --output-dir runs/segmentation

Each 1x16x16 image holds a bright rectangle in noise; the target is its mask. The model is a small
fully convolutional network with two output channels per pixel; the loss is the per-pixel
cross-entropy, and the metrics are the foreground's intersection over union (which decides the best
evaluation, higher is better) and the share of pixels classified right. Every image is drawn from a
generator seeded with its index, so an item is the same in any worker, on any rank, in any run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset

from hpcdl.training.task import Task

SIZE = 16


class Rectangles(Dataset):
    """``count`` images with one rectangle each; ``offset`` separates the evaluation images from the training ones."""

    def __init__(self, count: int, offset: int = 0) -> None:
        self.count, self.offset = count, offset

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        generator = torch.Generator().manual_seed(self.offset + index)
        top, left = torch.randint(0, SIZE - 4, (2,), generator=generator).tolist()
        height, width = torch.randint(3, SIZE // 2, (2,), generator=generator).tolist()
        mask = torch.zeros(SIZE, SIZE, dtype=torch.int64)
        mask[top:top + height, left:left + width] = 1
        image = mask.float().unsqueeze(0) + 0.5 * torch.randn(1, SIZE, SIZE, generator=generator)
        return image, mask


def pixel_loss(logits: Tensor, masks: Tensor) -> Tensor:
    return F.cross_entropy(logits, masks)


def iou(logits: Tensor, masks: Tensor) -> Tensor:
    """Mean over images of the foreground's intersection over union (1 where both are empty)."""
    predicted, truth = logits.argmax(1) == 1, masks == 1
    intersection = (predicted & truth).flatten(1).sum(1).float()
    union = (predicted | truth).flatten(1).sum(1).float()
    return torch.where(union > 0, intersection / union.clamp(min=1), torch.ones_like(union)).mean()


def pixel_accuracy(logits: Tensor, masks: Tensor) -> Tensor:
    return (logits.argmax(1) == masks).float().mean()


def task() -> Task:
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 2, 1),
    )
    return Task(model=model, train_data=Rectangles(512), eval_data=Rectangles(128, offset=10_000),
                loss=pixel_loss, metrics={"iou": iou, "pixel_accuracy": pixel_accuracy}, best="iou", goal="max")
