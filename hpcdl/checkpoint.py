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
from typing import Any

import torch

PATTERN = re.compile(r"^ckpt-(\d{9})\.pt$")
REQUIRED = ("model", "optimizer", "epoch", "step_in_epoch", "global_step", "config", "world_size")


class CheckpointError(Exception):
    """A checkpoint cannot be used (with the reason)."""


def checkpoint_dir(output_dir: str | os.PathLike[str]) -> Path:
    return Path(output_dir) / "checkpoints"


def is_finite_state(state_dict: dict[str, Any]) -> bool:
    """True when every floating tensor of a model state is finite."""
    return all(torch.isfinite(t).all() for t in state_dict.values() if torch.is_tensor(t) and t.is_floating_point())


def save(directory: Path, state: dict[str, Any], keep: int) -> Path:
    """Write ``state`` atomically as the newest checkpoint and prune all but the newest ``keep``."""
    if not is_finite_state(state["model"]):
        raise CheckpointError("the model has non-finite values; refusing to overwrite good checkpoints")
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"ckpt-{state['global_step']:09d}.pt"
    temporary = directory / f".{final.name}.tmp-{os.getpid()}"
    try:
        with open(temporary, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, final)
        _fsync_directory(directory)
    finally:
        temporary.unlink(missing_ok=True)
    for old in list_checkpoints(directory)[keep:]:
        old.unlink(missing_ok=True)
    return final


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


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint files, newest first (temporary leftovers excluded)."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if PATTERN.match(p.name)]
    return sorted(found, key=lambda p: int(PATTERN.match(p.name).group(1)), reverse=True)  # type: ignore[union-attr]


def read(path: Path) -> dict[str, Any]:
    """Load one checkpoint, or CheckpointError saying why it is unusable."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - truncated, corrupt, or not a checkpoint at all
        raise CheckpointError(f"{path.name} is unreadable ({type(exc).__name__})") from exc
    if not isinstance(state, dict) or any(key not in state for key in REQUIRED):
        raise CheckpointError(f"{path.name} is not an hpcdl checkpoint")
    return state


def load_latest(directory: Path) -> tuple[dict[str, Any] | None, Path | None]:
    """The newest readable checkpoint and its path; unreadable newer ones are reported and skipped."""
    for path in list_checkpoints(directory):
        try:
            return read(path), path
        except CheckpointError as exc:
            print(f"hpcdl: skipping checkpoint: {exc}", file=sys.stderr, flush=True)
    return None, None
