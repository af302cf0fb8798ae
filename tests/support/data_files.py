"""Small datasets written in the real on-disk layouts (CIFAR-10 python pickles, ImageNet class folders)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np


def write_cifar10(root: Path, per_batch: int = 20, seed: int = 0) -> Path:
    """``root/cifar-10-batches-py`` with data_batch_1..5, test_batch and batches.meta, as in the release."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        entry = {
            "batch_label": name,
            "labels": [int(x) for x in rng.integers(0, 10, per_batch)],
            "data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            "filenames": [f"{name}_{i}.png" for i in range(per_batch)],
        }
        with open(folder / name, "wb") as handle:
            pickle.dump(entry, handle)
    with open(folder / "batches.meta", "wb") as handle:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)], "num_cases_per_batch": per_batch}, handle)
    return folder


def write_imagenet(root: Path, classes: int = 3, per_class: int = 4, size: int = 40, seed: int = 0) -> Path:
    """``root/train/<wnid>/*.JPEG`` and ``root/val/<wnid>/*.JPEG`` with small random JPEGs."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for split in ("train", "val"):
        for c in range(classes):
            folder = root / split / f"n{c:08d}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                pixels = rng.integers(0, 256, (size, size + 7, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"img_{i}.JPEG", quality=85)
    return root


def idx_bytes(array: np.ndarray, magic: int) -> bytes:
    """An IDX file as published: big-endian magic, one big-endian uint32 per dimension, then the bytes."""
    import struct

    return struct.pack(f">{1 + array.ndim}I", magic, *array.shape) + array.astype(np.uint8).tobytes()


def write_mnist(root: Path, train: int = 12, test: int = 6, layout: str = "plain", seed: int = 0) -> Path:
    """The four MNIST IDX files under ``root`` in one of the layouts found in the wild.

    ``plain``: ``train-images-idx3-ubyte`` ...; ``dotted``: ``train-images.idx3-ubyte`` ...;
    ``gz``: the plain names gzipped; ``torchvision``: plain names under ``MNIST/raw/``.
    """
    import gzip

    rng = np.random.default_rng(seed)
    folder = root / "MNIST" / "raw" if layout == "torchvision" else root
    folder.mkdir(parents=True, exist_ok=True)
    for prefix, count in (("train", train), ("t10k", test)):
        images = rng.integers(0, 256, (count, 28, 28), dtype=np.uint8)
        labels = np.arange(count, dtype=np.uint8) % 10
        for kind, array, magic in (("images-idx3-ubyte", images, 2051), ("labels-idx1-ubyte", labels, 2049)):
            name = f"{prefix}-{kind}"
            if layout == "dotted":
                name = name.replace("-idx", ".idx")
            data = idx_bytes(array, magic)
            if layout == "gz":
                (folder / f"{name}.gz").write_bytes(gzip.compress(data))
            else:
                (folder / name).write_bytes(data)
    return folder
