"""scikit-learn's 8x8 handwritten digits (1,797 real images, shipped inside the package).

The split arrays are kept in a small cache file after the first load: importing scikit-learn costs
about a second, which every later process (each rank of each run) would otherwise pay before its
first step. The file is named after scikit-learn's version and the split's settings, so it always
holds what scikit-learn itself returns; where it cannot be written (a read-only home in a container),
each load simply asks scikit-learn again.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import torch

from hpcdl.data.in_memory import ImageTensors, TensorSplits, validate_images

ARRAYS = ("x_train", "x_test", "y_train", "y_test")


def cache_file(test_fraction: float, seed: int) -> Path | None:
    """Where this split is cached; None when scikit-learn is not installed (its import then says so)."""
    try:
        version = importlib.metadata.version("scikit-learn")
    except importlib.metadata.PackageNotFoundError:
        return None
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpcdl" / "digits"
    return root / f"digits-sklearn{version}-test{test_fraction!r}-seed{seed}.npz"


def split_from_sklearn(test_fraction: float, seed: int) -> dict[str, np.ndarray]:
    """scikit-learn's digits, split by its stratified ``train_test_split``: the reference the cache holds."""
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    digits = sklearn_digits()
    parts = train_test_split(digits.images.astype(np.uint8), digits.target, test_size=test_fraction,
                             random_state=seed, stratify=digits.target)
    return dict(zip(ARRAYS, parts, strict=True))


def read_cache(path: Path) -> dict[str, np.ndarray] | None:
    """The cached arrays, or None when the file is missing or not a complete cache (then it is rebuilt)."""
    try:
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in ARRAYS}
    except (OSError, EOFError, KeyError, ValueError, zipfile.BadZipFile):
        return None


def write_cache(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Best effort and atomic: ranks that load at once each write a whole file and rename it into place."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temp = tempfile.mkstemp(dir=path.parent, suffix=".npz.part")
        try:
            with os.fdopen(handle, "wb") as sink:
                np.savez(sink, **arrays)  # type: ignore[arg-type]  # numpy's stub reads a name as allow_pickle
            os.replace(temp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> TensorSplits:
    """The digits with a stratified held-out test split; pixels are the set's integers 0..16, kept as uint8."""
    path = cache_file(test_fraction, seed)
    arrays = read_cache(path) if path is not None else None
    if arrays is None:
        arrays = split_from_sklearn(test_fraction, seed)
        if path is not None:
            write_cache(path, arrays)

    def as_dataset(x: np.ndarray, y: np.ndarray) -> ImageTensors:
        images, labels = torch.from_numpy(x).unsqueeze(1), torch.from_numpy(y).long()
        validate_images("scikit-learn digits", images, labels, 10, (1, 8, 8))
        return ImageTensors(images, labels)

    return TensorSplits(as_dataset(arrays["x_train"], arrays["y_train"]),
                        as_dataset(arrays["x_test"], arrays["y_test"]), 10)
