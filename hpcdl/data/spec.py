"""What the training loop asks of the data side: a :class:`DataSpec`, and the form of a normalisation."""

from __future__ import annotations

from dataclasses import dataclass

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
