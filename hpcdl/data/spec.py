"""What the training loop asks of the data side: the dataset names, a :class:`DataSpec`, and each
dataset's normalisation constants (applied on the device, so images travel as uint8)."""

from __future__ import annotations

from dataclasses import dataclass

DATASETS = ("digits", "mnist", "cifar10", "imagenet", "synthetic")
DECODERS = ("auto", "cpu", "gpu")


@dataclass(frozen=True)
class DataSpec:
    """Everything the input pipeline needs from the command line."""

    dataset: str
    data_dir: str | None
    batch_size: int  # samples per rank per optimizer step (all micro-batches together)
    test_batch_size: int
    workers: int  # loader worker processes per rank
    seed: int
    decode: str = "auto"  # "cpu" | "gpu" | "auto" (gpu when the device is CUDA and the data are JPEG files)
    channels_last: bool = False
    synthetic_shape: tuple[int, int, int] = (3, 32, 32)
    synthetic_classes: int = 10
    synthetic_size: int = 2048
    image_size: int = 224  # training crop of JPEG datasets; evaluation resizes to image_size/0.875 first


@dataclass(frozen=True)
class Normalization:
    """``(x / max_value - mean) / std`` per channel; ``max_value`` is 255 for uint8 images."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    max_value: float = 255.0


CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
MNIST_MEAN, MNIST_STD = (0.1307,), (0.3081,)

CIFAR_NORM = Normalization(CIFAR_MEAN, CIFAR_STD)
IMAGENET_NORM = Normalization(IMAGENET_MEAN, IMAGENET_STD)
MNIST_NORM = Normalization(MNIST_MEAN, MNIST_STD)
DIGITS_NORM = Normalization((0.5,), (0.5,), max_value=16.0)  # sklearn's digits are integers 0..16
IDENTITY_NORM = Normalization((0.0,), (1.0,), max_value=1.0)  # synthetic images are already N(0, 1)
