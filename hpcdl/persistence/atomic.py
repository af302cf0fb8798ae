"""Files that are either the old version or the complete new one, never half-written.

Every file hpcdl writes for a user (checkpoints, metrics, summaries, plots, benchmark results) goes
through :func:`write_atomically`: a temporary file in the same folder, flushed to disk, renamed into
place, the folder flushed too. A failed write (a full disk, a quota, permissions, a read-only file
system) is a :class:`WriteError`, an OSError whose message is one line naming the file and the
cause; the temporary is removed and the file already there is untouched.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO

from hpcdl.persistence.rundir import temporary_path

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


def _os_error_behind(exc: RuntimeError) -> BaseException:
    """torch's writer reports a failed write (a full disk, a quota) as "unexpected pos 704 vs 598";
    the OSError that caused it is in the exception's context, and says what happened."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, OSError):
            return cause
        cause = cause.__context__
    return exc


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
