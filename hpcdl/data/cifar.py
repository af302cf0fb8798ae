"""CIFAR-10 from the python pickle batches of the official release (``cifar-10-batches-py``).

The batches are read straight into one uint8 tensor per split: 150 MB for the training set, small
enough to live on the device, where the random crop and flip run batched.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch

from hpcdl.data.in_memory import ImageTensors, TensorSplits, validate_images
from hpcdl.runtime.errors import UsageError

TRAIN_BATCHES = [f"data_batch_{i}" for i in range(1, 6)]
TEST_BATCHES = ["test_batch"]
NUM_CLASSES = 10


def cifar_folder(data_dir: Path) -> Path:
    """Accept either the cifar-10-batches-py folder itself (as the course passes it) or its parent."""
    folder = data_dir if data_dir.name == "cifar-10-batches-py" else data_dir / "cifar-10-batches-py"
    if not folder.is_dir():
        raise UsageError(f"--data-dir {data_dir}: no cifar-10-batches-py folder (extract cifar-10-python.tar.gz there)")
    if not (folder / "batches.meta").is_file():
        raise UsageError(f"CIFAR-10 file {folder / 'batches.meta'} is missing")
    return folder


def read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One pickle batch as (N, 3, 32, 32) uint8 images and (N,) labels, or a line naming the file."""
    if not path.is_file():
        raise UsageError(f"CIFAR-10 file {path} is missing")
    try:
        with open(path, "rb") as handle:
            entry = pickle.load(handle, encoding="latin1")
        data = np.asarray(entry["data"])
        labels = np.asarray(entry.get("labels", entry.get("fine_labels")), dtype=np.int64)
    except Exception as exc:  # noqa: BLE001 - any decoding problem means the same thing
        raise UsageError(f"CIFAR-10 file {path} is unreadable or malformed ({type(exc).__name__})") from exc
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        raise UsageError(f"CIFAR-10 file {path}: data is {data.dtype} {data.shape}, expected uint8 (N, 3072)")
    if labels.shape != (len(data),):
        raise UsageError(f"CIFAR-10 file {path}: {labels.size} labels for {len(data)} images")
    if len(labels) and (labels.min() < 0 or labels.max() >= NUM_CLASSES):  # checked here to name the file
        raise UsageError(f"CIFAR-10 file {path}: labels range over {labels.min()}..{labels.max()}, "
                         f"expected 0..{NUM_CLASSES - 1}")
    return data.reshape(-1, 3, 32, 32), labels


def read_split(folder: Path, names: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [read_batch(folder / name) for name in names]
    images = torch.from_numpy(np.concatenate([p[0] for p in parts]))
    labels = torch.from_numpy(np.concatenate([p[1] for p in parts]))
    validate_images(f"CIFAR-10 files {folder}/{names[0]}..", images, labels, NUM_CLASSES, (3, 32, 32))
    return images, labels


def load_cifar10(data_dir: Path) -> TensorSplits:
    """Training and test sets as uint8 tensors (augmentation runs later, batched on the device)."""
    folder = cifar_folder(data_dir)
    train_images, train_labels = read_split(folder, TRAIN_BATCHES)
    test_images, test_labels = read_split(folder, TEST_BATCHES)
    return TensorSplits(ImageTensors(train_images, train_labels), ImageTensors(test_images, test_labels), NUM_CLASSES)
