"""A training job, built once: the world, data, model, optimizer, precision, K-FAC and run state.

:func:`build_job` makes every decision that does not change during training (which device, which
precision, which memory format, which optimizer, where results go) so that the loop in
:mod:`hpcdl.training.loop` only trains. It hands the loop a :class:`~hpcdl.training.loop.Trainer`
(what the loop uses) and the checkpointer the stateful parts (:class:`~hpcdl.training.runstate.TrainState`);
:class:`Job` holds those two and what only the epoch driver in :mod:`hpcdl.training.train` uses.
Everything here is collective: every rank builds its job at the same point, and a problem on any
rank is a one-line error on all of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpcdl.data import DataSpec, InputPipeline
from hpcdl.persistence import checkpoint_files
from hpcdl.persistence.checkpointer import Checkpointer
from hpcdl.persistence.metrics import RunRecord
from hpcdl.persistence.rundir import RunDir, claim
from hpcdl.runtime import launcher, placement, world
from hpcdl.runtime.console import print0
from hpcdl.runtime.cpu_features import slow_bf16_warning
from hpcdl.runtime.errors import UsageError, agree
from hpcdl.runtime.faults import FaultInjector
from hpcdl.runtime.signals import GracefulStop
from hpcdl.runtime.watchdog import StallWatchdog
from hpcdl.training import backend as backends
from hpcdl.training import runstate
from hpcdl.training.config import BatchUnits, TrainConfig, check_amp_device, warmup_start_factor
from hpcdl.training.loop import LoopSettings, Trainer
from hpcdl.training.optimizers import build_preconditioner, build_update_rule
from hpcdl.training.phases import StepPhases, TraceWindow, parse_profile_steps
from hpcdl.training.schedule import LRSchedule, lr_scale, warmup_start
from hpcdl.training.task import TaskSource
from hpcdl.training.workload import Workload, build_workload


@dataclass
class Job:
    """A built job: the loop's :class:`Trainer`, the checkpointer, and the run's directory and records."""

    config: TrainConfig
    world: world.World
    comm: Any
    run_dir: RunDir
    record: RunRecord
    trainer: Trainer
    checkpointer: Checkpointer
    resumed: dict[str, Any] | None = None  # the resumed checkpoint's header (run_id, config, ...), or None

    @property
    def state(self) -> runstate.TrainState:
        return self.trainer.state

    @property
    def output_dir(self) -> Path:
        return self.run_dir.path

    @property
    def batch(self) -> BatchUnits:
        return BatchUnits.of(self.config, self.world.size)

    @property
    def global_batch(self) -> int:
        """Examples per optimizer step, all ranks."""
        return self.batch.global_batch

    def save(self) -> None:
        """Write a checkpoint of the stateful parts (collective); ``best.pt`` follows the best evaluation saved."""
        runstate.save(self.trainer.state, self.checkpointer, self.config)
        runstate.keep_best(self.trainer.state.progress, self.checkpointer)

    def close(self) -> None:
        """Stop the threads and handlers the job started; safe to call twice."""
        self.trainer.watchdog.stop()
        self.trainer.stop.close()
        self.trainer.data.close()
        self.record.close()
        self.run_dir.release()


def choose_amp(config: TrainConfig, device: torch.device) -> torch.dtype | None:
    """The autocast dtype: bf16 needs no loss scaling, so auto takes it wherever the device supports it."""
    if config.amp == "off":
        return None
    if config.amp == "fp16":
        check_amp_device(config.amp, device.type)
        return torch.float16
    bf16_ok = device.type != "cuda" or torch.cuda.is_bf16_supported()
    if config.amp == "bf16" and not bf16_ok:
        raise UsageError(f"--amp bf16: {torch.cuda.get_device_name(device)} has no bf16; use --amp fp16")
    return torch.bfloat16 if bf16_ok else torch.float16


def is_convolutional(model: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv2d) for m in model.modules())


def model_channels_last(setting: str, model: nn.Module) -> bool:
    """Whether ``--channels-last`` asks for NHWC: ``on``, or ``auto`` for a model with convolutions, on CUDA and on a
    CPU alike: hpcdl's models step faster in NHWC on CPU cores too (benchmarks/results/cpu_layout.md)."""
    return setting != "off" and is_convolutional(model)


def put_in_nhwc(setting: str, work: Workload, device: torch.device, nhwc_batches: bool) -> bool:
    """Turn the model to NHWC where ``--channels-last`` asks and its forward takes it; whether it now is.

    A forward that ``.view``s an activation NHWC leaves non-contiguous fails (a classic LeNet's ``x.view(n, -1)``):
    the model then stays NCHW, in one line, or with ``on`` the run stops in one line, before any step."""
    if not model_channels_last(setting, work.model):
        return False
    work.model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    failure = agree(lambda: nhwc_failure(work, device, nhwc_batches, required=setting == "on"))
    if failure is None:
        return True
    work.model.to(memory_format=torch.contiguous_format)  # type: ignore[call-overload]
    print0(f"hpcdl: --channels-last auto: {work.label} cannot run in NHWC ({failure}); training in NCHW (use .reshape "
           "or torch.flatten in its forward to gain NHWC's speed)")
    return False


def nhwc_failure(work: Workload, device: torch.device, nhwc_batches: bool, required: bool) -> str | None:
    """Why the (NHWC) model cannot run a first batch, or None; a UsageError where NHWC was ``required``."""
    failure = work.first_batch_failure(device, torch.channels_last if nhwc_batches else torch.contiguous_format)
    if failure is not None and required:
        raise UsageError(f"--channels-last on: {work.label} cannot run in NHWC ({failure}); use .reshape or "
                         "torch.flatten in its forward, or --channels-last off")
    return failure


def zero_momentum_buffers(optimizer: torch.optim.Optimizer) -> None:
    """Zero SGD momentum buffers before the first step: the same first update as torch's (buffer = gradient, as
    dampening is 0), and a skipped first step cannot leave the fused kernel an uninitialised buffer."""
    for group in optimizer.param_groups:
        if group.get("momentum"):
            for p in group["params"]:
                optimizer.state[p].setdefault("momentum_buffer", torch.zeros_like(p))


def match_state_layouts(optimizer: torch.optim.Optimizer) -> None:
    """Give each optimizer state tensor its parameter's memory layout (a checkpoint may come from a run with
    another layout, and a fused update silently mixes up elements of tensors whose layouts differ)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                if torch.is_tensor(value) and value.shape == p.shape and value.stride() != p.stride():
                    layout = torch.channels_last if p.dim() == 4 and not p.is_contiguous() else torch.contiguous_format
                    optimizer.state[p][key] = value.contiguous(memory_format=layout)


def check_grad_workers(config: TrainConfig, world_size: int) -> None:
    """KAISA's gradient-worker groups must tile the ranks: one line naming the fractions that do on this world size
    (a resume onto another world size is checked here too, before anything is loaded)."""
    if not config.kfac or config.kfac_impl != "hpcdl":
        return
    from kfac.assignment import grad_worker_count  # only here: a --kfac-impl run may have another `kfac` first

    fraction = config.kfac_grad_worker_fraction
    if fraction == "auto":  # chosen among the fractions that tile this world
        return
    assert isinstance(fraction, float)
    try:
        grad_worker_count(world_size, fraction)
    except ValueError:
        fits = ", ".join(f"{k}/{world_size}" if k < world_size else "1" for k in range(1, world_size + 1)
                         if world_size % k == 0)
        raise UsageError(f"--kfac-grad-worker-fraction {fraction:g} gives {fraction * world_size:g} gradient workers "
                         f"per layer on {world_size} ranks, which do not divide them into groups; on {world_size} "
                         f"ranks use one of {fits}") from None


def check_skip_names(model: nn.Module, names: list[str]) -> None:
    """A --kfac-skip-layers (or Task.kfac_skip) name must match a module of the model, by name (or a name it
    is inside of) or by class name (case-insensitive), as K-FAC matches them: a typo would skip nothing, silently."""
    modules = list(model.named_modules())
    classes = {type(module).__name__.lower() for _, module in modules}
    unmatched = [name for name in names if name.lower() not in classes
                 and not any(m == name or m.startswith(name + ".") for m, _ in modules)]
    if unmatched:
        shown = ", ".join(m for m, _ in modules[1:9]) + (", ..." if len(modules) > 9 else "")
        raise UsageError(f"--kfac-skip-layers {' '.join(unmatched)}: no module of the model has this name or class "
                         f"(its modules: {shown or 'none'})")


def refuse_earlier_checkpoints(path: Path, is_root: bool) -> None:
    """A new run must not mix its checkpoints with an earlier run's (the earlier ones would be pruned as its own)."""
    if is_root and checkpoint_files.list_checkpoints(checkpoint_files.checkpoint_dir(path)):
        raise UsageError(f"{path} already holds checkpoints of an earlier run: add --resume to continue it, or "
                         "choose another --output-dir")


def compile_and_warm_up(model: nn.Module, data: InputPipeline, spec: DataSpec, device: torch.device,
                        amp_dtype: torch.dtype | None, micro_batches: int = 1) -> nn.Module:
    """torch.compile the model and compile its training graphs now, on a dummy batch, before the stall watchdog
    runs and before Horovod hooks the gradients (compiling can take minutes; a hooked backward would allreduce).
    The model's state is put back afterwards, so that the dummy step changes no BatchNorm statistics."""
    compiled = torch.compile(model, dynamic=False)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    fmt = torch.channels_last if spec.channels_last and len(data.input_shape) == 3 else torch.contiguous_format
    # the shape the loop calls the model with: one micro-batch (static shapes: another would recompile)
    batch = torch.zeros(spec.batch_size // micro_batches, *data.input_shape, device=device).to(memory_format=fmt)
    autocast = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()
    with autocast:
        out = compiled(batch)
    out.float().sum().backward()
    model.zero_grad(set_to_none=True)
    model.load_state_dict(saved)
    return compiled  # type: ignore[return-value]  # torch.compile of a Module is a Module


def build_job(config: TrainConfig, task: TaskSource | None = None) -> Job:
    """Build the job of ``config``; ``task``: a Task (or the function that returns one) given by the Python API
    instead of ``--task``'s path."""
    if deterministic(config):
        world.fix_reduction_order()
    me = backends.named(config.backend).start_world(config, backends.collective_timeout(config.stall_timeout))
    if (alone := launcher.started_alone(me.size)) is not None:  # N copies of one run otherwise
        raise UsageError(f"{alone}; {launcher.SAME_MPI_FIX}")
    comm = world.comm()
    cuda = me.device.type == "cuda"
    placement.verify(me, comm, gpu_requested=config.device == "cuda")
    if config.device == "cpu" and cuda:
        raise UsageError("--device cpu on a rank that was given a GPU: hide it with CUDA_VISIBLE_DEVICES=''")
    faults = agree(lambda: FaultInjector(me.rank, world_size=me.size))
    agree(lambda: backends.named(config.backend).check_world(config, me.size, cuda))
    agree(lambda: check_grad_workers(config, me.size))
    amp_dtype = agree(lambda: choose_amp(config, me.device))
    if warning := slow_bf16_warning(amp_dtype, me.device):
        print0(warning)
    run_dir = claim(config.output_dir, comm, resume=config.resume)
    try:
        return _build_job_in(run_dir, config, me, comm, faults, amp_dtype, task if task is not None else config.task)
    except BaseException:
        run_dir.release()
        raise


def train_in_tf32() -> None:
    """TF32 for the model's float32 matmuls and convolutions, the precision PyTorch's docs recommend for training
    (cuBLAS and cuDNN only: a CPU run is unchanged). Set through the ``fp32_precision`` flags, the ones
    kfac.precision.ieee_fp32 switches off around K-FAC's stages: torch refuses a process that mixes them with the
    legacy ``allow_tf32`` switches."""
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    torch.backends.cudnn.conv.fp32_precision = "tf32"  # type: ignore[attr-defined]


def deterministic(config: TrainConfig) -> bool:
    """``--deterministic``: auto is on where it is cheap and promised, i.e. for CPU runs."""
    if config.deterministic != "auto":
        return config.deterministic == "on"
    return config.device == "cpu" or not torch.cuda.is_available()


def _build_job_in(run_dir: RunDir, config: TrainConfig, me: world.World, comm: Any, faults: FaultInjector,
                  amp_dtype: torch.dtype | None, task_source: TaskSource | None = None) -> Job:
    """The job on a claimed run directory, the world up: numerics settings, checkpoints (and the one to resume),
    data, model (built in, or the user's task), update rule, K-FAC, the trainer; every rank builds the same,
    failing together (agree)."""
    cuda = me.device.type == "cuda"
    train_in_tf32()  # on every run, so that CPU and GPU runs are in one state (K-FAC switches it per stage)
    if cuda:
        torch.backends.cudnn.benchmark = config.cudnn_benchmark  # fixed shapes: let cuDNN time its kernels once
    if cuda and deterministic(config):  # kernels whose result does not depend on thread timing (cuDNN, scatter-add)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.use_deterministic_algorithms(True)

    torch.manual_seed(config.seed)  # identical initial weights on every rank (and broadcast to be sure)
    watchdog = StallWatchdog(comm, config.stall_timeout)
    checkpointer = Checkpointer(run_dir.path, run_dir.run_id, comm, config.keep_checkpoints, watchdog, faults)
    if not config.resume:
        agree(lambda: refuse_earlier_checkpoints(run_dir.path, me.is_root))
    resumed = runstate.read_latest(checkpointer) if config.resume else None
    if config.resume and resumed is None:
        print0("no checkpoint to resume from: starting from scratch")
    # The batches' layout, chosen before the model exists: NHWC where asked, and on CUDA. On a CPU, auto leaves them
    # NCHW: an NHWC model's first convolution takes them as they are at no measurable cost (resnet32 on CIFAR's shape).
    nhwc_batches = config.channels_last == "on" or (config.channels_last == "auto" and cuda)
    batch = BatchUnits.of(config, me.size)
    spec = DataSpec(
        dataset=config.dataset, data_dir=config.data_dir, batch_size=batch.per_rank_step,
        test_batch_size=config.test_batch_size, workers=config.workers, seed=config.seed, decode=config.decode,
        channels_last=nhwc_batches, synthetic_shape=tuple(config.synthetic_shape),  # type: ignore[arg-type]
        synthetic_classes=config.synthetic_classes, synthetic_size=config.synthetic_size)
    work = build_workload(config, task_source, spec, me)  # after the seed: its initial weights
    data, model = work.data, work.model
    kfac_skip = [*config.kfac_skip_layers, *work.kfac_skip]
    if config.kfac:
        agree(lambda: check_skip_names(model, kfac_skip))
    backend = backends.for_config(config, me.size)
    backend.broadcast_parameters(model)  # identical by seed already; the broadcast makes sure, before layouts change
    # before the optimizer exists, so that its state is made in the layout chosen
    channels_last = put_in_nhwc(config.channels_last, work, me.device, nhwc_batches)
    compiled = (compile_and_warm_up(model, data, spec, me.device, amp_dtype, config.batches_per_allreduce)
                if config.compile else model)

    peak_lr = config.base_lr * lr_scale(me.size, config.batches_per_allreduce, config.use_adasum, me.local_size, cuda)
    schedule = LRSchedule(warmup_start(config.base_lr, peak_lr, warmup_start_factor(config)), peak_lr,
                          config.warmup_epochs, config.epochs, config.lr_schedule, config.lr_decay)
    optimizer = backend.wrap_optimizer(work.optimizer(build_update_rule(config, model, schedule(0.0))), model, config)
    zero_momentum_buffers(optimizer)  # after wrapping: Horovod's wrapper builds a new optimizer from the groups
    scaler = torch.amp.GradScaler("cuda") if amp_dtype == torch.float16 else None
    kfac_config = dataclasses.replace(config, kfac_skip_layers=kfac_skip) if work.kfac_skip else config
    with warnings.catch_warnings(record=True) as said:  # K-FAC's warnings (layers it skips): one line, rank 0
        preconditioner = agree(lambda: build_preconditioner(kfac_config, model,
                                                            lambda *_: optimizer.param_groups[0]["lr"], scaler,
                                                            backend.kfac_communicator()))
    for warning in said:
        print0(f"hpcdl: {warning.category.__name__}: {warning.message}")

    state = runstate.TrainState(model, optimizer, scaler, preconditioner)
    # A resume drops the records of the steps after its checkpoint: they were trained, then discarded.
    kept_through = (resumed["global_step"] if resumed is not None else 0) if config.resume else None
    record = agree(lambda: RunRecord(run_dir.path, me.is_root, kept_through, run_dir.run_id))
    phases = StepPhases(preconditioner, me.device)
    trace = None
    if config.profile_steps:
        trace = TraceWindow(parse_profile_steps(config.profile_steps), run_dir.path / "traces", me.rank, phases,
                            backend.timeline())
    trainer = Trainer(model=backend.wrap_model(compiled, config), state=state, schedule=schedule,
                      criterion=work.criterion, amp_dtype=amp_dtype, data=data, world=me, comm=comm, watchdog=watchdog,
                      stop=GracefulStop(comm), faults=faults, settings=LoopSettings.of(config), backend=backend,
                      scoring=work.scoring, phases=phases, trace=trace)
    job = Job(config=config, world=me, comm=comm, run_dir=run_dir, record=record, trainer=trainer,
              checkpointer=checkpointer)
    if resumed is not None:  # every rank restores the same broadcast checkpoint: replicas stay identical
        runstate.restore(state, resumed, config, me.rank, me.size, run_dir.path)
        job.resumed = {key: value for key, value in resumed.items() if key not in state.parts() and key != "rng"}
        match_state_layouts(optimizer)
    watchdog.start()
    print0(
        f"hpcdl: {work.label} | {me.size} rank(s) x batch {batch.per_pass} x {batch.passes} = global batch "
        f"{batch.global_batch}"
        f" | lr {config.base_lr} -> {peak_lr:g} | {data.steps_per_epoch} steps/epoch | {me.device}"
        f"{'' if cuda else f' ({me.threads} thread(s)/rank)'} | amp {amp_dtype or 'off'}"
        f"{' | channels_last' if channels_last else ''}{' | compiled' if config.compile else ''}"
        f" | {'K-FAC' if preconditioner else 'SGD-family'} ({config.optimizer}) | {backend.describe()}"
        f" | run {run_dir.run_id} in {run_dir.path}")
    return job


@contextlib.contextmanager
def opened(config: TrainConfig, task: TaskSource | None = None) -> Iterator[Job]:
    """``with opened(config) as job:`` builds the job and always closes it."""
    job = build_job(config, task)
    try:
        yield job
    finally:
        job.close()
