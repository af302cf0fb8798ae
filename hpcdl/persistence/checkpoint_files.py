"""Checkpoints that survive being killed mid-write, and results that never end up half-written.

Rank 0 writes ``checkpoints/ckpt-<global step>.pt`` through a temporary file in the same folder,
flushed to disk and then renamed: a reader sees either the old set of files or the new complete
one, never half a file. Loading walks from the newest file back and skips any that cannot be
read, saying so. Only the newest ``keep`` files are kept. Files are loaded with
``weights_only=True``: a checkpoint on a shared file system is not trusted to run code.

Files are written by :func:`hpcdl.persistence.atomic.write_atomically`; temporaries are named after the run
that writes them (``.ckpt-<step>.pt.tmp-<run id>``), so a run cleans up only its own.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hpcdl.persistence.atomic import WriteError, write_atomically
from hpcdl.persistence.rundir import remove_temporaries

PATTERN = re.compile(r"^ckpt-(\d{9})\.pt$")
PID_TEMPORARY = re.compile(r"^\.ckpt-\d{9}\.pt\.tmp-\d+$")  # named by pid: writers that are not a run (demos, tools)
UNREADABLE_SUFFIX = ".unreadable"
REQUIRED = ("model", "global_step")  # the rest of the layout is hpcdl.training.runstate's (format, version)

class CheckpointError(Exception):
    """A checkpoint cannot be used (with the reason)."""


def checkpoint_dir(output_dir: str | os.PathLike[str]) -> Path:
    return Path(output_dir) / "checkpoints"


def is_finite_state(state_dict: dict[str, Any]) -> bool:
    """True when every floating tensor of a model state is finite."""
    return all(torch.isfinite(t).all() for t in state_dict.values() if torch.is_tensor(t) and t.is_floating_point())


def save(directory: Path, state: dict[str, Any], keep: int,
         before_rename: Callable[[Path], None] | None = None, run_id: str | None = None) -> Path:
    """Write ``state`` atomically as the newest checkpoint and prune all but the newest ``keep``.

    CheckpointError for a non-finite model; WriteError (an OSError, one line naming the file) when
    the write fails -- the earlier checkpoints are untouched either way. ``run_id`` names the
    temporary file, and only this run's leftovers are cleaned up.
    ``before_rename`` is a test hook that sees the complete temporary file.
    """
    if not is_finite_state(state["model"]):
        raise CheckpointError("the model has non-finite values; refusing to overwrite good checkpoints")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise WriteError(directory, exc) from exc
    final = directory / f"ckpt-{state['global_step']:09d}.pt"
    remove_stale_temporaries(directory, run_id)
    write_atomically(final, lambda handle: torch.save(state, handle), run_id, before_rename)
    for old in list_checkpoints(directory)[keep:]:
        if old != final:  # never prune what was just written, whatever else the folder holds
            try:
                old.unlink(missing_ok=True)
            except OSError as exc:  # the new checkpoint is safe; an old one left over costs only space
                print(f"hpcdl: warning: could not prune {old} ({exc.strerror})", file=sys.stderr, flush=True)
    return final


def keep_as_best(directory: Path, step: int) -> Path:
    """Make ``best.pt``, beside the checkpoint folder, the checkpoint of ``step``: a hard link (checkpoints are
    never written in place), swapped in atomically; pruning the checkpoint leaves it."""
    best, source = directory.parent / "best.pt", directory / f"ckpt-{step:09d}.pt"
    if not source.exists():  # not saved (a non-finite model is refused): the best so far stays
        return best
    temporary = directory / f".best-{os.getpid()}.tmp"
    temporary.unlink(missing_ok=True)
    try:
        os.link(source, temporary)
        os.replace(temporary, best)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        raise WriteError(best, exc) from exc
    return best


def remove_stale_temporaries(directory: Path, run_id: str | None = None) -> list[Path]:
    """Delete half-written checkpoint files that this run left behind (a write it abandoned).

    With a ``run_id``, only that run's temporaries: another run's may be in the middle of a write
    (the leftovers of a dead run are removed when its lock is taken over, hpcdl.persistence.rundir). Without
    one, the pid-named temporaries that writers outside a run leave.
    """
    if not directory.is_dir():
        return []
    if run_id:
        return remove_temporaries(directory, run_id)  # the run directory's one rule for a run's temporaries
    stale = [p for p in directory.iterdir() if PID_TEMPORARY.match(p.name)]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


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
        detail = f"{type(exc).__name__}{': ' + reason if reason else ''}"
        raise CheckpointError(f"{path.name} is unreadable ({detail})") from exc
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
