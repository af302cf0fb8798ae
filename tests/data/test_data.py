"""Dataset loaders on files in the real layouts, sharding exactness, and their error messages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpcdl.data import ShardSampler, load_dataset, make_loaders
from hpcdl.runtime.errors import UsageError
from tests.support.data_files import write_cifar10, write_imagenet
from tests.support.mpi_harness import run_train

pytestmark = pytest.mark.processes  # starts processes: not in the fast tier



def test_digits_is_the_real_embedded_set_with_a_held_out_split() -> None:
    data = load_dataset("digits", None, seed=0)
    assert len(data.train) + len(data.test) == 1797
    assert len(data.test) == 360
    image, label = data.train[0]
    assert image.shape == (1, 8, 8) and image.min() >= -1 and image.max() <= 1 and 0 <= int(label) < 10


def test_cifar10_reads_the_pickle_batches(tmp_path: Path) -> None:
    folder = write_cifar10(tmp_path, per_batch=8)
    for data_dir in (folder, tmp_path):  # the folder itself (course style) or its parent
        data = load_dataset("cifar10", str(data_dir), seed=0)
        assert (len(data.train), len(data.test), data.num_classes) == (40, 8, 10)
        image, label = data.train[3]
        assert image.shape == (3, 32, 32) and image.dtype == torch.float32


def test_cifar10_missing_and_corrupt_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no cifar-10-batches-py folder"):
        load_dataset("cifar10", str(tmp_path), seed=0)
    folder = write_cifar10(tmp_path, per_batch=4)
    (folder / "data_batch_3").write_bytes(b"\x80\x04not a pickle")
    with pytest.raises(UsageError, match="data_batch_3 is unreadable"):
        load_dataset("cifar10", str(tmp_path), seed=0)
    (folder / "data_batch_3").unlink()
    with pytest.raises(UsageError, match="data_batch_3 is missing"):
        load_dataset("cifar10", str(tmp_path), seed=0)


def test_imagenet_reads_class_folders_with_crops(tmp_path: Path) -> None:
    write_imagenet(tmp_path, classes=3, per_class=2)
    data = load_dataset("imagenet", str(tmp_path), seed=0)
    assert (len(data.train), len(data.test), data.num_classes) == (6, 6, 3)
    assert data.train[0][0].shape == (3, 224, 224) and data.test[5][0].shape == (3, 224, 224)
    assert data.test[5][1] == 2


def test_imagenet_without_val_is_a_clear_error(tmp_path: Path) -> None:
    write_imagenet(tmp_path, classes=2, per_class=1)
    for path in (tmp_path / "val").rglob("*"):
        if path.is_file():
            path.unlink()
    with pytest.raises(UsageError, match="val"):
        load_dataset("imagenet", str(tmp_path), seed=0)


def test_missing_data_dir_and_unknown_dataset(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        load_dataset("cifar10", str(tmp_path / "nope"), seed=0)
    with pytest.raises(UsageError, match="needs --data-dir"):
        load_dataset("imagenet", None, seed=0)


def test_shards_cover_the_test_set_exactly_once_even_when_uneven() -> None:
    for length, size in [(10, 4), (3, 4), (360, 7)]:
        seen = sorted(i for rank in range(size) for i in ShardSampler(length, rank, size))
        assert seen == list(range(length))


def test_training_shards_are_disjoint_and_equal_in_steps() -> None:
    data = load_dataset("synthetic", None, seed=0, synthetic_size=103)
    batches = []
    for rank in range(3):
        loader, sampler, _ = make_loaders(data, rank, 3, 8, 16, 0, seed=1, pin_memory=False)
        sampler.set_epoch(0)
        batches.append([i for i in sampler])
    assert len({len(b) for b in batches}) == 1
    flat = [i for b in batches for i in b]
    assert len(flat) == len(set(flat))


def test_more_ranks_than_samples_is_a_clear_error() -> None:
    data = load_dataset("synthetic", None, seed=0, synthetic_size=3)
    with pytest.raises(UsageError, match="cannot give 4 ranks a batch"):
        make_loaders(data, 0, 4, 1, 1, 0, seed=0, pin_memory=False)


def test_resnet18_trains_a_step_on_cifar_files(tmp_path: Path) -> None:
    write_cifar10(tmp_path / "data", per_batch=8)
    result = run_train(1, tmp_path / "run", "--dataset", "cifar10", "--data-dir", str(tmp_path / "data"),
                       "--model", "resnet18", "--batch-size", "4", "--max-steps", "2", "--epochs", "1",
                       "--workers", "1", "--warmup-epochs", "0", timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "run" / "summary.json").exists()


def test_corrupt_image_names_its_file(tmp_path: Path) -> None:
    write_imagenet(tmp_path, classes=2, per_class=1)
    bad = next((tmp_path / "train").rglob("*.JPEG"))
    bad.write_bytes(b"not a jpeg")
    data = load_dataset("imagenet", str(tmp_path), seed=0)
    with pytest.raises(OSError, match=f"cannot decode image {bad}"):
        [data.train[i] for i in range(len(data.train))]


def test_data_dir_that_is_a_file(tmp_path: Path) -> None:
    archive = tmp_path / "cifar-10-python.tar.gz"
    archive.write_bytes(b"\x1f\x8b")
    with pytest.raises(UsageError, match="is a file, not a folder"):
        load_dataset("cifar10", str(archive), seed=0)
