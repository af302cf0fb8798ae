"""Saving and restoring a run's stateful parts over the communicator; the checkpointer sees nothing else.

A part is anything with ``state_dict()`` and ``load_state_dict()``: a model, an optimizer, a
GradScaler, a K-FAC preconditioner, the run's progress. A checkpoint is one dict: the caller's
header (what the file is and what produced it), ``run_id``, ``global_step``, ``world_size``, each
part's state under its name (None for a part the run does not have) and every rank's random
state under ``rng``. What the parts mean, and what a resume may change, is the caller's business
(:mod:`hpcdl.training.runstate` for training). Files are written by :mod:`hpcdl.persistence.checkpoint_files`.

Both directions are collective: rank 0 writes or reads, every rank learns how it went, and a
failure is the same one-line error on every rank (:func:`~hpcdl.runtime.errors.rank0_then_all`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from hpcdl.persistence import checkpoint_files
from hpcdl.runtime.errors import StorageError, UsageError, describe, rank0_then_all
from hpcdl.runtime.faults import FaultInjector
from hpcdl.runtime.watchdog import StallWatchdog


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], /) -> Any: ...


def rng_state() -> dict[str, Any]:
    """This process's torch, CUDA and Python random state (what an exact continuation needs)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class Checkpointer:
    """Checkpoints of one run in ``<run>/checkpoints``, the newest ``keep`` kept."""

    def __init__(self, run_path: Path, run_id: str, comm: Any, keep: int,
                 watchdog: StallWatchdog | None = None, faults: FaultInjector | None = None) -> None:
        self.directory = checkpoint_files.checkpoint_dir(run_path)
        self.run_id = run_id
        self.comm = comm
        self.keep = keep
        self.watchdog = watchdog
        self.faults = faults

    def save(self, parts: Mapping[str, Stateful | None], header: Mapping[str, Any], global_step: int) -> None:
        """Write the checkpoint of step ``global_step`` (collective: every rank gives its RNG state; rank 0 writes).

        A failed write (disk full, quota, permissions) is a StorageError on every rank, naming the
        folder: the earlier checkpoints are intact, and training on without saving would only lose
        more. A model with non-finite values is not saved (one line); the run's own checks stop it.
        """
        is_root = self.comm.Get_rank() == 0
        if self.watchdog is not None:
            self.watchdog.beat(phase="checkpoint" if is_root else "collective")
        rng = self.comm.gather(rng_state(), root=0)

        def write() -> None:
            state = {**header, "run_id": self.run_id, "global_step": global_step, "world_size": self.comm.Get_size(),
                     **{name: part.state_dict() if part is not None else None for name, part in parts.items()},
                     "rng": rng}
            hook = self.faults.while_saving(global_step) if self.faults is not None else None
            try:
                checkpoint_files.save(self.directory, state, self.keep, before_rename=hook, run_id=self.run_id)
            except checkpoint_files.CheckpointError as exc:
                print(f"hpcdl: not saving: {exc}", flush=True)
            except (OSError, RuntimeError) as exc:  # torch reports a failed write (e.g. ENOSPC) as RuntimeError
                raise StorageError(f"could not write the checkpoint of step {global_step} to {self.directory} "
                                   f"({describe(exc)}); the earlier checkpoints are intact: free space or fix the "
                                   "file system, then --resume") from exc

        rank0_then_all(write, self.comm)
        if self.watchdog is not None:
            self.watchdog.beat()

    def read_latest(self, check: Callable[[Any, Path | None], None]) -> dict[str, Any] | None:
        """Rank 0 reads the newest readable checkpoint, ``check``s it and broadcasts it (None: there is none)."""

        def read() -> dict[str, Any] | None:
            found = checkpoint_files.list_checkpoints(self.directory)
            state, path = checkpoint_files.load_latest(self.directory, set_aside=True)
            if state is None and found:
                raise UsageError(f"none of the {len(found)} checkpoint(s) in {self.directory} is readable (see "
                                 "above); move them away to start from scratch")
            if state is not None:
                check(state, path)
                print(f"resuming from {path}", flush=True)
            return state

        return rank0_then_all(read, self.comm)


def load_parts(parts: Mapping[str, Stateful | None], state: Mapping[str, Any]) -> None:
    """Load each part the run has from the checkpoint's entry of the same name (absent or None: left as it is)."""
    for name, part in parts.items():
        if part is not None and state.get(name) is not None:
            part.load_state_dict(state[name])
