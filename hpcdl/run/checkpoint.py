"""Checkpoints that survive being killed mid-write, and results that never end up half-written.

Rank 0 writes ``checkpoints/ckpt-<global step>.pt`` through a temporary file in the same folder,
flushed to disk and then renamed: a reader sees either the old set of files or the new complete
one, never half a file. Loading walks from the newest file back and skips any that cannot be
read, saying so. Only the newest ``keep`` files are kept. Files are loaded with
``weights_only=True``: a checkpoint on a shared file system is not trusted to run code.

Temporaries are named after the run that writes them (``.ckpt-<step>.pt.tmp-<run id>``, see
:func:`hpcdl.run.rundir.temporary_path`), so a run cleans up only its own. A write that fails (a full
disk, a quota, permissions, a read-only file system) raises :class:`WriteError`, an OSError whose
message is one line naming the file and the cause; the temporary is removed and the files
already there are untouched.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from hpcdl.run.rundir import temporary_path

PATTERN = re.compile(r"^ckpt-(\d{9})\.pt$")
PID_TEMPORARY = re.compile(r"^\.ckpt-\d{9}\.pt\.tmp-\d+$")  # named by pid: writers that are not a run (demos, tools)
UNREADABLE_SUFFIX = ".unreadable"
REQUIRED = ("model", "global_step")  # the rest of the layout is hpcdl.training.runstate's (format, version)

# What to do about each common write failure (the OS's own words come first, e.g. "No space left on device").
_ADVICE = {
    errno.ENOSPC: "free space there or choose another --output-dir",
    errno.EDQUOT: "check your quota (quota -s, lfs quota -u $USER <mount>) or choose another --output-dir",
    errno.EACCES: "choose a directory you may write",
    errno.EPERM: "choose a directory you may write",
    errno.EROFS: "choose a writable --output-dir",
    errno.EIO: "the file system or disk failed; check it before going on",
    errno.ENOTDIR: "a component of the path is a file",
}


class CheckpointError(Exception):
    """A checkpoint cannot be used (with the reason)."""


class WriteError(OSError):
    """Writing ``path`` failed; ``str()`` is one line naming the file and the cause.

    An OSError (with the original errno) so that callers catching OSError keep working.
    """

    def __init__(self, path: Path, cause: OSError) -> None:
        super().__init__(cause.errno, cause.strerror, str(path))
        self.path = path
        self.cause = cause

    def __str__(self) -> str:
        return f"cannot write {self.path}: {explain(self.cause)}"


def explain(error: OSError) -> str:
    """``No space left on device (ENOSPC): free space there ...``: the OS's words, the code, what to do."""
    name = errno.errorcode.get(error.errno or 0, "")
    words = error.strerror or (os.strerror(error.errno) if error.errno else str(error))
    advice = _ADVICE.get(error.errno or 0)
    return f"{words}{f' ({name})' if name else ''}{f': {advice}' if advice else ''}"


def checkpoint_dir(output_dir: str | os.PathLike[str]) -> Path:
    return Path(output_dir) / "checkpoints"


def is_finite_state(state_dict: dict[str, Any]) -> bool:
    """True when every floating tensor of a model state is finite."""
    return all(torch.isfinite(t).all() for t in state_dict.values() if torch.is_tensor(t) and t.is_floating_point())


def write_atomically(final: Path, write: Callable[[IO[bytes]], object], run_id: str | None = None,
                     before_rename: Callable[[Path], None] | None = None) -> Path:
    """Write ``final`` through a temporary file, fsync it, rename it into place, fsync the folder.

    A reader sees the old file or the complete new one. On any failure the temporary is removed
    and the old file stays; an OSError from the file system comes out as one-line WriteError.
    ``run_id`` names the temporary (without one, the pid does: a tool or demo is no run).
    ``before_rename`` is a test hook that sees the complete temporary file.
    """
    temporary = temporary_path(final, run_id) if run_id else final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        _write_file(temporary, final, write)
        if before_rename is not None:
            before_rename(temporary)
        try:
            os.replace(temporary, final)
        except OSError as exc:
            raise WriteError(final, exc) from exc
        _fsync_directory(final.parent)
    finally:
        try:
            temporary.unlink(missing_ok=True)
        except OSError as exc:
            print(f"hpcdl: warning: could not remove the temporary {temporary} ({exc.strerror})", file=sys.stderr,
                  flush=True)
    return final


def _write_file(temporary: Path, final: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Write and fsync ``temporary``; any file-system error becomes a WriteError about ``final``."""
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError as exc:
        raise WriteError(final, exc) from exc
    handle = os.fdopen(fd, "wb")
    try:
        write(handle)
        handle.flush()
        os.fsync(handle.fileno())
    except RuntimeError as exc:
        underlying = _os_error_behind(exc)
        if not isinstance(underlying, OSError):
            raise
        raise WriteError(final, underlying) from exc
    except OSError as exc:
        raise WriteError(final, exc) from exc
    finally:
        # After a successful fsync nothing is left to flush; after a failure, closing fails the same way.
        with contextlib.suppress(OSError):
            handle.close()


def write_text_atomically(path: Path, text: str, run_id: str | None = None) -> Path:
    """:func:`write_atomically` for a small text file (summary.json, metrics.jsonl)."""
    data = text.encode()
    return write_atomically(path, lambda handle: handle.write(data), run_id)


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


def _os_error_behind(exc: RuntimeError) -> BaseException:
    """torch's writer reports a failed write (a full disk, a quota) as "unexpected pos 704 vs 598";
    the OSError that caused it is in the exception's context, and says what happened."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, OSError):
            return cause
        cause = cause.__context__
    return exc


def remove_stale_temporaries(directory: Path, run_id: str | None = None) -> list[Path]:
    """Delete half-written checkpoint files that this run left behind (a write it abandoned).

    With a ``run_id``, only that run's temporaries: another run's may be in the middle of a write
    (the leftovers of a dead run are removed when its lock is taken over, hpcdl.run.rundir). Without
    one, the pid-named temporaries that writers outside a run leave.
    """
    if not directory.is_dir():
        return []
    if run_id:
        stale = [p for p in directory.iterdir() if p.name.startswith(".ckpt-") and p.name.endswith(f".tmp-{run_id}")]
    else:
        stale = [p for p in directory.iterdir() if PID_TEMPORARY.match(p.name)]
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
