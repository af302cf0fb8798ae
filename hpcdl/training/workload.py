"""What is trained: the data, model, loss and scoring of a run, for hpcdl's built-in models or a user's Task.

:func:`build_workload` is the one place that tells the two apart, so that the job (:mod:`hpcdl.training.job`)
builds every run the same way: it checks the first batch here (before the parameters are broadcast: a lazy module
gets its parameters in the check), and asks the :class:`Workload` for the optimizer's groups and K-FAC's skips.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hpcdl.data import DataSpec, InputPipeline, build_pipeline
from hpcdl.runtime.errors import UsageError, agree
from hpcdl.runtime.world import World
from hpcdl.training.config import TrainConfig
from hpcdl.training.models import build_model
from hpcdl.training.scoring import Scoring, scoring_of
from hpcdl.training.task import (
    Task,
    TaskSource,
    check_first_batch,
    eval_forward,
    first_batch,
    load_task,
    one_line,
    task_data,
    task_label,
    task_optimizer,
)


@dataclass
class Workload:
    """A run's data, model (on the rank's device, checked on a first batch), loss and scoring; ``label`` names it
    in the banner; ``kfac_skip``: what it leaves to the optimizer beyond ``--kfac-skip-layers``."""

    data: InputPipeline
    model: nn.Module
    criterion: Callable[..., torch.Tensor]
    scoring: Scoring
    label: str
    kfac_skip: Sequence[str] = ()
    task: Task | None = None

    def first_batch_failure(self, device: torch.device, layout: torch.memory_format) -> str | None:
        """Why the model cannot run a first batch in ``layout`` (a 4-D batch's), in one line, or None when it can:
        the model's layout is changed after the first-batch checks, and a forward may depend on it."""
        inputs = (first_batch(self.task)[0].to(device) if self.task is not None
                  else torch.zeros(2, *self.data.input_shape, device=device))
        try:
            eval_forward(self.model, inputs.contiguous(memory_format=layout) if inputs.dim() == 4 else inputs)
        except Exception as exc:
            return f"{type(exc).__name__}: {one_line(exc)}"
        return None

    def optimizer(self, rule: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The ``--optimizer`` rule over the task's parameter groups and options; the rule itself for built-ins."""
        if self.task is None:
            return rule
        task = self.task
        return agree(lambda: task_optimizer(rule, task, self.model))


def build_workload(config: TrainConfig, source: TaskSource | None, spec: DataSpec, me: World) -> Workload:
    """The workload of ``--task`` (or the Python API's task), else of ``--model`` on ``--dataset``; collective (every
    rank fails together). Call after the seed is set: the model's initial weights are drawn here."""
    if source is None:
        data = agree(lambda: build_pipeline(spec, me.rank, me.size, me.device))
        model = agree(lambda: build_model(config.model, data.num_classes, data.input_shape[0])).to(me.device)
        agree(lambda: try_one_batch(model, data, config, me.device))
        return Workload(data, model, nn.CrossEntropyLoss(label_smoothing=config.label_smoothing), scoring_of(None),
                        f"{config.model} on {config.dataset}")
    task = agree(lambda: load_task(source))
    model = task.model.to(me.device)
    # Before the pipeline and the broadcast: what the model, loss or metrics cannot take is one line, and a lazy
    # module gets its parameters (the same on every rank, drawn after the seed) before they are sent.
    agree(lambda: check_first_batch(task, model, me.device))
    data = agree(lambda: task_data(task, spec, me.rank, me.size, me.device))
    return Workload(data, model, task.loss, scoring_of(task), task_label(source), tuple(task.kfac_skip), task)


def try_one_batch(model: nn.Module, data: InputPipeline, config: TrainConfig, device: torch.device) -> None:
    """Run the model once on a batch of the dataset's shape, so a model that cannot take this input fails with
    one line naming the model, the input size and a fix, before any rank starts training."""
    shape = (2, *data.input_shape)
    try:
        out: Any = eval_forward(model, torch.zeros(shape, device=device))
    except RuntimeError as exc:
        raise UsageError(
            f"--model {config.model} cannot take {config.dataset}'s {'x'.join(map(str, data.input_shape))} images "
            f"({one_line(exc)}); choose a model made for this input size (e.g. resnet20-110 or "
            f"{'digits_cnn' if data.input_shape[-1] <= 16 else 'resnet18'})") from exc
    if out.ndim != 2 or out.shape[1] != data.num_classes:
        raise UsageError(f"--model {config.model} gives outputs of shape {tuple(out.shape)} for a batch of 2, "
                         f"not (2, {data.num_classes}) for {config.dataset}'s {data.num_classes} classes")
