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
