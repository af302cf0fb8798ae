"""A run directory belongs to one run at a time.

Two runs given the same ``--output-dir`` would silently replace each other's checkpoints and
summary, and one's clean-up could delete the other's half-written files. :func:`claim` makes the
directory this run's own:

* **The lock** is a file, ``.hpcdl.lock``, holding the run id, host, pid, Slurm job and start
  time. It is created with ``link()`` from a complete temporary file: ``link`` is atomic on every
  NFS version, Lustre and GPFS (``O_CREAT|O_EXCL`` only from NFSv3 on), and a reader never sees a
  half-written lock. Where a file system has no hard links, ``O_CREAT|O_EXCL`` is the fallback.
* **It goes away with a dead run.** Rank 0 touches the lock every :data:`HEARTBEAT_SECONDS` from
  a daemon thread. A lock is stale when its process is gone (same host), when its Slurm job is a
  later incarnation of ours (``--requeue``), or when its heartbeat is older than
  :data:`STALE_AFTER_SECONDS` -- measured against the file server's clock, not ours, since hosts'
  clocks differ and NFS stamps files with the server's time. A stale lock is taken over with one
  printed line; a live one refuses the new run with one line naming its holder.
* **Every node sees it.** Every rank looks for rank 0's lock (:func:`check_shared`): a directory
  on node-local storage would keep the run on one node only, and is refused with one line.
* **Run ids in temporary names.** Every temporary a run writes is named
  ``.<final name>.tmp-<run id>`` (:func:`temporary_path`), so clean-up touches only this run's
  files, and the leftovers of a run proved dead when its lock is taken over.

Default directories are ``runs/<YYYYmmdd-HHMMSS>-<suffix>`` where the suffix carries the Slurm
job id (when there is one) and random hex, created with ``mkdir(exist_ok=False)`` and retried, so
jobs started in the same second never share one.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import re
import secrets
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any

from hpcdl.runtime.errors import LockHeldError, UsageError, rank0_then_all
from hpcdl.runtime.processes import pid_alive

LOCK_NAME = ".hpcdl.lock"
HEARTBEAT_SECONDS = 20.0
# NFS clients cache file attributes for up to 60 s (actimeo): a live lock may look that old elsewhere.
STALE_AFTER_SECONDS = 180.0
# How long a rank looks for rank 0's lock before calling the directory not shared (NFS caches
# a name's absence for a few seconds; this is paid only when the directory is refused).
SHARED_WITHIN_SECONDS = 10.0
DEFAULT_PARENT = Path("runs")
_TEMPORARY = re.compile(r"^\..+\.tmp-(?P<run_id>[A-Za-z0-9_-]+)$")


def new_run_id(now: datetime | None = None) -> str:
    """Unique across hosts and time: timestamp, host, pid and random bits (safe in file names)."""
    stamp = (now or datetime.now()).strftime("%Y%m%dT%H%M%S")
    host = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname().split(".")[0])[:24] or "host"
    return f"{stamp}-{host}-{os.getpid()}-{secrets.token_hex(3)}"


def temporary_path(final: Path, run_id: str) -> Path:
    """Where ``run_id`` writes ``final`` before renaming it into place (hidden, named after the run)."""
    return final.with_name(f".{final.name}.tmp-{run_id}")


def run_of_temporary(path: Path) -> str | None:
    """The run id in a temporary file's name, or None for any other file."""
    match = _TEMPORARY.match(path.name)
    return match.group("run_id") if match else None


def remove_temporaries(directory: Path, run_id: str) -> list[Path]:
    """Delete the temporaries of one run below ``directory`` (never another run's)."""
    if not directory.is_dir():
        return []
    removed = []
    for path in directory.rglob(f"*.tmp-{run_id}"):
        if run_of_temporary(path) == run_id and path.is_file():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)
    return removed


def default_directory(parent: Path = DEFAULT_PARENT, now: datetime | None = None, attempts: int = 50) -> Path:
    """Create and return a new ``parent/<YYYYmmdd-HHMMSS>-<suffix>`` that no other run has.

    ``mkdir(exist_ok=False)`` is atomic on every POSIX file system, NFS included, so of two jobs
    that draw the same name one gets EEXIST and draws again.
    """
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    job = os.environ.get("SLURM_JOB_ID", "").strip()
    job_part = f"j{job}-" if job.isdigit() else ""
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create run directories under {parent} ({exc.strerror or exc})") from None
    for _ in range(attempts):
        candidate = parent / f"{stamp}-{job_part}{_random_suffix()}"
        try:
            candidate.mkdir(exist_ok=False)
            return candidate
        except FileExistsError:
            continue
        except OSError as exc:
            raise UsageError(f"cannot create run directory {candidate} ({exc.strerror or exc})") from None
    raise UsageError(f"could not find a free run directory name under {parent} after {attempts} tries")


def _random_suffix() -> str:
    return secrets.token_hex(3)


@dataclass(frozen=True)
class Holder:
    """What a lock file says about the run that holds it."""

    run_id: str
    host: str
    pid: int
    started: str
    program: str = ""
    slurm_job_id: str = ""
    slurm_restart_count: int = 0

    @classmethod
    def me(cls, run_id: str, program: str) -> Holder:
        restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
        return cls(run_id, socket.gethostname(), os.getpid(), datetime.now().astimezone().isoformat(timespec="seconds"),
                   program, os.environ.get("SLURM_JOB_ID", ""), int(restarts) if restarts.isdigit() else 0)

    def describe(self) -> str:
        return f"run {self.run_id} (host {self.host}, pid {self.pid}, started {self.started})"


def _read_lock(lock: Path) -> tuple[Holder | None, float]:
    """The holder (None when the file is unreadable or garbled) and the lock's modification time.

    Opening the file makes an NFS client revalidate its attributes (close-to-open consistency),
    so the mtime read through the open descriptor is the server's, not a cached one.
    """
    fd = os.open(lock, os.O_RDONLY)
    try:
        mtime = os.fstat(fd).st_mtime
        raw = os.read(fd, 1 << 16)
    finally:
        os.close(fd)
    try:
        data = json.loads(raw.decode())
        return Holder(**{k: data[k] for k in Holder.__dataclass_fields__ if k in data}), mtime
    except (ValueError, TypeError, UnicodeDecodeError):
        return None, mtime


def _file_system_now(directory: Path, run_id: str) -> float:
    """The current time on the clock that stamps files in ``directory`` (the file server's on NFS)."""
    probe = directory / f".clock.tmp-{run_id}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            return os.fstat(fd).st_mtime
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    except OSError:
        return time.time()


def stale_reason(holder: Holder | None, age: float, stale_after: float) -> str | None:
    """Why a lock no longer protects a live run, or None when its holder may still be running."""
    if holder is not None:
        same_host = holder.host == socket.gethostname()
        if same_host and holder.pid != os.getpid() and not pid_alive(holder.pid):
            return f"its process {holder.pid} on {holder.host} is gone"
        job = os.environ.get("SLURM_JOB_ID", "")
        restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
        if (job and holder.slurm_job_id == job and restarts.isdigit()
                and holder.slurm_restart_count < int(restarts)):
            return f"Slurm requeued job {job} since (restart {holder.slurm_restart_count} -> {restarts})"
    if age > stale_after:
        return f"no heartbeat for {age:.0f} s (stale after {stale_after:.0f} s)"
    return None


class RunDir:
    """This run's claim on its directory: ``.path``, ``.run_id``; :meth:`release` (or ``with``) ends it."""

    def __init__(self, path: Path, run_id: str, owner: bool, heartbeat_seconds: float) -> None:
        self.path = path
        self.run_id = run_id
        self.lock = path / LOCK_NAME
        self.lost: str | None = None  # set when another run took the lock over (our heartbeat failed)
        self._owner = owner  # rank 0 holds the lock file; other ranks only know the id
        self._pid = os.getpid()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if owner:
            self._thread = threading.Thread(target=self._beat, args=(heartbeat_seconds,), name="hpcdl-lock-heartbeat",
                                            daemon=True)
            self._thread.start()
            atexit.register(self.release)

    def _beat(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                holder, _ = _read_lock(self.lock)
            except OSError as exc:
                if exc.errno == errno.ENOENT:
                    self._lose("the lock file was removed")
                continue  # a file-system hiccup: try again next beat
            if holder is None or holder.run_id != self.run_id:
                self._lose(f"now held by {holder.describe() if holder else 'an unreadable lock'}")
                continue
            with contextlib.suppress(OSError):
                os.utime(self.lock)

    def _lose(self, why: str) -> None:
        if self.lost is None:
            self.lost = why
            print(f"hpcdl: warning: run {self.run_id} lost the lock on {self.path}: {why}", file=sys.stderr, flush=True)

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still ours (any rank may call it, any number of times)."""
        if not self._owner or os.getpid() != self._pid:  # a forked child (a DataLoader worker) owns nothing
            return
        self._owner = False
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with contextlib.suppress(OSError):
            holder, _ = _read_lock(self.lock)
            if holder is not None and holder.run_id == self.run_id:
                self.lock.unlink()
        with contextlib.suppress(ValueError):
            atexit.unregister(self.release)

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


def _create_lock(lock: Path, holder: Holder) -> bool:
    """Atomically create ``lock`` with ``holder`` in it; False when another lock is already there."""
    content = json.dumps(holder.__dict__, indent=1).encode() + b"\n"
    staging = temporary_path(lock, holder.run_id)
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, content)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(staging, lock)
        return True
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            # NFS may report a failed link whose retransmission in fact succeeded: the link count says.
            with contextlib.suppress(OSError):
                if os.stat(staging).st_nlink == 2:
                    return True
            raise
        return _create_exclusive(lock, content)  # no hard links on this file system
    finally:
        staging.unlink(missing_ok=True)


def _create_exclusive(lock: Path, content: bytes) -> bool:
    try:
        fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, content)
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def _take_over(lock: Path, seen: Holder | None, me: Holder) -> bool:
    """Move a stale lock out of the way; False when it changed under us (someone else took it first)."""
    aside = lock.with_name(f"{lock.name}.stale-{me.run_id}")
    try:
        os.rename(lock, aside)
    except FileNotFoundError:
        return False
    try:
        moved, _ = _read_lock(aside)
    except OSError:
        moved = None
    if seen is not None and (moved is None or moved.run_id != seen.run_id):
        # We moved a lock that a faster run created after the stale one: put it back.
        with contextlib.suppress(OSError):
            os.link(aside, lock)
        aside.unlink(missing_ok=True)
        return False
    aside.unlink(missing_ok=True)
    return True


def acquire(path: Path, run_id: str, program: str, resume: bool,
            stale_after: float = STALE_AFTER_SECONDS) -> None:
    """Create this run's lock in ``path`` (rank 0's part of :func:`claim`); LockHeldError when a live run holds it."""
    lock = path / LOCK_NAME
    me = Holder.me(run_id, program)
    for _ in range(5):
        try:
            if _create_lock(lock, me):
                return
            holder, mtime = _read_lock(lock)
        except FileNotFoundError:
            continue  # released between our attempt and our look: try again
        except OSError as exc:
            raise UsageError(f"output directory {path} is not writable ({exc.strerror or exc})") from None
        age = _file_system_now(path, run_id) - mtime
        reason = stale_reason(holder, age, stale_after)
        if reason is None:
            who = holder.describe() if holder else f"a run whose lock file {lock} is unreadable"
            hint = " (--resume continues a run only after it has stopped)" if resume else ""
            raise LockHeldError(f"output directory {path} is in use by {who}, last heartbeat {max(age, 0):.0f} s ago; "
                             f"wait for it to end, stop it, or choose another --output-dir{hint}")
        if _take_over(lock, holder, me):
            dead = holder.describe() if holder else "an unreadable lock"
            print(f"{program}: taking over {path} from {dead}: {reason}", file=sys.stderr, flush=True)
            if holder is not None:
                remove_temporaries(path, holder.run_id)
    raise LockHeldError(f"could not lock output directory {path}: other runs keep taking it; try again")


def claim(output_dir: str | os.PathLike[str] | None, comm: Any, resume: bool, program: str = "hpcdl.train",
          heartbeat_seconds: float = HEARTBEAT_SECONDS, stale_after: float = STALE_AFTER_SECONDS,
          visible_within: float = SHARED_WITHIN_SECONDS) -> RunDir:
    """Make a run directory this run's own (collective: every rank calls it).

    Rank 0 creates the directory (a new default one when ``output_dir`` is None), takes the lock
    and broadcasts the outcome, so every rank gets the same RunDir or the same error (UsageError,
    LockHeldError). Then every rank checks that it sees the directory (:func:`check_shared`).
    ``comm`` may be None for a single process.
    """

    def on_root() -> tuple[str, str, bool]:
        run_id = new_run_id()
        if output_dir is None:
            path, created = default_directory(), True
        else:
            path = Path(output_dir)
            if path.exists() and not path.is_dir():
                raise UsageError(f"output directory {path} is a file, not a directory")
            created = not path.exists()
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise UsageError(f"output directory {path} is not writable ({exc.strerror or exc})") from None
        acquire(path, run_id, program, resume, stale_after)
        return str(path), run_id, created

    where, run_id, created = rank0_then_all(on_root, comm)
    is_root = comm is None or comm.Get_rank() == 0
    run = RunDir(Path(where), run_id, owner=is_root, heartbeat_seconds=heartbeat_seconds)
    if comm is not None and comm.Get_size() > 1:
        try:
            check_shared(run, comm, visible_within)
        except UsageError:
            run.release()
            if is_root and created:
                with contextlib.suppress(OSError):
                    run.path.rmdir()  # only if still empty: nothing of the user's is removed
            raise
    return run


def sees_lock(run: RunDir, within: float) -> bool:
    """Whether this process sees ``run``'s lock file, polling ``within`` seconds.

    Polling covers a network file system's caches: a client that looked the name up before it
    existed may keep that negative answer for a few seconds.
    """
    deadline = time.monotonic() + within
    while True:
        try:
            holder, _ = _read_lock(run.lock)
            if holder is not None and holder.run_id == run.run_id:
                return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)


def check_shared(run: RunDir, comm: Any, within: float = SHARED_WITHIN_SECONDS) -> None:
    """Refuse a run directory that some ranks cannot see (collective: every rank calls it).

    Only rank 0 writes, but every rank must be able to read what it wrote (a resumed run's
    checkpoint, the lock) and a resume elsewhere must find it: a directory on node-local storage
    (/tmp, a node's local disk) would leave the run's files on one node only. Every rank looks for
    rank 0's lock, and all raise the same UsageError, naming the nodes that could not see it.
    """
    seen = comm.allgather((socket.gethostname(), sees_lock(run, within)))
    blind: dict[str, list[int]] = {}
    for rank, (host, ok) in enumerate(seen):
        if not ok:
            blind.setdefault(host, []).append(rank)
    if blind:
        where = "; ".join(f"{host} (ranks {', '.join(map(str, ranks))})" for host, ranks in blind.items())
        raise UsageError(f"output directory {run.path} is not shared by every node: {where} cannot see the files "
                         f"rank 0 wrote there (node-local storage?); put --output-dir on a file system every "
                         f"node mounts, e.g. $SCRATCH or $WORK")
