"""Packed shards: the format is genuine WebDataset, every sample is seen once per epoch over 1, 2 and 3
ranks (the same sample set as the folder dataset), mid-epoch resume is exact, packing is atomic, and
a damaged shard folder is one line naming the file."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from hpcdl.data import DataSpec, build_pipeline
from hpcdl.data.pipeline import FilePipeline
from hpcdl.runtime.errors import UsageError
from hpcdl.tools.pack import pack
from tests.support.data_files import write_cifar10, write_imagenet, write_mnist

pytestmark = pytest.mark.processes  # starts processes: not in the fast tier


CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[2]


def spec(data_dir: Path, dataset: str = "imagenet", **changes: object) -> DataSpec:
    base: dict = dict(dataset=dataset, data_dir=str(data_dir), batch_size=2, test_batch_size=3, workers=0, seed=5,
                      image_size=24)
    return DataSpec(**{**base, **changes})


@pytest.fixture(scope="module")
def imagenet(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A folder dataset (3 classes x 7 train / 7 val JPEGs) and its shards, ~3 samples per shard."""
    root = tmp_path_factory.mktemp("imagenet")
    write_imagenet(root / "folder", classes=3, per_class=7, size=40)
    pack("imagenet", root / "folder", root / "shards", shard_bytes=3 * 2000, seed=0, force=False)
    return root / "folder", root / "shards"


def digest(data: torch.Tensor | bytes) -> str:
    return hashlib.sha256(bytes(data) if isinstance(data, bytes) else data.numpy().tobytes()).hexdigest()


def folder_samples(folder: Path, split: str) -> Counter:
    classes = sorted(p.name for p in (folder / split).iterdir())
    return Counter((digest(path.read_bytes()), classes.index(path.parent.name))
                   for path in (folder / split).rglob("*.JPEG"))


def test_shards_are_webdataset_tars_holding_exactly_the_folder_samples(imagenet: tuple[Path, Path]) -> None:
    folder, shards = imagenet
    index = json.loads((shards / "index.json").read_text())
    assert index["format"] == "hpcdl-shards" and index["version"] == 2 and index["dataset"] == "imagenet"
    assert index["classes"] == ["n00000000", "n00000001", "n00000002"]
    for split in ("train", "val"):
        entry = index["splits"][split]
        assert len(entry["shards"]) > 2 and entry["samples"] == 21
        found: Counter = Counter()
        for shard in entry["shards"]:
            # read with tarfile front to back, grouping members by WebDataset's key rule (up to the first dot)
            with tarfile.open(shards / shard["file"]) as tar:
                members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
            keys = sorted({name.split(".", 1)[0] for name in members})
            assert len(keys) == shard["samples"] and len(members) == 2 * len(keys)
            found.update((digest(members[f"{k}.jpg"]), int(members[f"{k}.cls"])) for k in keys)
        assert found == folder_samples(folder, split)


def test_webdataset_library_reads_the_shards(imagenet: tuple[Path, Path]) -> None:
    wds = pytest.importorskip("webdataset")
    folder, shards = imagenet
    urls = [str(p) for p in sorted(shards.glob("train-*.tar"))]
    samples = list(wds.WebDataset(urls, shardshuffle=False))
    assert Counter((digest(s["jpg"]), int(s["cls"])) for s in samples) == folder_samples(folder, "train")


@pytest.mark.parametrize("size", [1, 2, 3])
def test_each_sample_once_per_epoch_over_ranks_like_the_folder_dataset(imagenet: tuple[Path, Path], size: int) -> None:
    folder, shards = imagenet
    for epoch in (0, 1):
        seen: dict[str, list] = {"folder": [], "shards": []}
        steps = set()
        for kind, path in (("folder", folder), ("shards", shards)):
            for rank in range(size):
                pipeline = build_pipeline(spec(path), rank, size, CPU)
                assert isinstance(pipeline, FilePipeline)
                keys = pipeline.train_keys_for(epoch, 0)
                seen[kind] += [(digest(pipeline.train_source.read(i)), int(pipeline.train_source.labels[i]))
                               for i, _ in keys]
                batches = list(pipeline.train_epoch(epoch))
                labels = [int(pipeline.train_source.labels[i]) for i, _ in keys]
                assert [int(v) for _, y in batches for v in y] == labels
                steps.add(len(batches))
        assert len(steps) == 1  # every rank, either format: the same number of steps
        expected = (21 // size) // 2 * 2 * size
        for kind in ("folder", "shards"):
            assert len(seen[kind]) == len(set(seen[kind])) == expected  # nothing twice; only the remainder waits
            assert set(seen[kind]) <= set(folder_samples(folder, "train"))


@pytest.mark.parametrize("size", [1, 2, 3])
def test_evaluation_over_ranks_covers_the_folder_val_set_once(imagenet: tuple[Path, Path], size: int) -> None:
    folder, shards = imagenet
    views: dict[str, list] = {"folder": [], "shards": []}
    for kind, path in (("folder", folder), ("shards", shards)):
        for rank in range(size):
            for x, y in build_pipeline(spec(path), rank, size, CPU).test_batches():
                views[kind] += [(digest(image), int(label)) for image, label in zip(x, y, strict=True)]
    assert len(views["shards"]) == 21
    assert Counter(views["shards"]) == Counter(views["folder"])  # the same decoded evaluation views


def test_resume_mid_epoch_from_shards_with_a_worker_is_exact(imagenet: tuple[Path, Path]) -> None:
    _, shards = imagenet
    pipeline = build_pipeline(spec(shards, workers=1), 1, 2, CPU)
    full = list(pipeline.train_epoch(4))
    pipeline.close()
    torch.manual_seed(99)
    resumed_pipeline = build_pipeline(spec(shards, workers=1), 1, 2, CPU)
    resumed = list(resumed_pipeline.train_epoch(4, start_step=3))
    resumed_pipeline.close()
    assert len(full) == 5 and len(resumed) == 2
    for (x, y), (rx, ry) in zip(full[3:], resumed, strict=True):
        assert torch.equal(x, rx) and torch.equal(y, ry)


@pytest.mark.parametrize("dataset", ["cifar10", "mnist"])
def test_small_datasets_round_trip_through_png_shards(tmp_path: Path, dataset: str) -> None:
    if dataset == "cifar10":
        write_cifar10(tmp_path / "data", per_batch=6)
    else:
        write_mnist(tmp_path / "data", train=15, test=7)
    pack(dataset, tmp_path / "data", tmp_path / "shards", shard_bytes=4000, seed=1, force=False)
    from_files = build_pipeline(spec(tmp_path / "data", dataset, test_batch_size=100), 0, 1, CPU)
    from_shards = build_pipeline(spec(tmp_path / "shards", dataset, test_batch_size=100), 0, 1, CPU)
    assert from_shards.train_samples == from_files.train_samples and from_shards.input_shape == from_files.input_shape
    (x, y), = list(from_files.test_batches())
    (sx, sy), = list(from_shards.test_batches())
    expected = Counter((digest(a), int(b)) for a, b in zip(x, y, strict=True))
    assert Counter((digest(a), int(b)) for a, b in zip(sx, sy, strict=True)) == expected


def test_pack_refuses_to_overwrite_and_force_replaces(tmp_path: Path) -> None:
    write_mnist(tmp_path / "data")
    pack("mnist", tmp_path / "data", tmp_path / "out", shard_bytes=2**20, seed=0, force=False)
    with pytest.raises(UsageError, match="exists; pass --force"):
        pack("mnist", tmp_path / "data", tmp_path / "out", shard_bytes=2**20, seed=0, force=False)
    (tmp_path / "out" / "stale.txt").write_text("old")
    pack("mnist", tmp_path / "data", tmp_path / "out", shard_bytes=2**20, seed=0, force=True)
    assert not (tmp_path / "out" / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "out"]  # no staging or retired folders left


def test_interrupted_pack_leaves_no_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcdl.data import shards as shard_module

    write_mnist(tmp_path / "data", train=20)
    calls = {"n": 0}
    original = shard_module.ShardWriter.add

    def failing_add(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 10:
            raise OSError("disk full")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(shard_module.ShardWriter, "add", failing_add)
    with pytest.raises(OSError, match="disk full"):
        pack("mnist", tmp_path / "data", tmp_path / "out", shard_bytes=2**20, seed=0, force=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def damaged(imagenet: tuple[Path, Path], tmp_path: Path) -> Path:
    import shutil

    copy = tmp_path / "shards"
    shutil.copytree(imagenet[1], copy)
    return copy


def test_damaged_shard_folders_are_one_line_naming_the_file(imagenet: tuple[Path, Path], tmp_path: Path) -> None:
    shards = damaged(imagenet, tmp_path)
    with pytest.raises(UsageError, match="holds imagenet shards, not cifar10"):
        build_pipeline(spec(shards, "cifar10"), 0, 1, CPU)
    shard = shards / "train-000001.tar"
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(UsageError, match=f"shard {shard} is truncated"):
        build_pipeline(spec(shards), 0, 1, CPU)
    shard.unlink()
    with pytest.raises(UsageError, match=f"shard {shard} is missing"):
        build_pipeline(spec(shards), 0, 1, CPU)
    index = json.loads((shards / "index.json").read_text())
    index["version"] = 9
    (shards / "index.json").write_text(json.dumps(index))
    with pytest.raises(UsageError, match="format version 9"):
        build_pipeline(spec(shards), 0, 1, CPU)
    (shards / "index.json").write_text("{not json")
    with pytest.raises(UsageError, match="index.json is unreadable"):
        build_pipeline(spec(shards), 0, 1, CPU)


def test_bad_label_in_the_table_is_caught(imagenet: tuple[Path, Path], tmp_path: Path) -> None:
    shards = damaged(imagenet, tmp_path)
    table = np.load(shards / "val.npy")
    table[2, 3] = 7
    np.save(shards / "val.npy", table)
    with pytest.raises(UsageError, match="val.npy: labels range over 0..7, expected 0..2"):
        build_pipeline(spec(shards), 0, 1, CPU)


def test_corrupt_image_inside_a_shard_names_the_shard(imagenet: tuple[Path, Path], tmp_path: Path) -> None:
    shards = damaged(imagenet, tmp_path)
    table = np.load(shards / "train.npy")
    shard, offset, length = (int(v) for v in table[0, :3])
    path = shards / f"train-{shard:06d}.tar"
    data = bytearray(path.read_bytes())
    data[offset + 3:offset + length] = bytes(length - 3)  # keep the JPEG magic, zero the rest
    path.write_bytes(bytes(data))
    pipeline = build_pipeline(spec(shards, batch_size=21), 0, 1, CPU)
    with pytest.raises(OSError, match=f"cannot decode image {path} \\(sample 0 at byte {offset}\\)"):
        list(pipeline.train_epoch(0))


def test_pack_command_line(tmp_path: Path) -> None:
    write_cifar10(tmp_path / "data", per_batch=3)
    command = [sys.executable, "-m", "hpcdl.pack", "--dataset", "cifar10", "--data-dir", str(tmp_path / "data"),
               "--output", str(tmp_path / "out")]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    again = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [
        f"hpcdl.pack: error: --output {tmp_path / 'out'} exists; pass --force to replace it"]
    missing = subprocess.run(command[:6] + [str(tmp_path / "nope"), "--output", str(tmp_path / "o2")], cwd=REPO,
                             capture_output=True, text=True, timeout=180)
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
    assert "does not exist" in missing.stderr


def test_hpcdl_train_reads_shards_on_two_ranks(tmp_path: Path) -> None:
    from tests.support.mpi_harness import run_train

    write_mnist(tmp_path / "data", train=40, test=10)
    pack("mnist", tmp_path / "data", tmp_path / "shards", shard_bytes=4000, seed=0, force=False)
    result = run_train(2, tmp_path / "run", "--dataset", "mnist", "--data-dir", str(tmp_path / "shards"),
                       "--batch-size", "4", "--test-batch-size", "3", "--epochs", "1", "--warmup-epochs", "0",
                       "--workers", "0", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2
