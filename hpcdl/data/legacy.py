"""The per-sample DataLoader path (float32 images built on the host) that hpcdl.train used before
:func:`hpcdl.data.build_pipeline`; kept while callers move over."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from hpcdl.data.order import check_enough, test_order
from hpcdl.data.spec import DATASETS
from hpcdl.data.tensors import DataBundle
from hpcdl.runtime.errors import UsageError


class ShardSampler(Sampler[int]):
    """Indices rank, rank+size, ... of a dataset: disjoint shards covering it exactly once."""

    def __init__(self, length: int, rank: int, size: int) -> None:
        self.indices = test_order(length, rank, size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class ResumableSampler(DistributedSampler):
    """A DistributedSampler that can start an epoch part-way, for resuming a mid-epoch checkpoint."""

    skip = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.skip :])

    def __len__(self) -> int:
        return super().__len__() - self.skip


class SyntheticImages(Dataset):
    """Random images of a fixed shape for throughput benchmarks, cycling through a small pool."""

    def __init__(self, length: int, shape: Sequence[int], num_classes: int, seed: int, pool: int = 256) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.length = length
        self.images = torch.randn(min(pool, length), *shape, generator=generator)
        self.labels = torch.randint(0, num_classes, (length,), generator=generator)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index % len(self.images)], self.labels[index]


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
        from hpcdl.data.digits import load_digits

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
    path = check_data_dir(name, data_dir)
    from hpcdl.data.shards import is_shard_folder

    if is_shard_folder(path):
        raise UsageError(f"--data-dir {data_dir} holds packed shards, which only build_pipeline reads")
    if name == "mnist":
        from hpcdl.data.mnist import load_mnist

        return load_mnist(path)
    if name == "cifar10":
        from hpcdl.data.cifar import load_cifar10

        return load_cifar10(path)
    from hpcdl.data.imagenet import load_imagenet

    return load_imagenet(path)


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
    """Per-rank training and test loaders (``drop_last`` keeps every rank at the same number of steps)."""
    check_enough(len(data.train), size, batch_size)  # type: ignore[arg-type]
    sampler = ResumableSampler(data.train, num_replicas=size, rank=rank, shuffle=True, seed=seed, drop_last=True)
    common: dict = dict(num_workers=workers, pin_memory=pin_memory, persistent_workers=workers > 0)
    if workers > 0:
        common["prefetch_factor"] = 4
    train_loader = DataLoader(data.train, batch_size=batch_size, sampler=sampler, drop_last=True, **common)
    test_sampler = ShardSampler(len(data.test), rank, size)  # type: ignore[arg-type]
    test_loader = DataLoader(data.test, batch_size=test_batch_size, sampler=test_sampler, **common)
    return train_loader, sampler, test_loader
