"""MNIST from IDX files in each accepted layout, and one clear line for each way the files can be wrong."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hpcdl.data import DataSpec, TensorSplits, build_pipeline, read_dataset
from hpcdl.runtime.errors import UsageError
from tests.support.data_files import idx_bytes, write_mnist


@pytest.mark.parametrize("layout", ["plain", "dotted", "gz", "torchvision"])
def test_mnist_reads_every_layout(tmp_path: Path, layout: str) -> None:
    write_mnist(tmp_path, train=12, test=6, layout=layout, seed=3)
    data = read_dataset("mnist", str(tmp_path))
    assert isinstance(data, TensorSplits)
    assert (len(data.train), len(data.test), data.num_classes) == (12, 6, 10)
    # the pixels are exactly those written (independent of torchvision: regenerate with the same seed)
    rng = np.random.default_rng(3)
    expected = torch.from_numpy(rng.integers(0, 256, (12, 28, 28), dtype=np.uint8))
    assert torch.equal(data.train.images[:, 0], expected)
    assert data.train.labels.tolist() == [i % 10 for i in range(12)]
    # and the pipeline normalises them with MNIST's published mean and std, computed here by hand
    pipeline = build_pipeline(DataSpec("mnist", str(tmp_path), 4, 6, 0, 0), 0, 1, torch.device("cpu"))
    (images, labels), = list(pipeline.test_batches())
    written_test = torch.from_numpy(rng.integers(0, 256, (6, 28, 28), dtype=np.uint8))
    assert images.shape == (6, 1, 28, 28) and images.dtype == torch.float32 and labels.tolist() == list(range(6))
    assert torch.allclose(images[:, 0], (written_test.float() / 255 - 0.1307) / 0.3081, atol=1e-5)


def test_mnist_missing_file_names_it(tmp_path: Path) -> None:
    write_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(UsageError, match="MNIST file t10k-labels-idx1-ubyte not found"):
        read_dataset("mnist", str(tmp_path))


def corrupt(tmp_path: Path, name: str, data: bytes) -> None:
    write_mnist(tmp_path)
    (tmp_path / name).write_bytes(data)


@pytest.mark.parametrize("name,data,message", [
    ("train-images-idx3-ubyte", idx_bytes(np.zeros(5, np.uint8), 2049), "magic number 0x00000801, expected 0x00000803"),
    ("train-labels-idx1-ubyte", idx_bytes(np.zeros((12, 28, 28), np.uint8), 2051), "magic number 0x00000803"),
    ("train-images-idx3-ubyte", idx_bytes(np.zeros((12, 28, 28), np.uint8), 2051)[:-100], "header announces 12 images"),
    ("train-images-idx3-ubyte", idx_bytes(np.zeros((12, 32, 32), np.uint8), 2051), "images are 32x32"),
    ("train-images-idx3-ubyte", b"\x00\x00", "too short for an IDX image header"),
    ("t10k-labels-idx1-ubyte", idx_bytes(np.full(6, 10, np.uint8), 2049), "label 10 out of range 0..9"),
    ("t10k-labels-idx1-ubyte", idx_bytes(np.zeros(5, np.uint8), 2049), "6 images but 5 labels"),
])
def test_mnist_malformed_files_are_one_line_naming_the_file(tmp_path: Path, name: str, data: bytes,
                                                            message: str) -> None:
    corrupt(tmp_path, name, data)
    with pytest.raises(UsageError, match=message) as error:
        read_dataset("mnist", str(tmp_path))
    assert "\n" not in str(error.value) and "MNIST file" in str(error.value)
    assert str(tmp_path) in str(error.value)


def test_mnist_corrupt_gzip_is_one_line(tmp_path: Path) -> None:
    write_mnist(tmp_path, layout="gz")
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(b"\x1f\x8b\x08\x00garbage")
    with pytest.raises(UsageError, match="train-images-idx3-ubyte.gz is unreadable"):
        read_dataset("mnist", str(tmp_path))
