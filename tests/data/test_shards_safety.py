"""hpcdl.pack never destroys its input, ends complete or absent (SIGTERM, SIGKILL), writes with the umask's
modes, and shards give a run the same batches as the folder they were packed from (whatever the pack seed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hpcdl.data import DataSpec, build_pipeline
from hpcdl.runtime.errors import UsageError
from hpcdl.tools.pack import pack
from tests.support.data_files import write_cifar10, write_imagenet, write_mnist

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("where", ["the data folder", "a folder holding it", "a folder inside it"])
def test_pack_force_refuses_to_write_over_its_own_input(tmp_path: Path, where: str) -> None:
    data = tmp_path / "data"
    write_mnist(data)
    before = snapshot(tmp_path)
    output = {"the data folder": data, "a folder holding it": tmp_path, "a folder inside it": data / "shards"}[where]
    with pytest.raises(UsageError, match="writing there would overwrite the input") as caught:
        pack("mnist", data, output, shard_bytes=2**20, seed=0, force=True)
    assert "\n" not in str(caught.value)
    assert snapshot(tmp_path) == before  # nothing touched, nothing added


@pytest.mark.processes  # runs hpcdl.pack in a child process
def test_pack_force_onto_the_data_folder_from_the_command_line_is_one_line(tmp_path: Path) -> None:
    data = write_cifar10(tmp_path / "data", per_batch=3)
    before = snapshot(tmp_path)
    done = subprocess.run([sys.executable, "-m", "hpcdl.pack", "--dataset", "cifar10", "--data-dir", str(data),
                           "--output", str(tmp_path / "data"), "--force"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"hpcdl.pack: error: --output {tmp_path / 'data'} contains --data-dir {data}: writing there would overwrite "
        "the input; choose an --output outside it"]
    assert snapshot(tmp_path) == before


SLOW_PACK = """
import sys, time
from hpcdl.data import shards
original = shards.ShardWriter.add
def slow_add(self, *args):
    time.sleep(0.05)
    return original(self, *args)
shards.ShardWriter.add = slow_add
from hpcdl.tools.pack import main_cli
sys.argv = ["hpcdl.pack", *sys.argv[1:]]
main_cli()
"""


def start_slow_pack(data: Path, output: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", SLOW_PACK, "--dataset", "mnist", "--data-dir", str(data),
                             "--output", str(output), "--force"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for_partial(folder: Path, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while not list(folder.glob(".out.partial-*/train-*.tar")):
        assert proc.poll() is None and time.monotonic() < deadline, "the pack never started writing"
        time.sleep(0.05)


@pytest.mark.processes
@pytest.mark.parametrize("previous", [False, True], ids=["new output", "replacing an output"])
def test_sigterm_during_a_pack_leaves_no_partial_folder(tmp_path: Path, previous: bool) -> None:
    write_mnist(tmp_path / "data", train=200, test=5)
    if previous:
        pack("mnist", tmp_path / "data", tmp_path / "out", shard_bytes=2**20, seed=0, force=False)
    before = snapshot(tmp_path)
    proc = start_slow_pack(tmp_path / "data", tmp_path / "out")
    try:
        wait_for_partial(tmp_path, proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert sorted(p.name for p in tmp_path.iterdir()) == (["data", "out"] if previous else ["data"])
    assert snapshot(tmp_path) == before  # the earlier output, if any, untouched


@pytest.mark.processes
def test_the_next_pack_removes_what_a_killed_pack_left(tmp_path: Path, capsys) -> None:
    """The killed pack is a process (SIGKILL); the next pack is the same pack() its command line calls, run here."""
    write_mnist(tmp_path / "data", train=200, test=5)
    proc = start_slow_pack(tmp_path / "data", tmp_path / "out")
    try:
        wait_for_partial(tmp_path, proc)
        proc.kill()  # SIGKILL: nothing can clean up
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert [p.name for p in tmp_path.glob(".out.partial-*")], "SIGKILL should have left the partial folder"
    capsys.readouterr()
    pack("mnist", tmp_path / "data", tmp_path / "out", shard_bytes=2**20, seed=0, force=False)
    err = capsys.readouterr().err
    assert "hpcdl.pack: removed .out.partial-" in err and "left by an interrupted run" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "out"]


@pytest.mark.processes  # runs hpcdl.pack in a child process
def test_an_output_set_aside_by_a_killed_replacement_is_put_back(tmp_path: Path) -> None:
    write_mnist(tmp_path / "data")
    pack("mnist", tmp_path / "data", tmp_path / "out", shard_bytes=2**20, seed=0, force=False)
    # a pack killed between its two renames: the old output set aside under a dead process's name
    dead = subprocess.run(["true"], check=True)  # noqa: S607 - a pid that has certainly ended
    del dead
    os.rename(tmp_path / "out", tmp_path / f".out.old-{os.uname().nodename}-{2**22 + 1}")
    pack("mnist", tmp_path / "data", tmp_path / "out2", shard_bytes=2**20, seed=0, force=False)  # another target
    assert not (tmp_path / "out").exists()  # only a pack of the same target looks
    with pytest.raises(UsageError, match="exists; pass --force"):
        pack("mnist", tmp_path / "data", tmp_path / "out", shard_bytes=2**20, seed=0, force=False)
    assert (tmp_path / "out" / "index.json").is_file()  # put back before anything else happened


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_pack_output_has_the_modes_the_umask_asks_for(tmp_path: Path, umask: int) -> None:
    write_mnist(tmp_path / "data")
    old = os.umask(umask)
    try:
        pack("mnist", tmp_path / "data", tmp_path / "out", shard_bytes=2**20, seed=0, force=False)
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~umask
    for path in (tmp_path / "out").iterdir():
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask, path.name


def spec(data_dir: Path, dataset: str) -> DataSpec:
    return DataSpec(dataset=dataset, data_dir=str(data_dir), batch_size=3, test_batch_size=5, workers=0, seed=7,
                    image_size=24)


def batches(data_dir: Path, dataset: str, rank: int, size: int, epoch: int) -> list[tuple[torch.Tensor, ...]]:
    pipeline = build_pipeline(spec(data_dir, dataset), rank, size, CPU)
    try:
        return [tuple(t.clone() for t in batch) for batch in pipeline.train_epoch(epoch)]
    finally:
        pipeline.close()


@pytest.mark.parametrize("dataset", ["cifar10", "mnist"])
@pytest.mark.parametrize("size", [1, 3])
def test_shards_give_the_folders_batches_whatever_the_pack_seed(tmp_path: Path, dataset: str, size: int) -> None:
    if dataset == "cifar10":
        write_cifar10(tmp_path / "data", per_batch=5)
    else:
        write_mnist(tmp_path / "data", train=25, test=7)
    pack(dataset, tmp_path / "data", tmp_path / "s0", shard_bytes=3000, seed=0, force=False)
    pack(dataset, tmp_path / "data", tmp_path / "s9", shard_bytes=3000, seed=9, force=False)  # a repack
    for rank in range(size):
        for epoch in (0, 1):
            expected = batches(tmp_path / "data", dataset, rank, size, epoch)
            for packed in ("s0", "s9"):
                got = batches(tmp_path / packed, dataset, rank, size, epoch)
                assert len(got) == len(expected) > 0
                assert all(torch.equal(a, b) for g, e in zip(got, expected, strict=True)
                           for a, b in zip(g, e, strict=True)), f"{packed}, rank {rank}, epoch {epoch}"


@pytest.mark.processes
def test_imagenet_shard_table_is_in_the_folders_order(tmp_path: Path) -> None:
    write_imagenet(tmp_path / "folder", classes=3, per_class=4, size=24)
    pack("imagenet", tmp_path / "folder", tmp_path / "shards", shard_bytes=4000, seed=3, force=False)
    from_folder = build_pipeline(spec(tmp_path / "folder", "imagenet"), 0, 1, CPU)
    from_shards = build_pipeline(spec(tmp_path / "shards", "imagenet"), 0, 1, CPU)
    for i in range(len(from_folder.train_source)):  # type: ignore[attr-defined]
        assert torch.equal(from_folder.train_source.read(i), from_shards.train_source.read(i))  # type: ignore[attr-defined]
    assert np.array_equal(from_folder.train_source.labels, from_shards.train_source.labels)  # type: ignore[attr-defined]
