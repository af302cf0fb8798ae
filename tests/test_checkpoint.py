"""hpcdl.checkpoint on its own: atomic writes, keep-K pruning, skipping unreadable files, refusing non-finite models."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hpcdl import checkpoint
from hpcdl.checkpoint import CheckpointError


def state(step: int, value: float = 1.0) -> dict:
    """A minimal state with every key an hpcdl checkpoint must have."""
    return {"model": {"w": torch.full((4, 4), value)}, "optimizer": {"state": {}}, "epoch": 0, "step_in_epoch": step,
            "global_step": step, "config": {"model": "m", "dataset": "d"}, "world_size": 2}


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_save_then_read_round_trip_leaves_only_the_final_file(tmp_path: Path) -> None:
    path = checkpoint.save(tmp_path, state(7, 3.0), keep=3)
    assert path.name == "ckpt-000000007.pt" and names(tmp_path) == ["ckpt-000000007.pt"]
    loaded = checkpoint.read(path)
    assert loaded["global_step"] == 7 and torch.equal(loaded["model"]["w"], torch.full((4, 4), 3.0))


def test_keep_k_prunes_the_oldest(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40, 50):
        checkpoint.save(tmp_path, state(step), keep=2)
    assert names(tmp_path) == ["ckpt-000000040.pt", "ckpt-000000050.pt"]
    assert [checkpoint.step_of(p) for p in checkpoint.list_checkpoints(tmp_path)] == [50, 40]


def test_pruning_never_deletes_the_file_just_written(tmp_path: Path) -> None:
    """Even when a higher-numbered file is in the folder (set aside by hand, say), the new one stays."""
    checkpoint.save(tmp_path, state(100), keep=1)
    written = checkpoint.save(tmp_path, state(30), keep=1)
    assert written.exists()


def test_non_finite_model_is_refused_and_good_checkpoints_stay(tmp_path: Path) -> None:
    good = checkpoint.save(tmp_path, state(10), keep=3)
    before = good.read_bytes()
    for bad in (float("nan"), float("inf")):
        with pytest.raises(CheckpointError, match="non-finite"):
            checkpoint.save(tmp_path, state(20, bad), keep=1)
    assert names(tmp_path) == ["ckpt-000000010.pt"] and good.read_bytes() == before


def test_a_crash_before_the_rename_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    """The process dies (here: raises) after writing the temporary file: no new name ever appears."""
    checkpoint.save(tmp_path, state(10), keep=3)

    def crash(temporary: Path) -> None:
        assert temporary.exists() and temporary.name.startswith(".ckpt-000000020.pt.tmp-")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, state(20), keep=3, before_rename=crash)
    assert names(tmp_path) == ["ckpt-000000010.pt"]
    assert checkpoint.load_latest(tmp_path)[1].name == "ckpt-000000010.pt"


def test_leftover_temporary_of_a_killed_writer_is_ignored_then_removed(tmp_path: Path) -> None:
    checkpoint.save(tmp_path, state(10), keep=3)
    leftover = tmp_path / ".ckpt-000000020.pt.tmp-4242"
    leftover.write_bytes(b"half a checkpoint")
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["ckpt-000000010.pt"]
    checkpoint.save(tmp_path, state(20), keep=3)
    assert names(tmp_path) == ["ckpt-000000010.pt", "ckpt-000000020.pt"]


def test_truncated_newest_is_skipped_saying_so(tmp_path: Path, capsys) -> None:
    checkpoint.save(tmp_path, state(10), keep=3)
    newest = checkpoint.save(tmp_path, state(20), keep=3)
    newest.write_bytes(newest.read_bytes()[:100])
    loaded, path = checkpoint.load_latest(tmp_path)
    assert path.name == "ckpt-000000010.pt" and loaded["global_step"] == 10
    assert "hpcdl: skipping checkpoint: ckpt-000000020.pt is unreadable" in capsys.readouterr().err
    assert newest.exists()  # without set_aside nothing is renamed


def test_set_aside_renames_only_unreadable_files_newer_than_the_one_used(tmp_path: Path, capsys) -> None:
    for step in (10, 20, 30):
        checkpoint.save(tmp_path, state(step), keep=5)
    (tmp_path / "ckpt-000000030.pt").write_bytes(b"")
    loaded, path = checkpoint.load_latest(tmp_path, set_aside=True)
    assert path.name == "ckpt-000000020.pt"
    assert names(tmp_path) == ["ckpt-000000010.pt", "ckpt-000000020.pt", "ckpt-000000030.pt.unreadable"]
    assert "set ckpt-000000030.pt aside as ckpt-000000030.pt.unreadable" in capsys.readouterr().err
    # The next save of step 30 is not pruned by a stale, unreadable "newest" file.
    checkpoint.save(tmp_path, state(30), keep=2)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["ckpt-000000030.pt", "ckpt-000000020.pt"]


def test_no_readable_checkpoint_renames_nothing(tmp_path: Path) -> None:
    for step in (10, 20):
        checkpoint.save(tmp_path, state(step), keep=5).write_bytes(b"garbage")
    assert checkpoint.load_latest(tmp_path, set_aside=True) == (None, None)
    assert names(tmp_path) == ["ckpt-000000010.pt", "ckpt-000000020.pt"]


class RunsCode:
    """A pickle that would run a command when loaded without weights_only."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_a_checkpoint_that_would_run_code_is_refused_unexecuted(tmp_path: Path) -> None:
    marker = tmp_path / "it-ran"
    folder = tmp_path / "checkpoints"
    checkpoint.save(folder, state(10), keep=3)
    torch.save({**state(20), "payload": RunsCode(marker)}, folder / "ckpt-000000020.pt")
    with pytest.raises(CheckpointError, match=r"ckpt-000000020.pt is unreadable \(UnpicklingError"):
        checkpoint.read(folder / "ckpt-000000020.pt")
    assert checkpoint.load_latest(folder)[1].name == "ckpt-000000010.pt"
    assert not marker.exists()


def test_a_torch_file_that_is_not_an_hpcdl_checkpoint(tmp_path: Path) -> None:
    torch.save({"state_dict": {"w": torch.zeros(2)}}, tmp_path / "ckpt-000000005.pt")
    with pytest.raises(CheckpointError, match="ckpt-000000005.pt is not an hpcdl checkpoint"):
        checkpoint.read(tmp_path / "ckpt-000000005.pt")


def test_full_disk_is_reported_as_the_os_error(tmp_path: Path) -> None:
    """torch reports a failed write as "unexpected pos"; save() raises the OSError behind it instead."""
    import subprocess

    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root and mount rights)")
    try:
        big = state(10)
        big["model"] = {"w": torch.zeros(100_000)}  # 400 kB into 64 kB
        with pytest.raises(OSError) as raised:
            checkpoint.save(mount, big, keep=3)
        assert raised.value.errno == 28  # ENOSPC
        assert os.listdir(mount) == []  # the partial temporary file is gone
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
