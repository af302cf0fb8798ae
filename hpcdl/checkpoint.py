"""Checkpoints that survive being killed mid-write.

Rank 0 writes ``checkpoints/ckpt-<global step>.pt`` through a temporary file in the same folder,
flushed to disk and then renamed: a reader sees either the old set of files or the new complete
one, never half a file. Loading walks from the newest file back and skips any that cannot be
read, saying so. Only the newest ``keep`` files are kept. Files are loaded with
``weights_only=True``: a checkpoint on a shared file system is not trusted to run code.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any, Callable

import torch

PATTERN = re.compile(r"^ckpt-(\d{9})\.pt$")
TEMPORARY = re.compile(r"^\.ckpt-\d{9}\.pt\.tmp-\d+$")
UNREADABLE_SUFFIX = ".unreadable"
REQUIRED = ("model", "optimizer", "epoch", "step_in_epoch", "global_step", "config", "world_size")


class CheckpointError(Exception):
    """A checkpoint cannot be used (with the reason)."""


def checkpoint_dir(output_dir: str | os.PathLike[str]) -> Path:
    return Path(output_dir) / "checkpoints"


def is_finite_state(state_dict: dict[str, Any]) -> bool:
    """True when every floating tensor of a model state is finite."""
    return all(torch.isfinite(t).all() for t in state_dict.values() if torch.is_tensor(t) and t.is_floating_point())


def save(directory: Path, state: dict[str, Any], keep: int,
         before_rename: Callable[[Path], None] | None = None) -> Path:
    """Write ``state`` atomically as the newest checkpoint and prune all but the newest ``keep``.

    CheckpointError for a non-finite model; OSError when the write fails (a full disk, a quota,
    an I/O error) -- the earlier checkpoints are untouched either way.
    ``before_rename`` is a test hook that sees the complete temporary file.
    """
    if not is_finite_state(state["model"]):
        raise CheckpointError("the model has non-finite values; refusing to overwrite good checkpoints")
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"ckpt-{state['global_step']:09d}.pt"
    temporary = directory / f".{final.name}.tmp-{os.getpid()}"
    remove_stale_temporaries(directory)
    try:
        with open(temporary, "wb") as handle:
            try:
                torch.save(state, handle)
            except RuntimeError as exc:
                underlying = _os_error_behind(exc)
                if underlying is exc:
                    raise
                raise underlying from exc
            handle.flush()
            os.fsync(handle.fileno())
        if before_rename is not None:
            before_rename(temporary)
        os.replace(temporary, final)
        _fsync_directory(directory)
    finally:
        temporary.unlink(missing_ok=True)
    for old in list_checkpoints(directory)[keep:]:
        if old != final:  # never prune what was just written, whatever else the folder holds
            old.unlink(missing_ok=True)
    return final


def _os_error_behind(exc: RuntimeError) -> Exception:
    """torch's writer reports a failed write (a full disk, a quota) as "unexpected pos 704 vs 598";
    the OSError that caused it is in the exception's context, and says what happened."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, OSError):
            return cause
        cause = cause.__context__
    return exc


def remove_stale_temporaries(directory: Path) -> list[Path]:
    """Delete half-written files that a killed writer left behind (only one job writes a run directory)."""
    stale = [p for p in directory.iterdir() if TEMPORARY.match(p.name)] if directory.is_dir() else []
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable (a crash right after must not resurrect the old name)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def step_of(path: Path) -> int:
    match = PATTERN.match(path.name)
    if match is None:
        raise ValueError(f"{path.name} is not a checkpoint file name")
    return int(match.group(1))


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint files, newest first (temporary leftovers and set-aside files excluded)."""
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if PATTERN.match(p.name)), key=step_of, reverse=True)


def read(path: Path) -> dict[str, Any]:
    """Load one checkpoint, or CheckpointError saying why it is unusable."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - truncated, corrupt, or not a checkpoint at all
        reason = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
        raise CheckpointError(f"{path.name} is unreadable ({type(exc).__name__}{': ' + reason if reason else ''})") from exc
    if not isinstance(state, dict) or any(key not in state for key in REQUIRED):
        raise CheckpointError(f"{path.name} is not an hpcdl checkpoint")
    return state


def load_latest(directory: Path, set_aside: bool = False) -> tuple[dict[str, Any] | None, Path | None]:
    """The newest readable checkpoint and its path; unreadable newer ones are reported and skipped.

    With ``set_aside``, the unreadable files newer than the one loaded are renamed ``*.unreadable``
    (kept for inspection, reversible): otherwise they would still count as "newest" and pruning
    would delete the good checkpoints the resumed run writes. When no file is readable nothing
    is renamed and the result is ``(None, None)``.
    """
    skipped: list[Path] = []
    for path in list_checkpoints(directory):
        try:
            state = read(path)
        except CheckpointError as exc:
            print(f"hpcdl: skipping checkpoint: {exc}", file=sys.stderr, flush=True)
            skipped.append(path)
            continue
        if set_aside:
            for bad in skipped:
                bad.rename(bad.with_name(bad.name + UNREADABLE_SUFFIX))
                print(f"hpcdl: set {bad.name} aside as {bad.name + UNREADABLE_SUFFIX}", file=sys.stderr, flush=True)
        return state, path
    return None, None
