"""One epoch of training and one evaluation, without waiting on the device inside a step.

A step queues its work and returns: loss and accuracy sums stay on the device
(:class:`~hpcdl.persistence.metrics.DeviceSums`), the non-finite verdict is a device flag that the fused
optimizer reads to skip the update by itself, and the flags of the last ``--log-every`` steps are
read back together at the next log point. There, and only there, the host learns the metrics,
decides about non-finite streaks and exchanges the stop flag with the other ranks.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from hpcdl.data import InputPipeline
from hpcdl.persistence.metrics import DeviceSums, averages
from hpcdl.runtime.console import print0
from hpcdl.runtime.errors import DivergenceError
from hpcdl.runtime.faults import FaultInjector
from hpcdl.runtime.signals import GracefulStop, StopRequest
from hpcdl.runtime.watchdog import StallWatchdog
from hpcdl.runtime.world import World
from hpcdl.training.backend import Backend
from hpcdl.training.config import TrainConfig
from hpcdl.training.phases import StepPhases, TraceWindow
from hpcdl.training.runstate import TrainState, pause_after
from hpcdl.training.schedule import LRSchedule
from hpcdl.training.scoring import Scoring

LOG_POINT = "hpcdl.log_point"  # the profiler range of the only place a training epoch reads from the device
# An fp16 step that overflows is skipped by the GradScaler, which then halves the loss scale: that is
# loss scaling at work, not divergence. Only overflow at a scale this small counts as non-finite.
FP16_MIN_LOSS_SCALE = 1.0


@dataclass(frozen=True)
class LoopSettings:
    """The flags the loop reads."""

    batches_per_allreduce: int
    log_every: int
    max_nonfinite_steps: int
    epochs: int
    max_steps: int | None
    progress_bar: bool
    eval_every: int | None = None  # an epoch also ends its part at every multiple of this step, for an evaluation

    @classmethod
    def of(cls, config: TrainConfig) -> LoopSettings:
        return cls(config.batches_per_allreduce, config.log_every, config.max_nonfinite_steps, config.epochs,
                   config.max_steps, config.progress, config.eval_every)


@dataclass
class Trainer:
    """What the loop uses: the model to call, the stateful parts it updates, the data and the run's guards."""

    model: nn.Module  # what is called (compiled when --compile); state.model is the bare one
    state: TrainState
    schedule: LRSchedule
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # the loss: a batch's mean
    amp_dtype: torch.dtype | None
    data: InputPipeline
    world: World
    comm: Any
    watchdog: StallWatchdog
    stop: GracefulStop
    faults: FaultInjector
    settings: LoopSettings
    backend: Backend  # how gradients are averaged over the ranks (Horovod, torch.distributed)
    phases: StepPhases = field(default_factory=StepPhases)  # where each step goes (hpcdl.training.phases)
    trace: TraceWindow | None = None  # --profile-steps
    scoring: Scoring = field(default_factory=Scoring)  # accuracy and evaluation: built-in, or a task's

    @property
    def device(self) -> torch.device:
        return self.world.device

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.amp_dtype)


@dataclass
class EpochResult:
    train: dict[str, float]  # allreduced sums of the part trained in this session
    images: int  # training images, all ranks, in this session's part of the epoch
    seconds: float
    complete: bool
    stop: StopRequest | None  # the stop signal(s) that ended it early, if any


def micro_batches(batch: torch.Tensor, k: int) -> list[torch.Tensor]:
    """The ``k`` micro-batches of a rank's batch: micro-batch j takes examples j, j+k, j+2k, ...

    Ranks are dealt the epoch's samples round-robin (hpcdl.data.order), so micro-batch j of one rank's
    batch of k*B is, example for example and in order, rank j's batch of B in a k-rank run. A run on one
    rank with --batches-per-allreduce k therefore computes the k ranks' gradients bit for bit, and their
    sum (each scaled by 1/k, exact) is the ranks' average: the two runs are bit-identical by construction.
    """
    if k == 1:
        return [batch]
    channels_last = batch.dim() == 4 and batch.is_contiguous(memory_format=torch.channels_last)
    layout = torch.channels_last if channels_last and not batch.is_contiguous() else torch.contiguous_format
    return [batch[j::k].contiguous(memory_format=layout) for j in range(k)]


def nonfinite_flag(parameters: Sequence[torch.Tensor]) -> torch.Tensor:
    """1.0 on the device when any gradient holds inf or NaN, else 0.0: one fused norm, no host read."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros((), device=parameters[0].device)
    norms = torch._foreach_norm(grads)
    return (~torch.isfinite(torch.stack(norms).sum())).float()


def apply_gradients(trainer: Trainer) -> tuple[torch.Tensor, torch.Tensor]:
    """Average gradients over ranks, precondition, step; returns device flags (skipped, failed): 1.0 when the
    update was skipped for non-finite gradients, and when that counts as a failure (not fp16 loss scaling at work).

    The backend's allreduces run during backward (Horovod's hooks, DDP's buckets) and ``synchronize``
    waits for them; K-FAC and the update then run inside the backend's ``stepping`` context
    (hpcdl.training.backend). The update rule is a fused kernel that reads ``found_inf`` on the device
    and leaves parameters and state untouched when it is set, which is how a non-finite step is
    skipped without the host looking.
    """
    state = trainer.state
    optimizer: Any = state.optimizer  # Horovod's DistributedOptimizer, or the update rule itself (torch)
    scaler = state.scaler
    params = list(state.model.parameters())
    applied = trainer.backend.apply_in_backward(optimizer, lambda: nonfinite_flag(params))
    if applied is not None:  # Horovod's Adasum: the update ran inside backward, nothing here can skip it
        return applied
    phases = trainer.phases
    with phases.phase("allreduce"):
        trainer.backend.synchronize(optimizer)
    if scaler is not None:
        scaler.unscale_(optimizer)
        per_device = scaler._found_inf_per_device(optimizer).values()  # the scaler's own verdict, on the device
        found_inf = torch.stack(list(per_device)).sum().clamp(max=1.0)
        # Overflow is loss scaling at work; only overflow at a tiny scale is divergence.
        failed = found_inf * (scaler._get_scale_async() < FP16_MIN_LOSS_SCALE)  # type: ignore[operator]
    else:
        found_inf = failed = nonfinite_flag(params)
    if state.preconditioner is not None:
        with phases.phase("kfac"):
            state.preconditioner.step(found_inf=found_inf)
    with phases.phase("optimizer"):
        optimizer.found_inf = found_inf
        with trainer.backend.stepping(optimizer):
            optimizer.step()
        del optimizer.found_inf
        if scaler is not None:
            scaler.update()  # halves the scale after an overflow, on the device
        optimizer.zero_grad()
    return found_inf, failed


class HealthLog:
    """Per-step (skipped, failed) flags kept on the device between log points, judged on the host at each."""

    def __init__(self, trainer: Trainer) -> None:
        self.progress = trainer.state.progress
        self.limit = trainer.settings.max_nonfinite_steps
        self.flags = torch.zeros(trainer.settings.log_every, 2, device=trainer.device)
        self.first_step = self.progress.global_step + 1
        self.count = 0

    def record(self, flags: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.flags[self.count].copy_(torch.stack(flags), non_blocking=True)
        self.count += 1

    def judge(self) -> None:
        """Read the flags; count and announce skipped steps; stop the run (one line) on a streak of failures."""
        if not self.count:
            return
        progress, limit = self.progress, self.limit
        for offset, (skipped, failed) in enumerate(self.flags[: self.count].tolist()):
            step = self.first_step + offset
            progress.skipped_steps += int(skipped > 0)
            progress.nonfinite_streak = progress.nonfinite_streak + 1 if failed else 0
            if progress.nonfinite_streak >= limit:
                raise DivergenceError(
                    f"loss or gradients were non-finite for {progress.nonfinite_streak} consecutive steps "
                    f"(up to step {step}); lower --base-lr or add --warmup-epochs. Checkpoints were not overwritten.")
            if failed:
                print0(f"step {step}: non-finite gradients, update skipped")
        self.first_step += self.count
        self.count = 0


def train_one_epoch(trainer: Trainer) -> EpochResult:
    """Train from where ``trainer.state.progress`` stands to the end of its epoch (or a stop request, --max-steps
    or an evaluation point of --eval-every, which leave the epoch incomplete)."""
    settings, state, data = trainer.settings, trainer.state, trainer.data
    progress, optimizer, scaler = state.progress, state.optimizer, state.scaler
    watchdog, faults = trainer.watchdog, trainer.faults
    epoch, k = progress.epoch, settings.batches_per_allreduce
    state.model.train()
    sums, health = DeviceSums(trainer.device, skip_nonfinite=True), HealthLog(trainer)
    bar = tqdm(total=data.steps_per_epoch, initial=progress.step_in_epoch, desc=f"epoch {epoch + 1}/{settings.epochs}",
               disable=not (trainer.world.is_root and settings.progress_bar), leave=False, dynamic_ncols=True,
               mininterval=1.0)
    stop: StopRequest | None = None
    images = 0
    watchdog.beat(phase="data")
    phases, trace = trainer.phases, trainer.trace
    start = time.perf_counter()
    phases.data_wait_begins()
    for images_batch, labels in data.train_epoch(epoch, progress.step_in_epoch):
        step = progress.global_step + 1
        if trace is not None:
            trace.before_step(step)
        phases.begin_step()
        faults.before_step(step)
        watchdog.beat(phase="compute")
        lr = trainer.schedule(epoch + progress.step_in_epoch / data.steps_per_epoch)
        for group in optimizer.param_groups:
            group["lr"] = lr
        for x, y in trainer.backend.accumulating(trainer.model, zip(micro_batches(images_batch, k),
                                                                    micro_batches(labels, k), strict=True)):
            with phases.phase("forward"), trainer.autocast():
                logits = trainer.model(x)
                loss = trainer.criterion(logits.float(), y)
            if faults.poison_loss(step):
                loss = loss * float("nan")
            scaled = loss / k
            with phases.phase("backward"):
                (scaler.scale(scaled) if scaler is not None else scaled).backward()
            sums.add(loss.detach() * len(y), trainer.scoring.correct(logits.detach(), y), len(y))
        watchdog.beat(phase="collective")
        health.record(apply_gradients(trainer))
        phases.end_step()
        if trace is not None:
            trace.after_step(step)
        progress.global_step, progress.step_in_epoch = step, progress.step_in_epoch + 1
        images += len(images_batch) * trainer.world.size
        bar.update(1)
        watchdog.beat(step, phase="data")
        last = pause_after(step, progress.step_in_epoch, data.steps_per_epoch, settings.max_steps, settings.eval_every)
        if last or health.count == settings.log_every:
            with torch.profiler.record_function(LOG_POINT):
                watchdog.beat(phase="collective")
                health.judge()
                stop = trainer.stop.requested()
                if not bar.disable:
                    loss_avg, accuracy = averages(sums.read())
                    bar.set_postfix(loss=f"{loss_avg:.3f}", acc=f"{accuracy:.3f}", lr=f"{lr:.3g}",
                                    img_s=f"{images / max(time.perf_counter() - start, 1e-9):.0f}", refresh=False)
            if stop or last:
                break
        phases.data_wait_begins()
    if trainer.device.type == "cuda":
        torch.cuda.synchronize(trainer.device)  # the epoch's time includes its queued work
    seconds = time.perf_counter() - start
    bar.close()
    watchdog.beat(phase="collective")
    with torch.profiler.record_function(LOG_POINT):
        train = sums.reduced(trainer.comm)
    return EpochResult(train, images, seconds, progress.step_in_epoch >= data.steps_per_epoch, stop)


def evaluate(trainer: Trainer) -> dict[str, float]:
    """Loss and accuracy (or a task's metrics) over the whole test set: sums from every rank's disjoint shard,
    allreduced."""
    model = trainer.state.model  # uncompiled: evaluation's last, smaller batch would make a compiled model recompile
    model.eval()
    trainer.watchdog.beat(phase="evaluate")

    def forward(inputs: torch.Tensor) -> torch.Tensor:
        with trainer.autocast():
            return model(inputs)

    with torch.no_grad():
        test = trainer.scoring.evaluate(trainer.data.test_batches(), forward, trainer.device, trainer.comm,
                                        trainer.watchdog.beat)
    model.train()
    return test
