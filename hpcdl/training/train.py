"""Data-parallel training with Horovod or torch.distributed: ``mpirun -np N python -m hpcdl.train [flags]``.

Read top to bottom: build the job (world, data, model, optimizer, K-FAC, run state;
hpcdl.training.job), then per epoch train (hpcdl.training.loop), evaluate on sharded test data,
record the metrics, write a checkpoint (hpcdl.training.runstate) and decide whether to stop. With
no flags it trains a small CNN on the embedded digits data. ``--help`` lists every flag.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpcdl.persistence.atomic import WriteError
from hpcdl.persistence.metrics import averages
from hpcdl.runtime.console import print0
from hpcdl.runtime.errors import DivergenceError, LostRankError, StorageError, rank0_then_all, run_main
from hpcdl.runtime.watchdog import stop_all as stop_all_watchdogs
from hpcdl.training import runstate
from hpcdl.training.backend import is_lost_rank
from hpcdl.training.config import TrainConfig, parse_config
from hpcdl.training.job import Job, opened
from hpcdl.training.loop import EpochResult, evaluate, train_one_epoch
from hpcdl.training.phases import breakdown
from hpcdl.training.task import TaskSource


@dataclass
class TrainResult:
    model: nn.Module
    summary: dict[str, Any]
    exit_code: int = 0


def train(config: TrainConfig, task: TaskSource | None = None) -> TrainResult:
    """Run (or continue) one training job on every rank of the world; ``task``: a Task or its function given
    in Python instead of ``--task``'s path (:func:`hpcdl.training.api.run`)."""
    try:
        with opened(config, task) as job:
            return train_job(job)
    except Exception as exc:  # a rank died or froze: Horovod shut down, or a torch.distributed collective failed
        if not is_lost_rank(exc):
            raise
        raise LostRankError(f"another rank of the job is gone ({str(exc).strip().splitlines()[0]})") from exc
    finally:
        stop_all_watchdogs()  # after an exception too: nothing may end this process later


def train_job(job: Job) -> TrainResult:
    """Train a built job to its stop (epochs, steps, target, signal), or say why a resumed one has nothing to do."""
    trainer, config = job.trainer, job.config
    state, progress = trainer.state, trainer.state.progress
    if job.resumed is not None:
        reached = runstate.finished(config, progress)
        if reached is not None and reached == progress.stop_reason:
            print0(f"hpcdl: run {job.resumed['run_id']} in {job.output_dir} already finished "
                   f"(stopped by {progress.stop_reason} after {progress.epochs_completed} epoch(s)); nothing to "
                   f"do. Raise {runstate.limit_flags(config)} to train further.")
            return TrainResult(state.model, {"stop_reason": progress.stop_reason, "already_finished": True})
        if reached is not None:
            print0(f"hpcdl: run {job.resumed['run_id']} in {job.output_dir} is at step {progress.global_step} "
                   f"({progress.epochs_completed} epoch(s) completed): "
                   f"{runstate.describe_limit(reached, config, progress)}; no further training")
            return TrainResult(state.model, {"stop_reason": progress.stop_reason, "already_finished": True})
        progress.stop_reason = None
        if not runstate.target_met(config, progress):
            progress.time_to_target = None  # the target of these flags is not reached yet
    progress.begin_segment(job.world.size, job.global_batch)

    while progress.stop_reason is None:
        epoch_start = time.perf_counter()
        if progress.step_in_epoch == 0:  # mid-epoch resumes restored the exact RNG state instead
            torch.manual_seed(rank_seed(config.seed, progress.epoch, job.world.rank))
        result = train_one_epoch(trainer)
        progress.add_training(result.images, result.seconds)
        train_sums = add_sums(result.train, progress.epoch_sums)
        if result.stop and not result.complete and not due_for_evaluation(job):
            progress.epoch_sums = train_sums  # so that the resumed epoch's metrics cover all of it
            progress.stop_reason = result.stop.name
            progress.elapsed_seconds += time.perf_counter() - epoch_start
            job.save()
            print0(f"hpcdl: {result.stop.describe()}: checkpoint written at step {progress.global_step}; "
                   f"continue with --resume --output-dir {job.output_dir}")
            break
        test = evaluate(trainer)
        progress.elapsed_seconds += time.perf_counter() - epoch_start
        check_finite_metrics(progress.epoch, train_sums, test)
        record_epoch(job, result, train_sums, test)
        progress.stop_reason = decide_stop(job, result)
        if result.complete or progress.stop_reason is not None:  # not at --eval-every's points inside an epoch
            job.save()
        if result.stop and progress.stop_reason in runstate.FINAL_REASONS:
            print0(f"hpcdl: {result.stop.describe()} as the run reached its end ({progress.stop_reason}): finished")
        elif result.stop and not result.complete:  # it came at an evaluation point: evaluated, then saved
            print0(f"hpcdl: {result.stop.describe()}: checkpoint written at step {progress.global_step} after its "
                   f"evaluation; continue with --resume --output-dir {job.output_dir}")
        elif result.stop:
            print0(f"hpcdl: {result.stop.describe()}: stopped after epoch {progress.epoch}; continue with --resume")

    if trainer.trace is not None:
        trainer.trace.close()  # a run that ended inside the window writes what it recorded
        if trainer.trace.written:
            print0(f"hpcdl: step traces in {trainer.trace.out_dir} (rank<r>.json: Perfetto or chrome://tracing)")
    summary = summarise(job)
    if progress.stop_reason in runstate.FINAL_REASONS:  # an interrupted run has no summary until it finishes
        write_results(lambda: job.record.write_summary(summary), job.comm, job.output_dir)
        print0(f"hpcdl: finished: {runstate.closing_words(config, progress)}; "
               f"summary in {job.output_dir / 'summary.json'}")
    if not summary["replicas_identical"]:
        raise RuntimeError("ranks ended with different parameters: the allreduce did not keep replicas in sync")
    exit_code = 0 if progress.stop_reason in runstate.FINAL_REASONS else trainer.stop.exit_code(progress.stop_reason)
    return TrainResult(state.model, summary, exit_code)


def due_for_evaluation(job: Job) -> bool:
    """True when the loop paused where an evaluation is due (an --eval-every point, --max-steps): a stop signal
    that lands there evaluates before checkpointing, since a resume starts after this step and never would."""
    progress, config = job.state.progress, job.config
    return runstate.pause_after(progress.global_step, progress.step_in_epoch, job.trainer.data.steps_per_epoch,
                                config.max_steps, config.eval_every)


def rank_seed(seed: int, epoch: int, rank: int) -> int:
    """A distinct, reproducible seed per (run seed, epoch, rank): epochs replay identically on resume."""
    return (seed * 1_000_003 + epoch * 10_007 + rank) % (2**63 - 1)


def add_sums(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {key: a.get(key, 0.0) + b.get(key, 0.0) for key in set(a) | set(b)}


def check_finite_metrics(epoch: int, train_sums: dict[str, float], test: dict[str, float]) -> None:
    """Stop (one line, every rank: the sums were allreduced) when the epoch's loss or metrics are not finite."""
    values = {"train loss": averages(train_sums)[0], **{name.replace("_", " "): value for name, value in test.items()}}
    bad = [f"{name} {value}" for name, value in values.items() if not math.isfinite(value)]
    if bad:
        raise DivergenceError(f"epoch {epoch + 1} ended with non-finite metrics ({', '.join(bad)}); lower "
                              "--base-lr or add --warmup-epochs. Checkpoints were not overwritten.")


def write_results(write: Callable[[], None], comm: Any, where: Path) -> None:
    """Rank 0 writes a results file; a failed write (disk full, quota, permissions) is one line on every rank,
    naming the path, and the earlier files stay as they were (writes are atomic)."""
    intact = "; the checkpoints are intact: fix the file system, then --resume"

    def on_root() -> None:
        try:
            write()
        except WriteError as exc:  # names the file and the cause
            raise StorageError(f"could not write results: {exc}{intact}") from exc
        except OSError as exc:
            raise StorageError(f"could not write results to {exc.filename or where} "
                               f"({exc.strerror or exc}){intact}") from exc

    rank0_then_all(on_root, comm)


def record_epoch(job: Job, result: EpochResult, train_sums: dict[str, float], test: dict[str, float]) -> None:
    """Epoch bookkeeping: progress, the metrics row, TensorBoard and the rank-0 line."""
    progress, config = job.state.progress, job.config
    epoch = progress.epoch
    # A row inside an epoch (an --eval-every point, --max-steps) is labelled with the fractional epoch reached.
    label: float = epoch + 1
    if not result.complete:
        label = round(epoch + progress.step_in_epoch / job.trainer.data.steps_per_epoch, 4)
    if result.complete:
        progress.epoch, progress.step_in_epoch = epoch + 1, 0
        progress.epochs_completed = progress.epoch
    # An evaluation inside an epoch (--eval-every, --max-steps) keeps the epoch's sums going, so that its last
    # row covers all of it.
    progress.epoch_sums = {} if result.complete else train_sums
    progress.last_test = test
    scoring = job.trainer.scoring
    if "test_accuracy" in test:
        progress.best_accuracy = max(progress.best_accuracy, test["test_accuracy"])
    if scoring.improved(test[scoring.best_key], progress.best.get("value")):
        progress.best = dict(metric=scoring.best_key, goal=scoring.goal, value=test[scoring.best_key],
                             step=progress.global_step)
    if progress.time_to_target is None and runstate.target_met(config, progress):
        progress.time_to_target = progress.train_seconds
    train_loss, train_accuracy = averages(train_sums)
    row = {
        "epoch": label, "global_step": progress.global_step, "train_loss": train_loss,
        "train_accuracy": train_accuracy, **test, "lr": job.state.optimizer.param_groups[0]["lr"],
        "images_per_second": result.images / max(result.seconds, 1e-9), "epoch_seconds": result.seconds,
        "train_seconds": progress.train_seconds, "elapsed_seconds": progress.elapsed_seconds,
        "images_seen": progress.images_seen, "skipped_steps": progress.skipped_steps, "world_size": job.world.size,
        "step_phases": breakdown(job.trainer.phases.take(), job.comm).to_json(),  # since the last row, every rank
    }
    if not scoring.train_accuracy:  # a task without an accuracy metric
        del row["train_accuracy"]
    write_results(lambda: job.record.log_epoch(row), job.comm, job.output_dir)
    where = (f"epoch {label:3d}/{config.epochs}" if isinstance(label, int)
             else f"step {progress.global_step} (epoch {label:.2f}/{config.epochs})")
    print0(
        f"{where} | {scoring.line(train_loss, train_accuracy, test)} | lr {row['lr']:.4g}"
        f" | {row['images_per_second']:.0f} img/s | {result.seconds:.1f} s")


def decide_stop(job: Job, result: EpochResult) -> str | None:
    """Why the run stops after this epoch, or None to go on.

    A run that has reached its limit (:func:`runstate.finished`) is finished even when a signal arrived
    in its last epoch: it writes its summary now, since a resume would find the limit reached and
    train (and write) nothing.
    """
    reached = runstate.finished(job.config, job.state.progress)
    if reached is not None:
        return reached
    return result.stop.name if result.stop else None


def replicas_identical(model: nn.Module, comm) -> bool:
    """True when every rank holds bit-identical parameters (a cheap end-of-run sanity check).

    Parameters only: buffers such as BatchNorm's running statistics are updated from each rank's
    own batches and legitimately differ (rank 0's are the ones saved), as in Horovod's examples.
    """
    digest = hashlib.sha256()
    for tensor in model.parameters():
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return len(set(comm.allgather(digest.hexdigest()))) == 1


def summarise(job: Job) -> dict[str, Any]:
    progress = job.state.progress
    last = progress.last_test
    segments = [{**s, "images_per_second": s["images"] / max(s["train_seconds"], 1e-9)} for s in progress.segments]
    return {
        "best_accuracy": progress.best_accuracy if job.trainer.scoring.train_accuracy else None,
        "final_accuracy": last.get("test_accuracy"),
        "final_test_loss": last.get("test_loss"),
        "epochs": progress.epochs_completed,  # whole epochs; a run stopped inside one also shows epochs_trained
        "epochs_trained": round(progress.epoch + progress.step_in_epoch / job.trainer.data.steps_per_epoch, 4),
        "global_steps": progress.global_step,
        "images_seen": progress.images_seen,
        "skipped_steps": progress.skipped_steps,  # updates skipped for non-finite gradients (fp16 overflows too)
        "world_size": job.world.size,
        "world_sizes": sorted({s["world_size"] for s in progress.segments}),
        # all sessions together, training time only; a resume on another world size: see segments
        "images_per_second": progress.images_seen / max(progress.train_seconds, 1e-9),
        "segments": segments,
        "train_seconds": progress.train_seconds,
        "target_accuracy": job.config.target_accuracy,
        "test_metrics": last,  # the last evaluation: test_loss and test_accuracy, or a task's test_<metric>s
        "best": progress.best,  # the best evaluation by the deciding metric: {metric, goal, value, step}
        "target_metric": job.config.target_metric,
        "time_to_target_seconds": progress.time_to_target,
        "stop_reason": progress.stop_reason,
        "stopped_by_signal": progress.stop_reason if progress.stop_reason not in runstate.FINAL_REASONS else None,
        "resumed_with_changes": progress.resumed_with_changes,
        "replicas_identical": replicas_identical(job.state.model, job.comm),
        "step_phases": breakdown(job.trainer.phases.session(), job.comm).to_json(),  # this session's steps
        "config": dataclasses.asdict(job.config),
    }


def main(argv: Sequence[str] | None = None) -> int:
    return train(parse_config(argv)).exit_code


def main_cli() -> None:
    """The command line: ``python -m hpcdl.train``."""
    run_main(main, program="hpcdl.train", whole_program=True)
