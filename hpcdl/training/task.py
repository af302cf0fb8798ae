"""Your own model, data and loss: the :class:`Task` a user's function returns, and how hpcdl loads and checks it.

``python -m hpcdl.train --task package.module:function`` calls ``function()`` on every rank (after the run's
seed is set, so a model built there starts from the same weights everywhere) and trains what it returns with
everything hpcdl gives its own models: the flags, the optimizers and K-FAC, AMP, accumulation, checkpoints and
exact resume, the records. What a task must be, and what is refused (one line each, on every rank, before
anything is written), is here; docs/training.md ("Your own model") is the user's description.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, IterableDataset, default_collate

from hpcdl.data.spec import DataSpec
from hpcdl.data.user import DatasetPipeline
from hpcdl.runtime.errors import UsageError

Metric = Callable[[Tensor, Tensor], Any]  # (outputs, targets) -> the batch's mean of a per-example number
GOALS = ("min", "max")


@dataclass
class Task:
    """What a run needs from its user; hpcdl does the rest.

    ``train_data`` and ``eval_data`` are map-style datasets (``__len__`` and ``__getitem__``) whose items are
    ``(input, target)`` pairs of tensors (or numbers); hpcdl shards them over the ranks itself. ``loss(outputs,
    targets)`` returns the batch's mean loss as a scalar tensor (the value that is differentiated). Each metric
    returns the batch's mean of a per-example number; hpcdl reports its mean over the evaluation set as
    ``test_<name>`` (the loss is always reported, as ``test_loss``). ``best`` names what decides the best
    evaluation and ``--target-metric``: ``"loss"`` or a metric's name, improving towards ``goal`` (min or max).
    A metric named ``accuracy`` is also computed on the training batches (``train_accuracy``).
    ``kfac_skip``: module names or class names that K-FAC leaves to the optimizer, as ``--kfac-skip-layers``.
    """

    model: nn.Module
    train_data: Dataset
    eval_data: Dataset
    loss: Callable[[Tensor, Tensor], Tensor]
    metrics: Mapping[str, Metric] = field(default_factory=dict)
    best: str = "loss"
    goal: str = "min"
    kfac_skip: Sequence[str] = ()


TaskSource = str | Task | Callable[[], Task]  # --task's path, or (the Python API) a Task or its function


def accuracy(outputs: Tensor, targets: Tensor) -> Tensor:
    """The share of examples whose highest output is the target class (a metric for classification tasks)."""
    return (outputs.argmax(1) == targets).float().mean()


def import_function(spec: str, flag: str) -> Callable[..., Any]:
    """``package.module:function`` -> the function, or one line saying why not."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise UsageError(f"{flag} takes package.module:function (got {spec!r})")
    look_in_the_working_folder_last()
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module may raise anything while it is imported
        raise UsageError(f"{flag} {spec}: cannot import {module_name} ({type(exc).__name__}: {one_line(exc)})") \
            from None
    function = getattr(module, attribute, None)
    if function is None:
        raise UsageError(f"{flag} {spec}: {module_name} has no {attribute!r}")
    if not callable(function):
        raise UsageError(f"{flag} {spec}: {attribute} is a {type(function).__name__}, not a function")
    return function


def look_in_the_working_folder_last() -> None:
    """A user's module usually sits in the folder the job starts in, which Python leaves off its path where it
    must not shadow what is installed (the image sets PYTHONSAFEPATH so that its own hpcdl runs). Look there
    too, last: the folder's modules are found, but cannot replace hpcdl or an installed package."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.append(here)


def one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def call_user(function: Callable[..., Any], what: str, *args: Any) -> Any:
    """Call the user's function; whatever it raises becomes one line naming it (no traceback wall)."""
    try:
        return function(*args)
    except UsageError:
        raise
    except Exception as exc:
        raise UsageError(f"{what} raised {type(exc).__name__}: {one_line(exc)}") from None


def load_task(source: TaskSource) -> Task:
    """The checked Task of ``--task`` (a ``module:function`` path), of a function, or a Task as it is."""
    if isinstance(source, Task):
        return check_task(source, "the task")
    if isinstance(source, str):
        function, what = import_function(source, "--task"), f"--task {source}"
    else:
        function, what = source, f"the task function {getattr(source, '__qualname__', source)!r}"
    return check_task(call_user(function, what), what)


def task_label(source: TaskSource) -> str:
    """What a run records as its task (a resume must bring the same one)."""
    if isinstance(source, str):
        return source
    if isinstance(source, Task):
        return f"python:{type(source.model).__name__}"
    return f"{getattr(source, '__module__', '?')}:{getattr(source, '__qualname__', '?')}"


def check_task(task: Any, what: str) -> Task:
    """What can be checked without running anything: the kinds of the parts, the datasets, ``best`` and ``goal``."""
    if not isinstance(task, Task):
        raise UsageError(f"{what} returned a {type(task).__name__}, not an hpcdl.training.task.Task")
    if not isinstance(task.model, nn.Module):
        raise UsageError(f"{what}: Task.model is a {type(task.model).__name__}, not a torch.nn.Module")
    for name in ("train_data", "eval_data"):
        check_dataset(getattr(task, name), f"{what}: Task.{name}")
    if not callable(task.loss):
        raise UsageError(f"{what}: Task.loss is a {type(task.loss).__name__}, not a function")
    bad = [name for name, metric in task.metrics.items() if not callable(metric)]
    if bad:
        raise UsageError(f"{what}: the metric(s) {', '.join(bad)} are not functions")
    if task.best != "loss" and task.best not in task.metrics:
        raise UsageError(f"{what}: Task.best {task.best!r} is neither 'loss' nor one of its metrics "
                         f"({', '.join(task.metrics) or 'none'})")
    if task.goal not in GOALS:
        raise UsageError(f"{what}: Task.goal must be 'min' or 'max' (got {task.goal!r})")
    return task


def check_dataset(data: Any, what: str) -> None:
    """A map-style dataset with at least one item; an IterableDataset cannot be sharded exactly, so it is refused."""
    if isinstance(data, IterableDataset):
        raise UsageError(f"{what} is an IterableDataset: hpcdl shards map-style datasets (__len__ and __getitem__) "
                         "so that each example is seen once per epoch and a resume is exact")
    if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise UsageError(f"{what} is a {type(data).__name__}: it needs __len__ and __getitem__ (a map-style "
                         "torch.utils.data.Dataset)")
    if len(data) < 1:
        raise UsageError(f"{what} is empty")


def describe(value: Any) -> str:
    """A batch's part as its shape and dtype, for the line that says it did not fit."""
    if isinstance(value, Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    return type(value).__name__


def first_batch(task: Task) -> tuple[Tensor, Tensor]:
    """Two training examples collated as the loop's batches are: ``(inputs, targets)`` tensors, or one line."""
    examples = [task.train_data[i] for i in range(min(2, len(task.train_data)))]  # type: ignore[arg-type]
    for example in examples:
        if not (isinstance(example, (tuple, list)) and len(example) == 2):
            raise UsageError(f"the task's train_data items are {type(example).__name__}s; each must be an "
                             "(input, target) pair")
    try:
        inputs, targets = default_collate(examples)
    except Exception as exc:
        raise UsageError(f"the task's train_data items cannot be batched ({one_line(exc)})") from None
    for name, value in (("input", inputs), ("target", targets)):
        if not isinstance(value, Tensor):
            raise UsageError(f"the task's train_data {name}s batch to a {type(value).__name__}; hpcdl takes tensors "
                             "(or numbers)")
    return inputs, targets


def check_first_batch(task: Task, model: nn.Module, device: torch.device, amp: Any = None) -> None:
    """Run model, loss and metrics once on a first batch, so that what cannot take it fails with one line naming
    the shapes, before any rank trains."""
    inputs, targets = (t.to(device) for t in first_batch(task))
    shapes = f"inputs {describe(inputs)}, targets {describe(targets)}"
    try:
        with torch.no_grad():
            outputs = model.eval()(inputs)
    except Exception as exc:
        raise UsageError(f"the task's model cannot take a first batch of {shapes} "
                         f"({type(exc).__name__}: {one_line(exc)})") from None
    finally:
        model.train()
    if not isinstance(outputs, Tensor):
        raise UsageError(f"the task's model returns a {type(outputs).__name__} for {shapes}; hpcdl needs a tensor")
    shapes += f", outputs {describe(outputs)}"
    loss = call_user(task.loss, f"the task's loss on a first batch of {shapes}", outputs.float(), targets)
    if not (isinstance(loss, Tensor) and loss.numel() == 1 and loss.is_floating_point()):
        raise UsageError(f"the task's loss returns {describe(loss)} for a first batch of {shapes}; it must be the "
                         "batch's mean as a scalar floating-point tensor")
    for name, metric in task.metrics.items():
        value = call_user(metric, f"the task's metric {name!r} on a first batch of {shapes}", outputs.float(), targets)
        number = as_number(value)
        if number is None:
            raise UsageError(f"the task's metric {name!r} returns {describe(value)} for a first batch of {shapes}, "
                             "not a number (a scalar tensor, int or float)")


def as_number(value: Any) -> float | None:
    """A metric's value as a float, or None when it is not one number."""
    if isinstance(value, Tensor):
        return float(value) if value.numel() == 1 and not value.is_complex() else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def task_data(task: Task, spec: DataSpec, rank: int, size: int, device: torch.device) -> DatasetPipeline:
    """The task's datasets through hpcdl's sharded order (:mod:`hpcdl.data.user`)."""
    return DatasetPipeline(spec, rank, size, device, train=task.train_data, test=task.eval_data)
