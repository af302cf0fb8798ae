"""scikit-learn's 8x8 handwritten digits (1,797 real images, shipped inside the package)."""

from __future__ import annotations

import numpy as np
import torch

from hpcdl.data.in_memory import ImageTensors, TensorSplits, validate_images


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> TensorSplits:
    """The digits with a stratified held-out test split; pixels are the set's integers 0..16, kept as uint8."""
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    digits = sklearn_digits()
    images = digits.images.astype(np.uint8)
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target, test_size=test_fraction, random_state=seed, stratify=digits.target
    )

    def as_dataset(x: np.ndarray, y: np.ndarray) -> ImageTensors:
        images, labels = torch.from_numpy(x).unsqueeze(1), torch.from_numpy(y).long()
        validate_images("scikit-learn digits", images, labels, 10, (1, 8, 8))
        return ImageTensors(images, labels)

    return TensorSplits(as_dataset(x_train, y_train), as_dataset(x_test, y_test), 10)
