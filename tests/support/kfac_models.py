"""Small models whose K-FAC factors are hard cases, shared by the K-FAC tests."""

from __future__ import annotations

import torch
from torch import nn


class DeepNarrow(nn.Module):
    """A stride-2 3x3 conv over a 2x2 image, as in ResNet-50's layer4 on 32x32 inputs: on a batch of 2
    its A factor (288 x 288) has rank 2, mostly zero rows, and float32 eigh fails to converge on it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(32, 8, 3, stride=2, padding=1, bias=False)
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(torch.relu(x))).flatten(1))
