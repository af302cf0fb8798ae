"""Models that stand for a user's ``--model package.module:function``."""

from __future__ import annotations

import torch
from torch import nn


class ViewCNN(nn.Module):
    """A convolution then ``.view`` of its 2-D feature map: the classic LeNet idiom, which an NHWC activation
    cannot take (``.view`` needs the NCHW strides; ``.reshape`` or ``flatten`` would copy)."""

    def __init__(self, in_channels: int, num_classes: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = torch.relu(self.conv(x))
        return self.fc(features.view(features.shape[0], -1))


def view_cnn(num_classes: int, in_channels: int) -> nn.Module:
    return ViewCNN(in_channels, num_classes)


class ReshapeCNN(ViewCNN):
    """The same model with ``.reshape``, which takes either layout."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = torch.relu(self.conv(x))
        return self.fc(features.reshape(features.shape[0], -1))


def reshape_cnn(num_classes: int, in_channels: int) -> nn.Module:
    return ReshapeCNN(in_channels, num_classes)
