"""Run state: what a checkpoint holds, its format, and what resuming means. Described here once.

A checkpoint (``<run>/checkpoints/ckpt-<step>.pt``, written atomically by :mod:`hpcdl.checkpoint`)
is a dict with:

==================  ===========================================================================
``format``          ``"hpcdl.train checkpoint"`` (a file from another program is refused)
``format_version``  :data:`FORMAT_VERSION` (a file of another version is refused, one line)
``run_id``          the run that wrote it
``global_step``     optimizer steps taken (also the file name)
``world_size``      ranks that wrote it (a resume on another size rescales, see below)
``config``          the whole :class:`~hpcdl.config.TrainConfig` of that run, as a dict
``progress``        :class:`Progress`: epoch, position in it, best accuracy, timings, stop reason
``model``           rank 0's model state (parameters are identical on every rank)
``optimizer``       the optimizer state (momentum buffers, Adam moments)
``scaler``          the fp16 GradScaler state, or None
``kfac``            the K-FAC preconditioner state, or None
``rng``             every rank's torch/CUDA/Python random state (exact mid-epoch continuation)
==================  ===========================================================================

Resuming (``--resume``) is defined by three lists. :data:`MUST_MATCH`: fields that change what is
being trained; a mismatch is refused with one line naming each. Everything else MAY change: the
new value is applied to the restored state (an optimizer hyperparameter is written into the
restored param groups) and recorded in the run's ``resumed_with_changes``. A run that already
stopped for good (:data:`FINAL_REASONS`) is not trained further unless its stop condition was
extended (more epochs or steps, a higher target).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hpcdl.run import checkpoint
from hpcdl.runtime.errors import UsageError, agree, describe
from hpcdl.training.config import TrainConfig, option_name

if TYPE_CHECKING:
    from hpcdl.training.job import Job

FORMAT = "hpcdl.train checkpoint"
FORMAT_VERSION = 2
MUST_MATCH = ("dataset", "model", "optimizer", "synthetic_shape", "synthetic_classes")
FINAL_REASONS = ("epochs", "max_steps", "target_accuracy")
OPTIMIZER_FIELDS = {"weight_decay": "weight_decay", "momentum": "momentum", "nesterov": "nesterov"}


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint."""

    epoch: int = 0  # the epoch being trained (or next to train)
    step_in_epoch: int = 0  # optimizer steps already taken in that epoch
    global_step: int = 0
    best_accuracy: float = 0.0
    time_to_target: float | None = None
    train_seconds: float = 0.0  # training time so far (evaluation and checkpoints excluded), all sessions
    elapsed_seconds: float = 0.0  # wall time of training and evaluation so far, all sessions
    images_seen: int = 0  # training images, all ranks, all sessions
    epochs_completed: int = 0
    nonfinite_streak: int = 0
    epoch_sums: dict[str, float] = field(default_factory=dict)  # of a part-trained epoch, all ranks
    last_test: dict[str, float] = field(default_factory=dict)  # test loss and accuracy after the last epoch
    stop_reason: str | None = None  # epochs, max_steps, target_accuracy, a signal name; None while running
    resumed_with_changes: list[str] = field(default_factory=list)


def snapshot(job: Job, rng: list[dict[str, Any]]) -> dict[str, Any]:
    """The checkpoint of ``job`` as it stands (rank 0; ``rng`` gathered from every rank)."""
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "run_id": job.run_id,
        "global_step": job.progress.global_step,
        "world_size": job.world.size,
        "config": dataclasses.asdict(job.config),
        "progress": dataclasses.asdict(job.progress),
        "model": job.bare_model.state_dict(),
        "optimizer": job.optimizer.state_dict(),
        "scaler": job.scaler.state_dict() if job.scaler is not None else None,
        "kfac": job.preconditioner.state_dict() if job.preconditioner is not None else None,
        "rng": rng,
    }


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(job: Job) -> None:
    """Write the checkpoint (collective: every rank gives its RNG state; rank 0 writes).

    A failed write (disk full, quota, permissions) ends the job on every rank with one line naming
    the path: the earlier checkpoints are intact, and training on without saving would only lose more.
    """
    job.watchdog.beat(phase="checkpoint" if job.world.is_root else "collective")
    rng = job.comm.gather(rng_state(), root=0)
    problem = None
    if job.world.is_root:
        directory = checkpoint.checkpoint_dir(job.output_dir)
        try:
            checkpoint.save(directory, snapshot(job, rng), job.config.keep_checkpoints,
                            before_rename=job.faults.while_saving(job.progress.global_step), run_id=job.run_id)
        except checkpoint.CheckpointError as exc:
            print(f"hpcdl: not saving: {exc}", flush=True)  # the non-finite check stops the run
        except (OSError, RuntimeError) as exc:  # torch reports a failed write (e.g. ENOSPC) as RuntimeError
            problem = (f"could not write the checkpoint of step {job.progress.global_step} to {directory} "
                       f"({describe(exc)}); the earlier checkpoints are intact: free space or fix the file system, "
                       "then --resume")
    problem = job.comm.bcast(problem, root=0)
    job.watchdog.beat()
    if problem:
        raise UsageError(problem)


def read_latest(output_dir: Path, comm) -> dict[str, Any] | None:
    """Rank 0 reads the newest readable checkpoint, checks its format, and broadcasts it (None: there is none)."""

    def on_root() -> dict[str, Any] | None:
        if comm.Get_rank() != 0:
            return None
        directory = checkpoint.checkpoint_dir(output_dir)
        found = checkpoint.list_checkpoints(directory)
        state, path = checkpoint.load_latest(directory, set_aside=True)
        if state is None and found:
            raise UsageError(f"none of the {len(found)} checkpoint(s) in {directory} is readable (see above); "
                             "move them away to start from scratch")
        if state is not None:
            check_format(state, path)
            print(f"resuming from {path}", flush=True)
        return state

    return comm.bcast(agree(on_root), root=0)


def check_format(state: Any, path: Path | None) -> None:
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UsageError(f"{path} is not an hpcdl.train checkpoint (written by another program or an hpcdl "
                         f"before checkpoint format {FORMAT_VERSION}); move it away or use another --output-dir")
    if state.get("format_version") != FORMAT_VERSION:
        raise UsageError(f"{path} has checkpoint format {state.get('format_version')}, this hpcdl reads format "
                         f"{FORMAT_VERSION}; resume it with the hpcdl version that wrote it")


def resume_changes(saved: dict[str, Any], config: TrainConfig) -> list[str]:
    """What differs between the checkpoint's configuration and this one; UsageError for what may not."""
    now = dataclasses.asdict(config)
    mismatches = [f"{option_name(k)} {saved.get(k)} (checkpoint) vs {now[k]} (now)" for k in MUST_MATCH
                  if saved.get(k) != now[k]]
    if mismatches:
        raise UsageError("cannot resume: the checkpoint was trained with " + "; ".join(mismatches)
                         + " (use another --output-dir for a different run)")
    ignore = {"resume", "output_dir"}
    return [f"{option_name(k)} {saved.get(k)} -> {now[k]}" for k in now
            if k not in ignore and k in saved and saved[k] != now[k]]


def stop_condition_extended(saved: dict[str, Any], config: TrainConfig, progress: Progress) -> bool:
    """True when the flags let a run that stopped for ``progress.stop_reason`` train further."""
    reason = progress.stop_reason
    if reason == "epochs":
        return config.epochs > progress.epochs_completed
    if reason == "max_steps":
        return config.max_steps is None or config.max_steps > progress.global_step
    if reason == "target_accuracy":
        return config.target_accuracy is None or config.target_accuracy > progress.best_accuracy
    return True


def restore(job: Job, state: dict[str, Any]) -> Progress:
    """Load ``state`` into the job on every rank; apply and record what the flags changed."""
    changes = resume_changes(state["config"], job.config)

    def load() -> None:
        try:
            job.bare_model.load_state_dict(state["model"])
            job.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise UsageError(f"the checkpoint in {job.output_dir} does not fit this model: "
                             f"{str(exc).splitlines()[0]}") from exc

    agree(load)
    for group in job.optimizer.param_groups:  # what may change takes effect on the restored state
        for name, key in OPTIMIZER_FIELDS.items():
            if key in group:
                group[key] = getattr(job.config, name)
    if job.preconditioner is not None and state.get("kfac") is not None:
        job.preconditioner.load_state_dict(state["kfac"])
    if job.scaler is not None and state.get("scaler") is not None:
        job.scaler.load_state_dict(state["scaler"])
    progress = Progress(**state["progress"])
    progress.resumed_with_changes = progress.resumed_with_changes + changes
    if changes:
        job.print0("resuming with changed flags: " + "; ".join(changes))
    saved = state["config"]
    saved_batch = state["world_size"] * saved["batch_size"] * saved["batches_per_allreduce"]
    batch = job.world.size * job.config.batch_size * job.config.batches_per_allreduce
    if state["world_size"] == job.world.size and saved_batch == batch:
        set_rng_state(state["rng"][job.world.rank])
    else:
        job.print0(
            f"checkpoint was written by {state['world_size']} rank(s) with global batch {saved_batch}, resuming on "
            f"{job.world.size} with global batch {batch}: learning rate rescaled, position in the epoch kept by "
            "sample count (an exact continuation needs the same ranks and batch size)")
        progress.step_in_epoch = progress.step_in_epoch * saved_batch // batch
    return progress
