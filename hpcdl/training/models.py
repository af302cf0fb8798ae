"""Models by name: the CIFAR ResNets of He et al. (2016), small CNNs and a small ResNet for digits and MNIST, and
torchvision's.

The CIFAR ResNets (resnet20/32/44/56/110, depth 6n+2) use the paper's option A shortcut: when
the shape changes, the identity is subsampled and zero-padded, so shortcuts add no parameters
(resnet20 has 0.27 M of them, as in the paper).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hpcdl.runtime.errors import UsageError

CIFAR_RESNETS = {"resnet20": 3, "resnet32": 5, "resnet44": 7, "resnet56": 9, "resnet110": 18}


class DigitsCNN(nn.Module):
    """Two convolutions and a classifier for 8x8 single-channel digits.

    No batch normalisation: every layer is a function of one example, so a data-parallel run is
    exactly the single-process run on the same global batch (the property the tests check).
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(2 * width * 16, 128), nn.ReLU(inplace=True), nn.Linear(128, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        if x.shape[-1] != 4:  # other image sizes: pool to the 4x4 grid the classifier expects
            x = F.adaptive_avg_pool2d(x, 4)
        return self.classifier(x)


class MnistCNN(nn.Module):
    """Two 5x5 convolutions with max pooling and two linear layers, for 28x28 single-channel images.

    The shape of Horovod's MNIST example (28 -> 24 -> 12 -> 8 -> 4), wider. The widths keep the
    K-FAC factors small (A of the first linear layer is 1+16·width2, 513 by default), because on a
    CPU their eigendecompositions, not the model, set the cost of a K-FAC step
    (benchmarks/kfac_convergence.py, docs/kfac.md "When K-FAC pays off"). No batch normalisation,
    so a data-parallel run equals the single-process run on the global batch.
    """

    def __init__(
        self, in_channels: int = 1, num_classes: int = 10, widths: tuple[int, int, int] = (16, 32, 128)
    ) -> None:
        super().__init__()
        conv1, conv2, hidden = widths
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, conv1, 5),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(conv1, conv2, 5),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(conv2 * 16, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        if x.shape[-1] != 4:  # other image sizes: pool to the 4x4 grid the classifier expects
            x = F.adaptive_max_pool2d(x, 4)
        return self.classifier(x)


class ShortcutA(nn.Module):
    """Parameter-free shortcut: subsample by the stride and zero-pad the new channels."""

    def __init__(self, out_channels: int, stride: int) -> None:
        super().__init__()
        self.out_channels, self.stride = out_channels, stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, :, :: self.stride, :: self.stride]
        extra = self.out_channels - x.shape[1]
        return F.pad(x, (0, 0, 0, 0, extra // 2, extra - extra // 2))


class BasicBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        changes_shape = stride != 1 or in_channels != out_channels
        self.shortcut = ShortcutA(out_channels, stride) if changes_shape else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """ResNet for 32x32 inputs: 3 stages of n basic blocks with 16, 32, 64 channels."""

    def __init__(self, blocks_per_stage: int, in_channels: int = 3, num_classes: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, 16, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        layers, channels = [], 16
        for stage, width in enumerate((16, 32, 64)):
            for block in range(blocks_per_stage):
                stride = 2 if stage > 0 and block == 0 else 1
                layers.append(BasicBlock(channels, width, stride))
                channels = width
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(64, num_classes)
        for module in self.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(module.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(F.relu(self.bn(self.conv(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class MnistResNet(nn.Module):
    """A small CIFAR-style ResNet for 28x28 single-channel images: batch normalisation and residual connections.

    A 3x3 stem (16 channels) and a 2x2 max pool to 14x14, then one basic block per stage with 16, 32 and 64
    channels at 14, 7 and 4 pixels (option A shortcuts, as :class:`CifarResNet`), average pool and a classifier:
    75 k parameters and about 2.6 M multiply-adds an image (2.3x ``mnist_cnn``'s; 2.6x its CPU time), so that the
    large-batch study (benchmarks/kfac_large_batch.py) can run it on a CPU. Batch normalisation makes a
    data-parallel step differ from one process's step on the global batch (statistics per rank's batch).
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(2))
        self.layers = nn.Sequential(BasicBlock(16, 16, 1), BasicBlock(16, 32, 2), BasicBlock(32, 64, 2))
        self.fc = nn.Linear(64, num_classes)
        for module in self.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(module.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class RepeatChannels(nn.Module):
    """Feed single-channel images to a model built for RGB."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.expand(-1, 3, -1, -1)


def build_model(name: str, num_classes: int, in_channels: int) -> nn.Module:
    """A freshly initialised model by name, with ``num_classes`` outputs; ``package.module:function`` calls
    ``function(num_classes, in_channels)`` for your own model (--model)."""
    if ":" in name:
        return custom_model(name, num_classes, in_channels)
    if name == "digits_cnn":
        return DigitsCNN(in_channels, num_classes)
    if name == "mnist_cnn":
        return MnistCNN(in_channels, num_classes)
    if name == "mnist_resnet":
        return MnistResNet(in_channels, num_classes)
    if name in CIFAR_RESNETS:
        return CifarResNet(CIFAR_RESNETS[name], in_channels, num_classes)
    import torchvision

    if name not in torchvision.models.list_models(module=torchvision.models):
        known = ", ".join(["digits_cnn", "mnist_cnn", "mnist_resnet", *CIFAR_RESNETS])
        raise UsageError(
            f"unknown model {name!r}; choose {known}, or a torchvision classification model (resnet18, resnet50, ...)"
        )
    model = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    return nn.Sequential(RepeatChannels(), model) if in_channels == 1 else model


def custom_model(spec: str, num_classes: int, in_channels: int) -> nn.Module:
    """``--model package.module:function``: the user's model for a built-in dataset, or one line saying why not."""
    from hpcdl.training.task import call_user, import_function

    model = call_user(import_function(spec, "--model"), f"--model {spec}", num_classes, in_channels)
    if not isinstance(model, nn.Module):
        raise UsageError(f"--model {spec} returned a {type(model).__name__}, not a torch.nn.Module")
    return model
