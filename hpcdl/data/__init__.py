"""Datasets and their per-rank loaders.

Every dataset comes as a (train, test) pair plus its shape. Training is sharded by a
DistributedSampler (reshuffled each epoch with ``set_epoch``); evaluation by :class:`ShardSampler`,
which splits the test set into disjoint, possibly uneven, shards, so that sums and counts
allreduced over ranks give exactly the single-process metrics.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset

from hpcdl.errors import UsageError

DATASETS = ("digits", "mnist", "cifar10", "imagenet", "synthetic")
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@dataclass
class DataBundle:
    train: Dataset
    test: Dataset
    num_classes: int
    channels: int
    image_size: int


class ShardSampler(Sampler[int]):
    """Indices rank, rank+size, ... of a dataset: disjoint shards covering it exactly once."""

    def __init__(self, length: int, rank: int, size: int) -> None:
        self.indices = range(rank, length, size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class ResumableSampler(DistributedSampler):
    """A DistributedSampler that can start an epoch part-way, for resuming a mid-epoch checkpoint.

    The epoch's order depends only on (seed, epoch), so skipping the batches already trained
    reproduces exactly the rest of the interrupted epoch.
    """

    skip = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.skip :])

    def __len__(self) -> int:
        return super().__len__() - self.skip


class SyntheticImages(Dataset):
    """Random images of a fixed shape for throughput benchmarks (no I/O, no decoding).

    Items cycle through a small pool generated once, so memory stays bounded whatever the length.
    """

    def __init__(self, length: int, shape: Sequence[int], num_classes: int, seed: int, pool: int = 256) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.length = length
        self.images = torch.randn(min(pool, length), *shape, generator=generator)
        self.labels = torch.randint(0, num_classes, (length,), generator=generator)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index % len(self.images)], self.labels[index]


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> DataBundle:
    """scikit-learn's 8x8 handwritten digits (1,797 real images) with a stratified held-out test split."""
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    digits = sklearn_digits()
    images = (digits.images.astype(np.float32) / 16.0 - 0.5) / 0.5  # pixel values 0..16 -> [-1, 1]
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target, test_size=test_fraction, random_state=seed, stratify=digits.target
    )

    def as_dataset(x: np.ndarray, y: np.ndarray) -> TensorDataset:
        return TensorDataset(torch.from_numpy(x).unsqueeze(1), torch.from_numpy(y).long())

    return DataBundle(as_dataset(x_train, y_train), as_dataset(x_test, y_test), 10, 1, 8)


def _cifar_root(data_dir: Path) -> Path:
    """Accept either the cifar-10-batches-py folder itself (as the course passes it) or its parent."""
    if data_dir.name == "cifar-10-batches-py":
        return data_dir.parent
    return data_dir


def check_cifar10(data_dir: Path) -> None:
    """A clear error for a missing or malformed cifar-10-batches-py folder, before any loader starts."""
    folder = _cifar_root(data_dir) / "cifar-10-batches-py"
    if not folder.is_dir():
        raise UsageError(f"--data-dir {data_dir}: no cifar-10-batches-py folder (extract cifar-10-python.tar.gz there)")
    if not (folder / "batches.meta").is_file():
        raise UsageError(f"CIFAR-10 file {folder / 'batches.meta'} is missing")
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        path = folder / name
        if not path.is_file():
            raise UsageError(f"CIFAR-10 file {path} is missing")
        try:
            with open(path, "rb") as handle:
                entry = pickle.load(handle, encoding="latin1")
            data, labels = entry["data"], entry.get("labels", entry.get("fine_labels"))
            assert data.ndim == 2 and data.shape[1] == 3072 and len(labels) == data.shape[0]
        except Exception as exc:  # noqa: BLE001 - any decoding problem means the same thing
            raise UsageError(f"CIFAR-10 file {path} is unreadable or malformed ({type(exc).__name__})") from exc


def load_cifar10(data_dir: Path) -> DataBundle:
    """CIFAR-10 from the standard python pickle batches, through torchvision (download off)."""
    import torchvision
    from torchvision import transforms

    check_cifar10(data_dir)
    normalize = transforms.Normalize(CIFAR_MEAN, CIFAR_STD)
    train_tf = transforms.Compose(
        [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize]
    )
    test_tf = transforms.Compose([transforms.ToTensor(), normalize])

    base = torchvision.datasets.CIFAR10

    class CIFAR10Files(base):
        # Same files and reader as torchvision's, without the official MD5 sums (an MD5 of None
        # means "the file exists"): check_cifar10 validated the structure instead, so subsets
        # and test fixtures in the same layout load too.
        train_list = [[name, None] for name, _ in base.train_list]
        test_list = [[name, None] for name, _ in base.test_list]
        meta = {**base.meta, "md5": None}

    root = str(_cifar_root(data_dir))
    train = CIFAR10Files(root, train=True, transform=train_tf, download=False)
    test = CIFAR10Files(root, train=False, transform=test_tf, download=False)
    return DataBundle(train, test, 10, 3, 32)


def open_image(path: str):
    """Open an image as RGB; a corrupt file names itself (PIL's own message does not)."""
    from PIL import Image

    try:
        with open(path, "rb") as handle:
            return Image.open(handle).convert("RGB")
    except OSError as exc:
        raise OSError(f"cannot decode image {path}: {exc}") from exc


def load_imagenet(data_dir: Path, image_size: int = 224) -> DataBundle:
    """ImageNet-style class folders: DATA_DIR/train/<class>/*.JPEG and DATA_DIR/val/<class>/*.JPEG."""
    from torchvision import transforms
    from torchvision.datasets import ImageFolder

    for split in ("train", "val"):
        if not (data_dir / split).is_dir():
            raise UsageError(f"--data-dir {data_dir}: no {split}/ folder of class subfolders")
    normalize = transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    train_tf = transforms.Compose(
        [transforms.RandomResizedCrop(image_size), transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize]
    )
    resize = int(round(image_size / 0.875))
    test_tf = transforms.Compose(
        [transforms.Resize(resize), transforms.CenterCrop(image_size), transforms.ToTensor(), normalize]
    )
    try:
        train = ImageFolder(str(data_dir / "train"), transform=train_tf, loader=open_image)
        test = ImageFolder(str(data_dir / "val"), transform=test_tf, loader=open_image)
    except (FileNotFoundError, RuntimeError) as exc:
        raise UsageError(f"--data-dir {data_dir}: {exc}") from exc
    if train.classes != test.classes:
        raise UsageError(f"--data-dir {data_dir}: train/ and val/ have different class folders")
    return DataBundle(train, test, len(train.classes), 3, image_size)


def load_dataset(
    name: str,
    data_dir: str | None,
    seed: int,
    synthetic_shape: Sequence[int] = (3, 32, 32),
    synthetic_classes: int = 10,
    synthetic_size: int = 2048,
) -> DataBundle:
    """The (train, test) pair for a dataset name, or UsageError explaining what is wrong."""
    if name == "digits":
        return load_digits(seed=0)  # the split is fixed, so every run is evaluated on the same images
    if name == "synthetic":
        channels, height, width = synthetic_shape
        if height != width:
            raise UsageError("--synthetic-shape must be square: C H H")
        train = SyntheticImages(synthetic_size, synthetic_shape, synthetic_classes, seed)
        test = SyntheticImages(max(1, synthetic_size // 8), synthetic_shape, synthetic_classes, seed + 1)
        return DataBundle(train, test, synthetic_classes, channels, height)
    if name not in DATASETS:
        raise UsageError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    if not data_dir:
        raise UsageError(f"--dataset {name} needs --data-dir")
    path = Path(data_dir).expanduser()
    if not path.exists():
        raise UsageError(f"--data-dir {data_dir} does not exist")
    if not path.is_dir():
        raise UsageError(f"--data-dir {data_dir} is a file, not a folder (extract the dataset archive first)")
    if not os.access(path, os.R_OK | os.X_OK):
        raise UsageError(f"--data-dir {data_dir} is not readable")
    if name == "mnist":
        from hpcdl.data.mnist import load_mnist

        return load_mnist(path)
    return load_cifar10(path) if name == "cifar10" else load_imagenet(path)


def make_loaders(
    data: DataBundle,
    rank: int,
    size: int,
    batch_size: int,
    test_batch_size: int,
    workers: int,
    seed: int,
    pin_memory: bool,
) -> tuple[DataLoader, ResumableSampler, DataLoader]:
    """Per-rank training and test loaders.

    ``drop_last`` on the training sampler keeps every rank at the same number of steps, so no
    rank waits in an allreduce that the others never join.
    """
    train_len = len(data.train)
    if train_len < size * batch_size:
        raise UsageError(
            f"{train_len} training samples cannot give {size} ranks a batch of {batch_size} each; "
            "use fewer ranks or a smaller --batch-size"
        )
    sampler = ResumableSampler(data.train, num_replicas=size, rank=rank, shuffle=True, seed=seed, drop_last=True)
    common = dict(num_workers=workers, pin_memory=pin_memory, persistent_workers=workers > 0)
    if workers > 0:
        common["prefetch_factor"] = 4
    train_loader = DataLoader(data.train, batch_size=batch_size, sampler=sampler, drop_last=True, **common)
    test_sampler = ShardSampler(len(data.test), rank, size)
    test_loader = DataLoader(data.test, batch_size=test_batch_size, sampler=test_sampler, **common)
    return train_loader, sampler, test_loader
