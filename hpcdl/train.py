"""Data-parallel training with Horovod: ``mpirun -np N python -m hpcdl.train [flags]``.

Read top to bottom: set up the world, data, model and optimizer; restore a checkpoint if asked;
then for each epoch train (one allreduce per step through Horovod's DistributedOptimizer),
evaluate on sharded test data, record metrics and write a checkpoint. With no flags it trains a
small CNN on the embedded digits data. ``--help`` lists everything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import random
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from hpcdl import checkpoint, world
from hpcdl.config import TrainConfig, parse_config
from hpcdl.data import load_dataset, make_loaders
from hpcdl.errors import UsageError, agree, describe, run_main
from hpcdl.faults import FaultInjector, FaultSpecError
from hpcdl.metrics import RunRecord, Sums
from hpcdl.models import build_model
from hpcdl.schedule import LRSchedule, lr_scale
from hpcdl.signals import GracefulStop
from hpcdl.watchdog import StallWatchdog
from hpcdl.watchdog import stop_all as stop_all_watchdogs

if TYPE_CHECKING:
    from kfac import KFACPreconditioner


@dataclasses.dataclass
class Progress:
    """Where training stands; saved in every checkpoint."""

    epoch: int = 0  # the epoch being trained (or next to train)
    step_in_epoch: int = 0  # optimizer steps already taken in that epoch
    global_step: int = 0
    best_accuracy: float = 0.0
    time_to_target: float | None = None
    train_seconds: float = 0.0  # wall time spent so far, over all sessions of the run
    images_seen: int = 0
    nonfinite_streak: int = 0
    epoch_sums: dict[str, float] = dataclasses.field(default_factory=dict)  # of a part-trained epoch, all ranks


def rank_seed(seed: int, epoch: int, rank: int) -> int:
    """A distinct, reproducible seed per (run seed, epoch, rank): epochs replay identically on resume."""
    return (seed * 1_000_003 + epoch * 10_007 + rank) % (2**63 - 1)


def prepare_output_dir(config: TrainConfig, comm) -> Path:
    """The run directory, chosen by rank 0 (timestamp) and checked for writability."""
    name = config.output_dir or f"runs/{datetime.now():%Y%m%d-%H%M%S}"
    path = Path(comm.bcast(name, root=0))

    def check() -> None:
        if comm.Get_rank() != 0:
            return
        try:
            (path / "checkpoints").mkdir(parents=True, exist_ok=True)
            probe = path / ".write-test"
            probe.write_text("ok")
            probe.unlink()
        except OSError as exc:
            raise UsageError(f"output directory {path} is not writable ({exc.strerror})") from exc
        if not config.resume and checkpoint.list_checkpoints(checkpoint.checkpoint_dir(path)):
            raise UsageError(f"{path} already holds checkpoints of an earlier run: add --resume to continue it, "
                             "or choose another --output-dir")

    agree(check)
    return path


def build_optimizer(config: TrainConfig, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    params = model.parameters()
    if config.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=config.weight_decay)
    if config.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=config.weight_decay)
    return torch.optim.SGD(
        params, lr=lr, momentum=config.momentum, nesterov=config.nesterov, weight_decay=config.weight_decay
    )


def build_preconditioner(config: TrainConfig, model: nn.Module, schedule_lr, scaler) -> Any:
    """The K-FAC preconditioner when --kfac-update-freq > 0, else None."""
    if config.kfac_update_freq <= 0:
        return None
    from kfac import KFACPreconditioner

    return KFACPreconditioner(
        model,
        factor_update_freq=config.kfac_cov_update_freq,
        inv_update_freq=config.kfac_update_freq,
        damping=config.damping,
        factor_decay=config.factor_decay,
        kl_clip=config.kl_clip,
        lr=schedule_lr,
        grad_worker_fraction=config.kfac_grad_worker_fraction,
        backward_passes_per_step=config.batches_per_allreduce,  # factors accumulate like the gradients
        grad_scaler=scaler,  # its scale is divided out of G
    )


def autocast_context(config: TrainConfig, device: torch.device):
    """bf16 autocast on CPU, fp16 on CUDA; nothing without --amp."""
    if not config.amp:
        return contextlib.nullcontext()
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    return torch.autocast(device_type=device.type, dtype=dtype)


def check_adasum(config: TrainConfig, world_size: int, cuda: bool) -> None:
    """What Horovod's Adasum optimizer cannot do, as one line instead of a traceback mid-step."""
    if world_size & (world_size - 1):
        raise UsageError(f"--use-adasum needs a power-of-two number of ranks (Horovod's Adasum), got {world_size}")
    if config.kfac_update_freq > 0:
        raise UsageError("--use-adasum cannot be combined with K-FAC (--kfac-update-freq > 0): Horovod's Adasum "
                         "optimizer takes its step inside backward, before K-FAC could precondition the gradient")
    if config.amp and cuda:
        raise UsageError("--use-adasum cannot be combined with --amp on CUDA: the GradScaler must unscale "
                         "gradients before the step, and Adasum steps inside backward")


def apply_gradients(model: nn.Module, optimizer: torch.optim.Optimizer, preconditioner: KFACPreconditioner | None,
                    scaler: torch.amp.GradScaler | None, world_size: int, adasum: bool, comm,
                    watchdog: StallWatchdog) -> bool:
    """Average the gradients over the ranks, precondition and step; False when they were not finite.

    Horovod's DistributedOptimizer allreduces in backward hooks; ``synchronize`` waits for them,
    then K-FAC and the step run inside ``skip_synchronize``. On one rank there is nothing to
    average (Horovod registers no hooks, and its ``synchronize`` would still copy every gradient
    through its queue: a measurable cost). Horovod's Adasum optimizer (2+ ranks) differs: its hooks
    apply the local step inside backward and ``step`` combines the ranks' updates, so there is
    nothing to skip; the ranks agree on finiteness so that they stop together.
    """
    if adasum and world_size > 1:
        optimizer.step()
        watchdog.beat(phase="compute")
        return comm.allreduce(0 if gradients_finite(model) else 1) == 0
    if world_size > 1:
        optimizer.synchronize()
    watchdog.beat(phase="compute")
    if scaler:
        scaler.unscale_(optimizer)
    finite = gradients_finite(model)
    if finite and preconditioner is not None:
        preconditioner.step()
    with optimizer.skip_synchronize():
        if scaler:
            scaler.step(optimizer)  # skips the update itself when gradients are not finite
            scaler.update()
        elif finite:
            optimizer.step()
    return finite


def gradients_finite(model: nn.Module) -> bool:
    """True when every gradient is finite. After the allreduce all ranks hold the same gradients,
    so every rank reaches the same verdict without communicating."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return True
    return bool(torch.isfinite(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])).all())


def gather_rng_states(comm) -> list[dict[str, Any]]:
    """Every rank's random state (for an exact mid-epoch resume); the list is complete on rank 0."""
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return comm.gather(state, root=0)


def restore_rng_state(states: list[dict[str, Any]], rank: int) -> None:
    state = states[rank]
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(
    output_dir: Path, config: TrainConfig, model, optimizer, preconditioner, scaler, progress: Progress, comm,
    watchdog: StallWatchdog | None = None, faults: FaultInjector | None = None,
) -> None:
    """Rank 0 writes the whole training state (all ranks take part in gathering RNG states).

    A failed write (disk full, quota, I/O error) ends the job on every rank with one line: the
    earlier checkpoints are intact, and training on without saving would only lose more work.
    """
    if watchdog is not None:
        watchdog.beat(phase="checkpoint" if comm.Get_rank() == 0 else "collective")
    rng = gather_rng_states(comm)
    problem = None
    if comm.Get_rank() == 0:
        problem = _write_checkpoint(output_dir, config, model, optimizer, preconditioner, scaler, progress, comm, rng,
                                    faults.while_saving(progress.global_step) if faults is not None else None)
    problem = comm.bcast(problem, root=0)
    if watchdog is not None:
        watchdog.beat()
    if problem:
        raise UsageError(problem)


def _write_checkpoint(output_dir, config, model, optimizer, preconditioner, scaler, progress, comm, rng,
                      before_rename) -> str | None:
    """Rank 0's part of :func:`save_checkpoint`; the reason the job must stop, or None."""
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": {"lr": optimizer.param_groups[0]["lr"]},  # the lr is a function of progress
        "epoch": progress.epoch,
        "step_in_epoch": progress.step_in_epoch,
        "global_step": progress.global_step,
        "progress": dataclasses.asdict(progress),
        "rng": rng,
        "config": dataclasses.asdict(config),
        "world_size": comm.Get_size(),
        "kfac": preconditioner.state_dict() if preconditioner is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
    }
    directory = checkpoint.checkpoint_dir(output_dir)
    try:
        checkpoint.save(directory, state, config.keep_checkpoints, before_rename=before_rename)
    except checkpoint.CheckpointError as exc:
        print(f"hpcdl: not saving: {exc}", file=sys.stderr, flush=True)  # the non-finite check stops the run
    except (OSError, RuntimeError) as exc:  # torch reports a failed write (e.g. ENOSPC) as RuntimeError
        return (f"could not write the checkpoint of step {progress.global_step} to {directory} ({describe(exc)}); "
                "the earlier checkpoints are intact: free space or fix the file system, then --resume")
    return None


def load_checkpoint(output_dir: Path, config: TrainConfig, model, optimizer, preconditioner, scaler, comm) -> Progress | None:
    """Rank 0 reads the newest valid checkpoint and broadcasts it; every rank restores from it."""
    def read_on_root() -> dict[str, Any] | None:
        if comm.Get_rank() != 0:
            return None
        directory = checkpoint.checkpoint_dir(output_dir)
        found = checkpoint.list_checkpoints(directory)
        state, path = checkpoint.load_latest(directory, set_aside=True)
        if state is None and found:
            raise UsageError(f"none of the {len(found)} checkpoint(s) in {directory} is readable (see above); "
                             "move them away to start from scratch")
        if path is not None:
            world.print0(f"resuming from {path}")
        return state

    state = comm.bcast(agree(read_on_root), root=0)
    if state is None:
        world.print0("no checkpoint to resume from: starting from scratch")
        return None

    def check() -> None:
        saved = state["config"]
        if saved["model"] != config.model or saved["dataset"] != config.dataset:
            raise UsageError(
                f"the checkpoint in {output_dir} is for model {saved['model']} on {saved['dataset']}, "
                f"not {config.model} on {config.dataset}"
            )
        try:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise UsageError(f"the checkpoint in {output_dir} does not fit this model: {str(exc).splitlines()[0]}")

    agree(check)
    if preconditioner is not None and state.get("kfac") is not None:
        preconditioner.load_state_dict(state["kfac"])
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    progress = Progress(**state["progress"])
    saved = state["config"]
    saved_batch = state["world_size"] * saved["batch_size"] * saved["batches_per_allreduce"]
    batch = comm.Get_size() * config.batch_size * config.batches_per_allreduce
    if state["world_size"] == comm.Get_size() and saved_batch == batch:
        restore_rng_state(state["rng"], comm.Get_rank())
    else:
        world.print0(
            f"checkpoint was written by {state['world_size']} rank(s) with global batch {saved_batch}, resuming on "
            f"{comm.Get_size()} with global batch {batch}: learning rate rescaled, position in the epoch kept by "
            "sample count (an exact continuation needs the same ranks and batch size)"
        )
        progress.step_in_epoch = progress.step_in_epoch * saved_batch // batch
    return progress


def evaluate(model: nn.Module, loader, device, amp, comm, watchdog: StallWatchdog) -> dict[str, float]:
    """Loss and accuracy over the whole test set: sums and counts from every shard, allreduced."""
    model.eval()
    watchdog.beat(phase="evaluate")
    sums = Sums()
    sums.add(loss=0.0, correct=0, count=0)
    with torch.no_grad():
        for images, labels in loader:
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            with amp:
                logits = model(images)
            sums.add(
                loss=F.cross_entropy(logits.float(), labels, reduction="sum"),
                correct=(logits.argmax(1) == labels).sum(),
                count=labels.numel(),
            )
            watchdog.beat()
    watchdog.beat(phase="collective")
    total = sums.reduced(comm)
    count = max(total["count"], 1.0)
    return {"test_loss": total["loss"] / count, "test_accuracy": total["correct"] / count}


def replicas_identical(model: nn.Module, comm) -> bool:
    """True when every rank holds bit-identical parameters (a cheap end-of-run sanity check).

    Parameters only: buffers such as BatchNorm's running statistics are updated from each rank's
    own batches and legitimately differ (rank 0's are the ones saved), as in Horovod's examples.
    """
    digest = hashlib.sha256()
    for tensor in model.parameters():
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return len(set(comm.allgather(digest.hexdigest()))) == 1


def make_fault_injector(rank: int, size: int) -> FaultInjector:
    """This rank's injected faults (HPCDL_FAULT); a malformed value is a usage error, not a crash."""
    try:
        return FaultInjector(rank, world_size=size)
    except FaultSpecError as exc:
        raise UsageError(str(exc)) from exc


@dataclasses.dataclass
class TrainResult:
    model: nn.Module
    summary: dict[str, Any]


def train(config: TrainConfig) -> TrainResult:
    """Run (or continue) one training job on every rank of the world."""
    try:
        return _train(config)
    finally:
        stop_all_watchdogs()  # after an exception too: nothing may end this process later


def _train(config: TrainConfig) -> TrainResult:
    me = world.init()
    comm = world.comm()
    cuda = me.device.type == "cuda"
    faults = agree(lambda: make_fault_injector(me.rank, me.size))
    output_dir = prepare_output_dir(config, comm)

    # ---- data and model (identical initial weights on every rank, and broadcast to be sure)
    torch.manual_seed(config.seed)
    data = agree(lambda: load_dataset(config.dataset, config.data_dir, config.seed, config.synthetic_shape,
                                      config.synthetic_classes, config.synthetic_size))
    train_loader, sampler, test_loader = agree(lambda: make_loaders(
        data, me.rank, me.size, config.batch_size * config.batches_per_allreduce, config.test_batch_size,
        config.workers, config.seed, pin_memory=cuda))
    train_loader.generator = torch.Generator()  # shuffling/worker seeds never touch the global RNG
    model = agree(lambda: build_model(config.model, data.num_classes, data.channels)).to(me.device)
    steps_per_epoch = len(train_loader)

    # ---- optimisation: linear lr scaling, warm-up, decay; Horovod allreduce in the optimizer
    if config.use_adasum and me.size > 1:
        check_adasum(config, me.size, cuda)
    peak_lr = config.base_lr * lr_scale(me.size, config.batches_per_allreduce, config.use_adasum, me.local_size, cuda)
    schedule = LRSchedule(config.base_lr, peak_lr, config.warmup_epochs, config.epochs, config.lr_schedule,
                          config.lr_decay)
    optimizer = build_optimizer(config, model, schedule(0.0))
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if config.fp16_allreduce else hvd.Compression.none,
        backward_passes_per_step=config.batches_per_allreduce,
        op=hvd.Adasum if config.use_adasum else hvd.Average,
    )
    current_lr = lambda step=None: optimizer.param_groups[0]["lr"]  # noqa: E731 - K-FAC reads the live lr
    scaler = torch.amp.GradScaler("cuda") if config.amp and cuda else None
    preconditioner = build_preconditioner(config, model, current_lr, scaler)
    criterion = nn.CrossEntropyLoss(label_smoothing=config.label_smoothing)
    amp = autocast_context(config, me.device)

    progress = Progress()
    if config.resume:
        progress = load_checkpoint(output_dir, config, model, optimizer, preconditioner, scaler, comm) or Progress()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    record = RunRecord(output_dir, me.is_root, config.resume)
    watchdog = StallWatchdog(comm, config.stall_timeout).start()
    stop = GracefulStop(comm)
    world.print0(
        f"hpcdl: {config.model} on {config.dataset} | {me.size} rank(s) x batch {config.batch_size}"
        f" x {config.batches_per_allreduce} = global batch {me.size * config.batch_size * config.batches_per_allreduce}"
        f" | lr {config.base_lr} -> {peak_lr:g} | {steps_per_epoch} steps/epoch | {me.threads} thread(s)/rank"
        f" | {'K-FAC' if preconditioner else 'SGD-family'} ({config.optimizer}) | run dir {output_dir}"
    )

    session_start = time.perf_counter() - progress.train_seconds
    stopped_by: str | None = None
    last_test: dict[str, float] = {}
    finished = progress.epoch >= config.epochs
    if finished:
        world.print0(f"hpcdl: nothing to do: the checkpoint is at epoch {progress.epoch} and --epochs is {config.epochs}")
    trained = not finished
    while not finished:
        epoch = progress.epoch
        model.train()
        if progress.step_in_epoch == 0:  # mid-epoch resumes restored the exact RNG state instead
            torch.manual_seed(rank_seed(config.seed, epoch, me.rank))
        train_loader.generator.manual_seed(rank_seed(config.seed, epoch, me.rank))
        sampler.set_epoch(epoch)
        sampler.skip = progress.step_in_epoch * config.batch_size * config.batches_per_allreduce
        sums = Sums()
        sums.add(loss=0.0, correct=0, count=0)
        if me.is_root and progress.epoch_sums:  # what the part of this epoch before a mid-epoch checkpoint added
            sums.add(**progress.epoch_sums)
        progress.epoch_sums = {}
        watchdog.beat(phase="data")
        epoch_start = time.perf_counter()
        images_this_epoch = 0
        bar = tqdm(total=steps_per_epoch, initial=progress.step_in_epoch, desc=f"epoch {epoch + 1}/{config.epochs}",
                   disable=not (me.is_root and config.progress), leave=False, dynamic_ncols=True, mininterval=0.5)
        for images, labels in train_loader:
            step = progress.global_step + 1
            faults.before_step(step)
            watchdog.beat(phase="compute")
            lr = schedule(epoch + progress.step_in_epoch / steps_per_epoch)
            for group in optimizer.param_groups:
                group["lr"] = lr
            images, labels = images.to(me.device, non_blocking=True), labels.to(me.device, non_blocking=True)

            # forward/backward over k micro-batches; Horovod allreduces after the k-th backward
            for x, y in zip(images.chunk(config.batches_per_allreduce), labels.chunk(config.batches_per_allreduce)):
                with amp:
                    logits = model(x)
                    loss = criterion(logits.float(), y)
                if faults.poison_loss(step):
                    loss = loss * float("nan")
                scaled = loss / config.batches_per_allreduce
                (scaler.scale(scaled) if scaler else scaled).backward()
                sums.add(loss=loss.detach() * y.numel(), correct=(logits.argmax(1) == y).sum(), count=y.numel())
            watchdog.beat(phase="collective")
            finite = apply_gradients(model, optimizer, preconditioner, scaler, me.size, config.use_adasum, comm, watchdog)
            optimizer.zero_grad()  # Horovod's wrapper sets gradients to None (torch default)

            progress.nonfinite_streak = 0 if finite else progress.nonfinite_streak + 1
            if progress.nonfinite_streak >= config.max_nonfinite_steps:
                watchdog.stop()
                raise UsageError(
                    f"loss or gradients were non-finite for {progress.nonfinite_streak} consecutive steps "
                    f"(up to step {step}); lower --base-lr or add --warmup-epochs. Checkpoints were not overwritten."
                )
            if not finite:
                world.print0(f"step {step}: non-finite gradients, update skipped")
            progress.global_step = step
            progress.step_in_epoch += 1
            images_this_epoch += len(images) * me.size
            watchdog.beat(step, phase="collective")  # next: the stop-flag allreduce
            if not bar.disable:
                elapsed = max(time.perf_counter() - epoch_start, 1e-9)
                bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{sums.values['correct'] / max(sums.values['count'], 1):.3f}",
                                lr=f"{lr:.3g}", img_s=f"{images_this_epoch / elapsed:.0f}", refresh=False)
            bar.update(1)

            stopped_by = stop.requested()
            watchdog.beat(phase="data")
            if stopped_by or (config.max_steps and step >= config.max_steps):
                break
        bar.close()
        epoch_seconds = time.perf_counter() - epoch_start
        progress.images_seen += images_this_epoch
        epoch_complete = progress.step_in_epoch >= steps_per_epoch

        if stopped_by and not epoch_complete:
            progress.train_seconds = time.perf_counter() - session_start
            watchdog.beat(phase="collective")
            progress.epoch_sums = sums.reduced(comm)  # so that the resumed epoch's metrics cover all of it
            save_checkpoint(output_dir, config, model, optimizer, preconditioner, scaler, progress, comm, watchdog, faults)
            world.print0(f"hpcdl: {stopped_by} received: checkpoint written at step {progress.global_step}; "
                         f"continue with --resume --output-dir {output_dir}")
            break

        watchdog.beat(phase="collective")
        train = sums.reduced(comm)
        last_test = evaluate(model, test_loader, me.device, amp, comm, watchdog)
        elapsed = time.perf_counter() - session_start
        progress.best_accuracy = max(progress.best_accuracy, last_test["test_accuracy"])
        if (config.target_accuracy is not None and progress.time_to_target is None
                and last_test["test_accuracy"] >= config.target_accuracy):
            progress.time_to_target = elapsed
        row = {
            "epoch": epoch + 1,
            "global_step": progress.global_step,
            "train_loss": train["loss"] / max(train["count"], 1),
            "train_accuracy": train["correct"] / max(train["count"], 1),
            **last_test,
            "lr": optimizer.param_groups[0]["lr"],
            "images_per_second": images_this_epoch / max(epoch_seconds, 1e-9),
            "epoch_seconds": epoch_seconds,
            "elapsed_seconds": elapsed,
        }
        record.log_epoch(row)
        world.print0(
            f"epoch {epoch + 1:3d}/{config.epochs} | train loss {row['train_loss']:.4f} acc {row['train_accuracy']:.4f}"
            f" | test loss {row['test_loss']:.4f} acc {row['test_accuracy']:.4f} | lr {row['lr']:.4g}"
            f" | {row['images_per_second']:.0f} img/s | {epoch_seconds:.1f} s"
        )
        if epoch_complete:
            progress.epoch, progress.step_in_epoch = epoch + 1, 0
        progress.train_seconds = elapsed
        save_checkpoint(output_dir, config, model, optimizer, preconditioner, scaler, progress, comm, watchdog, faults)
        reached = progress.time_to_target is not None
        out_of_steps = config.max_steps is not None and progress.global_step >= config.max_steps
        finished = progress.epoch >= config.epochs or reached or out_of_steps or stopped_by is not None
        if stopped_by:
            world.print0(f"hpcdl: {stopped_by} received: stopped after epoch {epoch + 1}; continue with --resume")

    watchdog.stop()
    stop.close()
    identical = replicas_identical(model, comm)
    total_seconds = time.perf_counter() - session_start
    summary = {
        "best_accuracy": progress.best_accuracy,
        "final_accuracy": last_test.get("test_accuracy"),
        "final_test_loss": last_test.get("test_loss"),
        "epochs": progress.epoch,
        "global_steps": progress.global_step,
        "world_size": me.size,
        "images_per_second": progress.images_seen / max(total_seconds, 1e-9),
        "train_seconds": total_seconds,
        "target_accuracy": config.target_accuracy,
        "time_to_target_seconds": progress.time_to_target,
        "stopped_by_signal": stopped_by,
        "replicas_identical": identical,
        "config": dataclasses.asdict(config),
    }
    if trained and not stopped_by:
        record.write_summary(summary)
    record.close()
    if not identical:
        raise RuntimeError("ranks ended with different parameters: the allreduce did not keep replicas in sync")
    return TrainResult(model, summary)


def main(argv: Sequence[str] | None = None) -> int:
    train(parse_config(argv))
    return 0


if __name__ == "__main__":
    run_main(main, program="hpcdl.train")
