"""Outputs of the tools end complete or absent, never on top of their own input.

A tool builds its output in a folder beside the target (``.NAME.partial-HOST-PID``, made with the
modes the umask asks for, so a group-shared /scratch copy stays readable to the group) and renames
it into place at the end. SIGTERM (scancel, Slurm's time limit) unwinds like Ctrl-C so the partial
folder is removed; what a SIGKILL leaves behind is removed by the next run writing the same target,
once the process named in the folder's name is gone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import FrameType

from hpcdl.runtime.errors import UsageError
from hpcdl.runtime.processes import pid_alive

EXIT_TERMINATED = 128 + signal.SIGTERM


def refuse_own_input(output: Path, inputs: Mapping[str, Path], output_flag: str = "--output") -> None:
    """One line if ``output`` is an input, holds one, or lies inside one: writing it would destroy the input."""
    target = output.expanduser().resolve()
    for flag, given in inputs.items():
        source = given.expanduser().resolve()
        if target == source:
            where = "is"
        elif target in source.parents:
            where = "contains"
        elif source in target.parents:
            where = "is inside"
        else:
            continue
        raise UsageError(f"{output_flag} {output} {where} {flag} {given}: writing there would overwrite the input; "
                         f"choose an {output_flag} outside it")


def writable_parent(output: Path, output_flag: str = "--output") -> None:
    """One line, before any long work, if ``output``'s folder cannot be made or written."""
    parent = output.expanduser().absolute().parent
    existing = parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{output_flag} {output}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{output_flag} {output}: {existing} is not writable")


def _marker(output: Path, kind: str) -> str:
    return f".{output.name}.{kind}-"


def _owner_gone(name: str, prefix: str) -> bool:
    """Whether the process named in ``PREFIX HOST-PID`` ran on this host and has ended."""
    host, _, pid = name[len(prefix):].rpartition("-")
    if host != socket.gethostname() or not pid.isdigit():
        return False  # another host's run, or not ours: it may still be going
    # a folder of our own pid is a leftover of an earlier process that had it
    return not pid_alive(int(pid)) or int(pid) == os.getpid()


def sweep_stale(output: Path) -> list[str]:
    """Remove the partial folders of dead runs writing ``output``; put back an old output a run had set
    aside when it died between its two renames. Returns one description per folder handled."""
    done: list[str] = []
    if not output.parent.is_dir():
        return done
    for kind in ("old", "partial"):  # old first: a set-aside output comes back before anything is removed
        prefix = _marker(output, kind)
        for leftover in sorted(output.parent.glob(prefix + "*")):
            if not _owner_gone(leftover.name, prefix):
                continue
            if kind == "old" and not output.exists():
                os.rename(leftover, output)
                done.append(f"put back {output} from an interrupted replacement ({leftover.name})")
            else:
                shutil.rmtree(leftover, ignore_errors=True)
                done.append(f"removed {leftover.name} left by an interrupted run")
    return done


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(EXIT_TERMINATED)


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Within the block SIGTERM raises SystemExit(143), so ``finally`` and ``except`` clauses clean up."""
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def staged_folder(output: Path, replace: bool) -> Iterator[Path]:
    """An empty folder beside ``output`` that becomes ``output`` when the block ends without an error.

    ``replace``: an existing ``output`` is set aside, the new one renamed in, then the old one
    removed; a run killed in between leaves the old one for :func:`sweep_stale` to put back.
    """
    output.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{socket.gethostname()}-{os.getpid()}"
    staging = output.parent / (_marker(output, "partial") + tag)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()  # mode 0777 less the umask, like any folder the user makes
    with sigterm_unwinds():
        try:
            yield staging
            if output.exists() and replace:
                retired = output.parent / (_marker(output, "old") + tag)
                os.rename(output, retired)
                os.rename(staging, output)
                shutil.rmtree(retired)
            else:
                os.rename(staging, output)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
