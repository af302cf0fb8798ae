"""Dataset readers on files in the real layouts, the registry's choices, sharding exactness, and their
error messages."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from hpcdl.data import DataSpec, FileSplits, TensorSplits, build_pipeline, order, read_dataset
from hpcdl.data.registry import REGISTRY
from hpcdl.runtime.errors import UsageError
from tests.support.data_files import write_cifar10, write_imagenet
from tests.support.mpi_harness import run_train


def test_digits_is_the_real_embedded_set_with_a_held_out_split() -> None:
    from sklearn.datasets import load_digits

    data = read_dataset("digits", None)
    assert isinstance(data, TensorSplits)
    assert len(data.train) + len(data.test) == 1797
    assert len(data.test) == 360
    assert data.train.images.shape[1:] == (1, 8, 8) and data.train.images.dtype == torch.uint8
    # every held-out image is one of scikit-learn's own, with its own label
    images, targets = load_digits(return_X_y=True)
    reference = {(x.astype("uint8").tobytes(), int(y)) for x, y in zip(images, targets, strict=True)}
    held_out = zip(data.test.images, data.test.labels, strict=True)
    assert all((x[0].numpy().tobytes(), int(y)) in reference for x, y in held_out)


def test_digits_cache_holds_scikit_learns_split_and_spares_its_import(tmp_path: Path, monkeypatch) -> None:
    """The first load asks scikit-learn and writes the cache; a later one reads it without importing
    scikit-learn and gets the same arrays; a damaged cache file is rebuilt, an unwritable cache only skipped."""
    import sys

    from hpcdl.data import digits

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    reference = digits.split_from_sklearn(0.2, 0)
    first = digits.load_digits()
    path = digits.cache_file(0.2, 0)
    assert path is not None and path.is_file() and path.is_relative_to(tmp_path)

    def same(data: TensorSplits) -> bool:
        return (torch.equal(data.train.images[:, 0], torch.from_numpy(reference["x_train"]))
                and torch.equal(data.test.images[:, 0], torch.from_numpy(reference["x_test"]))
                and data.train.labels.tolist() == reference["y_train"].tolist()
                and data.test.labels.tolist() == reference["y_test"].tolist())

    assert same(first)
    with monkeypatch.context() as blocked:  # any import of scikit-learn now fails
        for name in [m for m in sys.modules if m == "sklearn" or m.startswith("sklearn.")]:
            blocked.delitem(sys.modules, name)
        blocked.setitem(sys.modules, "sklearn", None)
        assert same(digits.load_digits())
        with pytest.raises(ImportError):
            digits.split_from_sklearn(0.2, 0)
    path.write_bytes(path.read_bytes()[:100])  # a torn file
    assert same(digits.load_digits()) and digits.read_cache(path) is not None  # rebuilt
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file"))  # no folder can be made below a file
    (tmp_path / "a-file").write_text("")
    assert same(digits.load_digits()) and digits.cache_file(0.2, 0).parent.parent.parent.is_file()
    assert digits.cache_file(0.2, 1) != path != digits.cache_file(0.25, 0)


def test_cifar10_reads_the_pickle_batches(tmp_path: Path) -> None:
    folder = write_cifar10(tmp_path, per_batch=8)
    for data_dir in (folder, tmp_path):  # the folder itself (course style) or its parent
        data = read_dataset("cifar10", str(data_dir))
        assert isinstance(data, TensorSplits)
        assert (len(data.train), len(data.test), data.num_classes) == (40, 8, 10)
        # the pixels written: the release stores each image as 3072 bytes, channel-major
        written = pickle.loads((folder / "data_batch_1").read_bytes())
        assert torch.equal(data.train.images[3].flatten(), torch.from_numpy(written["data"][3]))
        assert int(data.train.labels[3]) == written["labels"][3]


def test_cifar10_missing_and_corrupt_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no cifar-10-batches-py folder"):
        read_dataset("cifar10", str(tmp_path))
    folder = write_cifar10(tmp_path, per_batch=4)
    (folder / "data_batch_3").write_bytes(b"\x80\x04not a pickle")
    with pytest.raises(UsageError, match="data_batch_3 is unreadable"):
        read_dataset("cifar10", str(tmp_path))
    (folder / "data_batch_3").unlink()
    with pytest.raises(UsageError, match="data_batch_3 is missing"):
        read_dataset("cifar10", str(tmp_path))


def test_imagenet_reads_class_folders_with_crops(tmp_path: Path) -> None:
    write_imagenet(tmp_path, classes=3, per_class=2)
    data = read_dataset("imagenet", str(tmp_path))
    assert isinstance(data, FileSplits)
    assert (len(data.train), len(data.test), len(data.classes)) == (6, 6, 3)
    assert data.test.name(5).endswith("n00000002/img_1.JPEG") and int(data.test.labels[5]) == 2
    pipeline = build_pipeline(DataSpec("imagenet", str(tmp_path), 2, 6, 0, 0), 0, 1, torch.device("cpu"))
    assert next(pipeline.train_epoch(0))[0].shape == (2, 3, 224, 224)
    (images, labels), = list(pipeline.test_batches())
    assert images.shape == (6, 3, 224, 224) and labels.tolist() == [0, 0, 1, 1, 2, 2]


def test_imagenet_without_val_is_a_clear_error(tmp_path: Path) -> None:
    write_imagenet(tmp_path, classes=2, per_class=1)
    for path in (tmp_path / "val").rglob("*"):
        if path.is_file():
            path.unlink()
    with pytest.raises(UsageError, match="val"):
        read_dataset("imagenet", str(tmp_path))


def test_missing_data_dir_and_unknown_dataset(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        read_dataset("cifar10", str(tmp_path / "nope"))
    with pytest.raises(UsageError, match="needs --data-dir"):
        read_dataset("imagenet", None)


def test_shards_cover_the_test_set_exactly_once_even_when_uneven() -> None:
    for length, size in [(10, 4), (3, 4), (360, 7)]:
        seen = sorted(i for rank in range(size) for i in order.test_order(length, rank, size))
        assert seen == list(range(length))


def test_training_shards_are_disjoint_and_equal_in_steps() -> None:
    batches = [order.rank_order(103, 1, 0, rank, 3, 8).tolist() for rank in range(3)]
    assert len({len(b) for b in batches}) == 1
    flat = [i for b in batches for i in b]
    assert len(flat) == len(set(flat))


def test_more_ranks_than_samples_is_a_clear_error() -> None:
    spec = DataSpec("synthetic", None, 1, 1, 0, 0, synthetic_size=3)
    with pytest.raises(UsageError, match="cannot give 4 ranks a batch"):
        build_pipeline(spec, 0, 4, torch.device("cpu"))


def test_registry_is_the_only_choice_of_dataset_and_every_entry_builds(tmp_path: Path) -> None:
    assert set(REGISTRY) == {"digits", "mnist", "cifar10", "imagenet", "synthetic"}
    assert REGISTRY["cifar10"].crop_padding == 4 and REGISTRY["imagenet"].kind == "files"
    with pytest.raises(UsageError, match="unknown dataset 'svhn'"):
        read_dataset("svhn", str(tmp_path))


@pytest.mark.processes  # starts hpcdl.train
def test_resnet18_trains_a_step_on_cifar_files(tmp_path: Path) -> None:
    write_cifar10(tmp_path / "data", per_batch=8)
    result = run_train(1, tmp_path / "run", "--dataset", "cifar10", "--data-dir", str(tmp_path / "data"),
                       "--model", "resnet18", "--batch-size", "4", "--max-steps", "2", "--epochs", "1",
                       "--workers", "1", "--warmup-epochs", "0", timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "run" / "summary.json").exists()


def test_data_dir_that_is_a_file(tmp_path: Path) -> None:
    archive = tmp_path / "cifar-10-python.tar.gz"
    archive.write_bytes(b"\x1f\x8b")
    with pytest.raises(UsageError, match="is a file, not a folder"):
        read_dataset("cifar10", str(archive))
