"""hpcdl.checkpoint on its own: atomic writes, keep-K pruning, skipping unreadable files, refusing non-finite models."""

from __future__ import annotations

import errno
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from hpcdl.persistence import atomic, checkpoint_files
from hpcdl.persistence.checkpoint_files import CheckpointError

pytestmark = pytest.mark.processes  # starts processes: not in the fast tier



def state(step: int, value: float = 1.0) -> dict:
    """A minimal state with every key an hpcdl checkpoint must have."""
    return {
        "model": {"w": torch.full((4, 4), value)},
        "optimizer": {"state": {}},
        "epoch": 0,
        "step_in_epoch": step,
        "global_step": step,
        "config": {"model": "m", "dataset": "d"},
        "world_size": 2,
    }


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_save_then_read_round_trip_leaves_only_the_final_file(tmp_path: Path) -> None:
    path = checkpoint_files.save(tmp_path, state(7, 3.0), keep=3)
    assert path.name == "ckpt-000000007.pt" and names(tmp_path) == ["ckpt-000000007.pt"]
    loaded = checkpoint_files.read(path)
    assert loaded["global_step"] == 7 and torch.equal(loaded["model"]["w"], torch.full((4, 4), 3.0))


def test_keep_k_prunes_the_oldest(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40, 50):
        checkpoint_files.save(tmp_path, state(step), keep=2)
    assert names(tmp_path) == ["ckpt-000000040.pt", "ckpt-000000050.pt"]
    assert [checkpoint_files.step_of(p) for p in checkpoint_files.list_checkpoints(tmp_path)] == [50, 40]


def test_pruning_never_deletes_the_file_just_written(tmp_path: Path) -> None:
    """Even when a higher-numbered file is in the folder (set aside by hand, say), the new one stays."""
    checkpoint_files.save(tmp_path, state(100), keep=1)
    written = checkpoint_files.save(tmp_path, state(30), keep=1)
    assert written.exists()


def test_non_finite_model_is_refused_and_good_checkpoints_stay(tmp_path: Path) -> None:
    good = checkpoint_files.save(tmp_path, state(10), keep=3)
    before = good.read_bytes()
    for bad in (float("nan"), float("inf")):
        with pytest.raises(CheckpointError, match="non-finite"):
            checkpoint_files.save(tmp_path, state(20, bad), keep=1)
    assert names(tmp_path) == ["ckpt-000000010.pt"] and good.read_bytes() == before


def test_a_crash_before_the_rename_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    """The process dies (here: raises) after writing the temporary file: no new name ever appears."""
    checkpoint_files.save(tmp_path, state(10), keep=3)

    def crash(temporary: Path) -> None:
        assert temporary.exists() and temporary.name.startswith(".ckpt-000000020.pt.tmp-")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        checkpoint_files.save(tmp_path, state(20), keep=3, before_rename=crash)
    assert names(tmp_path) == ["ckpt-000000010.pt"]
    assert checkpoint_files.load_latest(tmp_path)[1].name == "ckpt-000000010.pt"


def test_leftover_temporary_of_a_killed_writer_is_ignored_then_removed(tmp_path: Path) -> None:
    """Callers that pass no run id (pid-named temporaries) keep the behaviour they had."""
    checkpoint_files.save(tmp_path, state(10), keep=3)
    leftover = tmp_path / ".ckpt-000000020.pt.tmp-4242"
    leftover.write_bytes(b"half a checkpoint")
    assert [p.name for p in checkpoint_files.list_checkpoints(tmp_path)] == ["ckpt-000000010.pt"]
    checkpoint_files.save(tmp_path, state(20), keep=3)
    assert names(tmp_path) == ["ckpt-000000010.pt", "ckpt-000000020.pt"]


MINE = "20261123T110000-node1-100-aaaaaa"
OTHER = "20261123T110001-node2-200-bbbbbb"


def test_temporaries_carry_the_run_id_and_clean_up_spares_other_runs(tmp_path: Path) -> None:
    """Two runs writing one folder (which the run-directory lock prevents, but a clean-up must never make
    worse): a run removes its own abandoned temporary, never the other's, which may be mid-write."""
    seen: list[str] = []
    checkpoint_files.save(tmp_path, state(10), keep=3, run_id=MINE, before_rename=lambda t: seen.append(t.name))
    assert seen == [f".ckpt-000000010.pt.tmp-{MINE}"]
    mine = tmp_path / f".ckpt-000000015.pt.tmp-{MINE}"
    theirs = tmp_path / f".ckpt-000000015.pt.tmp-{OTHER}"
    legacy = tmp_path / ".ckpt-000000015.pt.tmp-4242"
    for path in (mine, theirs, legacy):
        path.write_bytes(b"half a checkpoint")
    checkpoint_files.save(tmp_path, state(20), keep=3, run_id=MINE)
    assert names(tmp_path) == sorted([legacy.name, theirs.name, "ckpt-000000010.pt", "ckpt-000000020.pt"])


def _disk_fails(code: int, as_torch_does: bool):
    """A torch.save that writes part of the file, then hits ``code`` -- raw, or wrapped as torch reports it."""

    def fake_save(obj, handle) -> None:
        handle.write(b"x" * 4096)
        handle.flush()
        if not as_torch_does:
            raise OSError(code, os.strerror(code))
        try:
            raise OSError(code, os.strerror(code))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 4096 vs 2048") from None

    return fake_save


@pytest.mark.parametrize(
    ("code", "as_torch_does", "words"),
    [
        (errno.ENOSPC, True, "No space left on device (ENOSPC): free space there"),
        (errno.ENOSPC, False, "No space left on device (ENOSPC): free space there"),
        (errno.EDQUOT, True, "Disk quota exceeded (EDQUOT): check your quota"),
        (errno.EIO, False, "Input/output error (EIO): the file system or disk failed"),
    ],
)
def test_a_failed_write_is_one_line_naming_the_file_and_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch, code: int, as_torch_does: bool, words: str
) -> None:
    good = checkpoint_files.save(tmp_path, state(10), keep=1, run_id=MINE)
    before = good.read_bytes()
    monkeypatch.setattr(checkpoint_files.torch, "save", _disk_fails(code, as_torch_does))
    with pytest.raises(atomic.WriteError) as raised:
        checkpoint_files.save(tmp_path, state(20), keep=1, run_id=MINE)
    line = str(raised.value)
    assert line.startswith(f"cannot write {tmp_path / 'ckpt-000000020.pt'}: {words}")
    assert "\n" not in line and raised.value.errno == code and isinstance(raised.value, OSError)
    assert names(tmp_path) == ["ckpt-000000010.pt"] and good.read_bytes() == before  # no partial file, old one intact


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (errno.EACCES, "Permission denied (EACCES): choose a directory you may write"),
        (errno.EROFS, "Read-only file system (EROFS): choose a writable --output-dir"),
    ],
)
def test_a_folder_that_refuses_new_files(tmp_path: Path, monkeypatch, code: int, words: str) -> None:
    good = checkpoint_files.save(tmp_path, state(10), keep=1, run_id=MINE)
    real_open = os.open

    def refusing_open(path, flags, *args, **kwargs):
        if ".tmp-" in os.fspath(path) and flags & os.O_CREAT:
            raise OSError(code, os.strerror(code), os.fspath(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    with pytest.raises(
        atomic.WriteError,
        match=rf"^cannot write {re.escape(str(tmp_path))}/ckpt-000000020.pt: "
        rf"{re.escape(words)}",
    ):
        checkpoint_files.save(tmp_path, state(20), keep=1, run_id=MINE)
    assert names(tmp_path) == ["ckpt-000000010.pt"] and checkpoint_files.read(good)["global_step"] == 10


def test_an_uncreatable_checkpoint_folder_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(
        atomic.WriteError,
        match=r"cannot write .*file/checkpoints: Not a directory \(ENOTDIR\): a component of the path is a file",
    ):
        checkpoint_files.save(tmp_path / "file" / "checkpoints", state(10), keep=1)


def test_a_failed_rename_leaves_no_temporary(tmp_path: Path, monkeypatch) -> None:
    checkpoint_files.save(tmp_path, state(10), keep=1, run_id=MINE)

    def refuse(src, dst) -> None:
        raise OSError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(atomic.WriteError, match="Permission denied"):
        checkpoint_files.save(tmp_path, state(20), keep=1, run_id=MINE)
    assert names(tmp_path) == ["ckpt-000000010.pt"]


def test_pruning_that_fails_only_warns(tmp_path: Path, monkeypatch, capsys) -> None:
    checkpoint_files.save(tmp_path, state(10), keep=1)
    real_unlink = Path.unlink

    def unlink(self: Path, missing_ok: bool = False) -> None:
        if self.name == "ckpt-000000010.pt":
            raise OSError(errno.EACCES, os.strerror(errno.EACCES))
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    checkpoint_files.save(tmp_path, state(20), keep=1)
    assert names(tmp_path) == ["ckpt-000000010.pt", "ckpt-000000020.pt"]
    assert "hpcdl: warning: could not prune" in capsys.readouterr().err


def test_text_results_are_written_atomically(tmp_path: Path, monkeypatch) -> None:
    summary = tmp_path / "summary.json"
    atomic.write_text_atomically(summary, '{"epochs": 1}\n', run_id=MINE)
    assert summary.read_text() == '{"epochs": 1}\n'

    def full_disk(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(
        atomic.WriteError, match=rf"cannot write {re.escape(str(summary))}: No space left on device"
    ):
        atomic.write_text_atomically(summary, '{"epochs": 2}\n', run_id=MINE)
    assert summary.read_text() == '{"epochs": 1}\n' and names(tmp_path) == ["summary.json"]


def test_truncated_newest_is_skipped_saying_so(tmp_path: Path, capsys) -> None:
    checkpoint_files.save(tmp_path, state(10), keep=3)
    newest = checkpoint_files.save(tmp_path, state(20), keep=3)
    newest.write_bytes(newest.read_bytes()[:100])
    loaded, path = checkpoint_files.load_latest(tmp_path)
    assert path.name == "ckpt-000000010.pt" and loaded["global_step"] == 10
    assert "hpcdl: skipping checkpoint: ckpt-000000020.pt is unreadable" in capsys.readouterr().err
    assert newest.exists()  # without set_aside nothing is renamed


def test_set_aside_renames_only_unreadable_files_newer_than_the_one_used(tmp_path: Path, capsys) -> None:
    for step in (10, 20, 30):
        checkpoint_files.save(tmp_path, state(step), keep=5)
    (tmp_path / "ckpt-000000030.pt").write_bytes(b"")
    loaded, path = checkpoint_files.load_latest(tmp_path, set_aside=True)
    assert path.name == "ckpt-000000020.pt"
    assert names(tmp_path) == ["ckpt-000000010.pt", "ckpt-000000020.pt", "ckpt-000000030.pt.unreadable"]
    assert "set ckpt-000000030.pt aside as ckpt-000000030.pt.unreadable" in capsys.readouterr().err
    # The next save of step 30 is not pruned by a stale, unreadable "newest" file.
    checkpoint_files.save(tmp_path, state(30), keep=2)
    assert [p.name for p in checkpoint_files.list_checkpoints(tmp_path)] == ["ckpt-000000030.pt", "ckpt-000000020.pt"]


def test_no_readable_checkpoint_renames_nothing(tmp_path: Path) -> None:
    for step in (10, 20):
        checkpoint_files.save(tmp_path, state(step), keep=5).write_bytes(b"garbage")
    assert checkpoint_files.load_latest(tmp_path, set_aside=True) == (None, None)
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
    checkpoint_files.save(folder, state(10), keep=3)
    torch.save({**state(20), "payload": RunsCode(marker)}, folder / "ckpt-000000020.pt")
    with pytest.raises(CheckpointError, match=r"ckpt-000000020.pt is unreadable \(UnpicklingError"):
        checkpoint_files.read(folder / "ckpt-000000020.pt")
    assert checkpoint_files.load_latest(folder)[1].name == "ckpt-000000010.pt"
    assert not marker.exists()


def test_a_torch_file_that_is_not_an_hpcdl_checkpoint(tmp_path: Path) -> None:
    torch.save({"state_dict": {"w": torch.zeros(2)}}, tmp_path / "ckpt-000000005.pt")
    with pytest.raises(CheckpointError, match="ckpt-000000005.pt is not an hpcdl checkpoint"):
        checkpoint_files.read(tmp_path / "ckpt-000000005.pt")


def _tmpfs(mount: Path, options: str) -> None:
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root and mount rights)")


def test_full_disk_is_reported_as_the_os_error(tmp_path: Path) -> None:
    """A real 64 kB file system: torch reports the failed write as "unexpected pos"; save() raises a one-line
    WriteError (an OSError with errno ENOSPC) instead, and the previous checkpoint stays."""
    mount = tmp_path / "small"
    _tmpfs(mount, "size=64k")
    try:
        good = checkpoint_files.save(mount, state(10), keep=3, run_id=MINE)
        before = good.read_bytes()
        big = state(20)
        big["model"] = {"w": torch.zeros(100_000)}  # 400 kB into 64 kB
        with pytest.raises(OSError) as raised:
            checkpoint_files.save(mount, big, keep=3, run_id=MINE)
        assert raised.value.errno == errno.ENOSPC
        assert str(raised.value).startswith(
            f"cannot write {mount / 'ckpt-000000020.pt'}: No space left on device (ENOSPC)"
        )
        assert os.listdir(mount) == [good.name] and good.read_bytes() == before  # the partial temporary is gone
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_read_only_file_system(tmp_path: Path) -> None:
    mount = tmp_path / "ro"
    _tmpfs(mount, "size=64k,ro")
    try:
        with pytest.raises(atomic.WriteError, match=r"cannot write .*ckpt-000000010.pt: Read-only file system"):
            checkpoint_files.save(mount, state(10), keep=3, run_id=MINE)
        assert os.listdir(mount) == []
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_best_is_the_checkpoint_of_its_step_and_outlives_its_pruning(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        checkpoint_files.save(directory, {"model": {"w": torch.full((2,), float(step))}, "global_step": step}, keep=2)
        if step == 2:
            best = checkpoint_files.keep_as_best(directory, 2)
    assert best == tmp_path / "best.pt" and names(directory) == ["ckpt-000000002.pt", "ckpt-000000003.pt"]
    checkpoint_files.save(directory, {"model": {"w": torch.zeros(2)}, "global_step": 4}, keep=2)  # prunes step 2
    assert torch.load(best, weights_only=True)["global_step"] == 2
    assert checkpoint_files.keep_as_best(directory, 9) == best  # step 9 was never saved: the best stays
    assert torch.load(best, weights_only=True)["global_step"] == 2
