"""The datasets hpcdl knows, by name: the one place a name becomes a reader, a normalisation and an
augmentation. Training (:mod:`hpcdl.data.from_spec`), packing (``hpcdl.pack``) and the benchmarks all ask here.

Each dataset has one reader per format it comes in (its standard layout, or packed shards), one
augmentation (none; CIFAR's padded random crop and flip, :func:`hpcdl.data.augment.pad_crop_flip`;
ImageNet's random resized crop and flip, :func:`hpcdl.data.augment.train_view`) and one
normalisation (:class:`hpcdl.data.augment.Normalizer` with the constants below), applied on the
device so images travel as uint8.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from hpcdl.data.images import ByteSource
from hpcdl.data.in_memory import TensorSplits
from hpcdl.data.spec import Normalization
from hpcdl.runtime.errors import UsageError

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
MNIST_MEAN, MNIST_STD = (0.1307,), (0.3081,)


@dataclass(frozen=True)
class DatasetEntry:
    """How one dataset is stored, normalised and augmented."""

    kind: Literal["tensors", "files", "generated"]  # in memory / encoded files read per batch / drawn on the device
    norm: Normalization
    crop_padding: int = 0  # "tensors": RandomCrop(H, padding) + flip on the device when > 0
    shape: tuple[int, int, int] | None = None  # "tensors": (C, H, W) of every image
    needs_data_dir: bool = True


REGISTRY: dict[str, DatasetEntry] = {
    "digits": DatasetEntry("tensors", Normalization((0.5,), (0.5,), max_value=16.0), shape=(1, 8, 8),
                           needs_data_dir=False),  # sklearn's digits are integers 0..16
    "mnist": DatasetEntry("tensors", Normalization(MNIST_MEAN, MNIST_STD), shape=(1, 28, 28)),
    "cifar10": DatasetEntry("tensors", Normalization(CIFAR_MEAN, CIFAR_STD), crop_padding=4, shape=(3, 32, 32)),
    "imagenet": DatasetEntry("files", Normalization(IMAGENET_MEAN, IMAGENET_STD)),
    "synthetic": DatasetEntry("generated", Normalization((0.0,), (1.0,), max_value=1.0),  # already N(0, 1)
                              needs_data_dir=False),
}
DATASETS = tuple(REGISTRY)
PACKABLE = tuple(name for name, entry in REGISTRY.items() if entry.needs_data_dir)


@dataclass
class FileSplits:
    """A dataset of encoded images: class names and random access to each split's bytes."""

    classes: list[str]
    train: ByteSource
    test: ByteSource


def entry(name: str) -> DatasetEntry:
    if name not in REGISTRY:
        raise UsageError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    return REGISTRY[name]


def check_data_dir(name: str, data_dir: str | None) -> Path:
    """The --data-dir of a dataset read from disk: given, existing, a readable folder."""
    if not data_dir:
        raise UsageError(f"--dataset {name} needs --data-dir")
    path = Path(data_dir).expanduser()
    if not path.exists():
        raise UsageError(f"--data-dir {data_dir} does not exist")
    if not path.is_dir():
        raise UsageError(f"--data-dir {data_dir} is a file, not a folder (extract the dataset archive first)")
    if not os.access(path, os.R_OK | os.X_OK):
        raise UsageError(f"--data-dir {data_dir} is not readable")
    return path


def read_layout(name: str, path: Path) -> TensorSplits | FileSplits:
    """A dataset in its standard on-disk layout (digits: the copy inside scikit-learn)."""
    if name == "digits":
        from hpcdl.data.digits import load_digits

        return load_digits(seed=0)  # a fixed split: every run is evaluated on the same images
    if name == "mnist":
        from hpcdl.data.mnist import load_mnist

        return load_mnist(path)
    if name == "cifar10":
        from hpcdl.data.cifar import load_cifar10

        return load_cifar10(path)
    if name == "imagenet":
        from hpcdl.data.imagenet import list_imagenet

        return FileSplits(*list_imagenet(path))
    raise UsageError(f"dataset {name} is not read from files")


def read_shards(name: str, path: Path) -> TensorSplits | FileSplits:
    """A shard folder written by ``hpcdl.pack``: encoded images stay files; small sets are decoded into memory."""
    from hpcdl.data.shards import ShardSource, read_index

    index = read_index(path)
    if index.dataset != name:
        raise UsageError(f"--data-dir {path} holds {index.dataset} shards, not {name}")
    train, test = ShardSource(index.splits["train"]), ShardSource(index.splits["val"])
    info = entry(name)
    if info.kind == "files":
        return FileSplits(index.classes, train, test)
    from hpcdl.data.unpack import decode_all

    assert info.shape is not None
    return TensorSplits(decode_all(name, train, info.shape, len(index.classes)),
                        decode_all(name, test, info.shape, len(index.classes)), len(index.classes))


def read_dataset(name: str, data_dir: str | None) -> TensorSplits | FileSplits:
    """Dataset ``name`` from ``data_dir`` (standard layout or shards), checked; UsageError names what is wrong."""
    info = entry(name)
    if info.kind == "generated":
        raise UsageError(f"dataset {name} is generated, not read")
    if not info.needs_data_dir:
        return read_layout(name, Path("."))
    from hpcdl.data.shards import is_shard_folder

    path = check_data_dir(name, data_dir)
    return read_shards(name, path) if is_shard_folder(path) else read_layout(name, path)


def synthetic_tensors(shape: tuple[int, int, int], length: int, classes: int, seed: int,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random N(0, 1) images drawn on the device: a pool of at most 256 that ``length`` samples cycle through."""
    generator = torch.Generator(device=device).manual_seed(seed)
    images = torch.randn(min(256, length), *shape, generator=generator, device=device)
    labels = torch.randint(0, classes, (length,), generator=generator, device=device)
    return images, labels
