"""Your own model, data and loss: the :class:`Task` a user's function returns, and how hpcdl loads and checks it.

``python -m hpcdl.train --task package.module:function`` calls ``function()`` on every rank (after the run's
seed is set, so a model built there starts from the same weights everywhere) and trains what it returns with
everything hpcdl gives its own models: the flags, the optimizers and K-FAC, AMP, accumulation, checkpoints and
exact resume, the records. What a task must be, and what is refused (one line each, on every rank, before
anything is written), is here; docs/training.md ("Your own model") is the user's description.
"""

from __future__ import annotations

import importlib
import inspect
import numbers
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, default_collate

from hpcdl.data.spec import DataSpec
from hpcdl.data.user import DatasetPipeline, check_map_style
from hpcdl.runtime.errors import UsageError

Metric = Callable[[Tensor, Tensor], Any]  # (outputs, targets) -> the batch's mean of a per-example number
GOALS = ("min", "max")
# A metric is recorded as test_<name>; a metric named "loss" would replace the task's own test_loss.
RESERVED_METRICS = ("loss",)


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
    ``goal`` may be left out only where ``best`` is the loss (min); a metric's direction is the task's to say.
    ``kfac_skip``: module names or class names that K-FAC leaves to the optimizer, as ``--kfac-skip-layers``.
    ``collate``: a function from a list of items to an ``(inputs, targets)`` pair of tensors, for items torch's
    ``default_collate`` cannot stack (sequences of different lengths: pad them there) or items of another form
    (dicts). ``param_groups``: a function from the model to torch parameter groups (dicts with ``params`` and
    options of their own, e.g. ``weight_decay=0.0`` for norms and biases), every trainable parameter in one;
    ``optimizer_options``: keywords for the ``--optimizer``'s constructor beyond the flags (AdamW's ``betas``).
    The learning rate is the schedule's in every group.
    """

    model: nn.Module
    train_data: Dataset
    eval_data: Dataset
    loss: Callable[[Tensor, Tensor], Tensor]
    metrics: Mapping[str, Metric] = field(default_factory=dict)
    best: str = "loss"
    goal: str | None = None
    kfac_skip: Sequence[str] = ()
    collate: Callable[[list[Any]], tuple[Tensor, Tensor]] | None = None
    param_groups: Callable[[nn.Module], list[dict[str, Any]]] | None = None
    optimizer_options: Mapping[str, Any] = field(default_factory=dict)


TaskSource = str | Task | Callable[[], Task]  # --task's path, or (the Python API) a Task or its function


def accuracy(outputs: Tensor, targets: Tensor) -> Tensor:
    """The share of examples whose highest output is the target class (a metric for classification tasks)."""
    return (outputs.argmax(1) == targets).float().mean()


def import_function(spec: str, flag: str, form: str = "package.module:function") -> Callable[..., Any]:
    """``package.module:function`` -> the function, or one line saying why not (every flag that names a function:
    --task, --model, --kfac-impl); ``form``: what the flag takes, for the line."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise UsageError(f"{flag} takes {form} (got {spec!r})")
    if module_name.endswith(".py") or "/" in module_name:
        dotted = module_name.removesuffix(".py").strip("./").replace("/", ".")
        raise UsageError(f"{flag} takes a module's name, not a file's: write {dotted}:{attribute} (run from the "
                         f"folder that holds it, or put that folder on PYTHONPATH)")
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


def one_line(exc: BaseException | str) -> str:
    """An exception's message on one line: its first line, and where that ends in a colon (torch's "Error(s) in
    loading state_dict for Net:") the detail after it, the following lines joined."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    if len(lines) > 1 and lines[0].endswith(":"):
        return " ".join(lines[:4]) + (" ..." if len(lines) > 4 else "")
    return lines[0]


def call_user(function: Callable[..., Any], what: str, *args: Any) -> Any:
    """Call the user's function; whatever it raises becomes one line naming it (no traceback wall)."""
    try:
        return function(*args)
    except UsageError:
        raise
    except Exception as exc:
        raise UsageError(f"{what} raised {type(exc).__name__}: {one_line(exc)}") from None


def load_task(source: TaskSource) -> Task:
    """The checked Task of ``--task`` (a ``module:function`` path) or of a function (called after the seed is set).

    A Task object is refused: its model was built before the run set ``--seed``, so the run could neither start
    from the seed's weights it records nor start afresh when run twice (it would continue the first run's)."""
    if isinstance(source, Task):
        raise UsageError("hpcdl.train.run takes the function that returns the Task (run(make_task, ...)), not a Task "
                         "object: its model was built before --seed was set, so a run could not start from the "
                         "seed's weights, and a second run would continue the first one's")
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
        check_map_style(getattr(task, name), f"{what}: Task.{name}")
    if not callable(task.loss):
        raise UsageError(f"{what}: Task.loss is a {type(task.loss).__name__}, not a function")
    bad = [name for name, metric in task.metrics.items() if not callable(metric)]
    if bad:
        raise UsageError(f"{what}: the metric(s) {', '.join(bad)} are not functions")
    clashes = [name for name in task.metrics if name in RESERVED_METRICS]
    if clashes:
        raise UsageError(f"{what}: a metric may not be named {clashes[0]!r}: test_{clashes[0]} is the task's own "
                         "loss in the records (and in the choice of best); rename the metric")
    if task.best != "loss" and task.best not in task.metrics:
        raise UsageError(f"{what}: Task.best {task.best!r} is neither 'loss' nor one of its metrics "
                         f"({', '.join(task.metrics) or 'none'})")
    if task.goal is None and task.best != "loss":
        raise UsageError(f"{what}: Task.best {task.best!r} names a metric: say which way it improves, "
                         "goal='max' (e.g. accuracy) or goal='min' (e.g. an error)")
    if task.goal is not None and task.goal not in GOALS:
        raise UsageError(f"{what}: Task.goal must be 'min' or 'max' (got {task.goal!r})")
    if task.collate is not None and not callable(task.collate):
        raise UsageError(f"{what}: Task.collate is a {type(task.collate).__name__}, not a function")
    return replace(task, goal=task.goal or "min")


def eval_forward(model: nn.Module, inputs: Tensor) -> Any:
    """The model's output for a check's batch: eval mode and no gradients (no BatchNorm statistics change, no dropout
    drawn), the model back in training mode afterwards whatever happens."""
    try:
        with torch.no_grad():
            return model.eval()(inputs)
    finally:
        model.train()


def describe(value: Any) -> str:
    """A batch's part as its shape and dtype, for the line that says it did not fit."""
    if isinstance(value, Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    return type(value).__name__


def first_batch(task: Task, split: str = "train_data") -> tuple[Tensor, Tensor]:
    """Two examples of ``split`` collated as the loop's batches are: ``(inputs, targets)`` tensors, or one line."""
    data = getattr(task, split)
    examples = [data[i] for i in range(min(2, len(data)))]
    if task.collate is None:
        for example in examples:
            if isinstance(example, Mapping):
                raise UsageError(f"the task's {split} items are dicts (keys {', '.join(map(str, example))}); hpcdl "
                                 "takes (input, target) pairs: give Task.collate, a function from a list of items to "
                                 "(inputs, targets) tensors, or return the pair from __getitem__")
            if not (isinstance(example, (tuple, list)) and len(example) == 2):
                raise UsageError(f"the task's {split} items are {type(example).__name__}s; each must be an "
                                 "(input, target) pair (or give Task.collate)")
    collate = task.collate or default_collate
    try:
        batch = collate(examples)
    except Exception as exc:
        fix = "" if task.collate is not None else (
            ": items of different shapes need Task.collate, a function from a list of items to (inputs, targets) "
            "tensors that pads them to the longest")
        raise UsageError(f"the task's {split} items cannot be batched ({type(exc).__name__}: {one_line(exc)}){fix}") \
            from None
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise UsageError(f"the task's collate returns a {type(batch).__name__}; it must return (inputs, targets)")
    inputs, targets = batch
    for name, value in (("input", inputs), ("target", targets)):
        if not isinstance(value, Tensor):
            raise UsageError(f"the task's {split} {name}s batch to a {type(value).__name__}; hpcdl takes tensors "
                             "(or numbers)")
    return inputs, targets


def check_first_batch(task: Task, model: nn.Module, device: torch.device) -> None:
    """Run a batch of the training data and one of the evaluation data through collation, model, loss and metrics,
    so that what cannot take them fails with one line naming the shapes before any rank trains (and before an
    epoch is lost to an evaluation that cannot run); then find parameters the loss does not depend on.

    Run before the parameters are broadcast: a lazy module (nn.LazyLinear) gets its parameters here."""
    for split in ("train_data", "eval_data"):
        inputs, targets = (t.to(device) for t in first_batch(task, split))
        shapes = f"inputs {describe(inputs)}, targets {describe(targets)}"
        where = "a first batch" if split == "train_data" else "an evaluation batch"
        try:
            outputs = eval_forward(model, inputs)
        except Exception as exc:
            raise UsageError(f"the task's model cannot take {where} of {shapes} "
                             f"({type(exc).__name__}: {one_line(exc)})") from None
        if not isinstance(outputs, Tensor):
            raise UsageError(f"the task's model returns a {type(outputs).__name__} for {shapes}; hpcdl needs one "
                             "tensor (a model returning (logits, loss): wrap it, see examples/wrapped_outputs.py)")
        shapes += f", outputs {describe(outputs)}"
        loss = call_user(task.loss, f"the task's loss on {where} of {shapes}", outputs.float(), targets)
        if not (isinstance(loss, Tensor) and loss.numel() == 1 and loss.is_floating_point()):
            raise UsageError(f"the task's loss returns {describe(loss)} for {where} of {shapes}; it must be the "
                             "batch's mean as a scalar floating-point tensor")
        for name, metric in task.metrics.items():
            value = call_user(metric, f"the task's metric {name!r} on {where} of {shapes}", outputs.float(), targets)
            if as_number(value) is None:
                raise UsageError(f"the task's metric {name!r} returns {describe(value)} for {where} of {shapes}, "
                                 "not a number (a scalar tensor, int or float)")
    unused = unused_parameters(task, model, device)
    if unused:
        more = f" and {len(unused) - 4} more" if len(unused) > 4 else ""
        raise UsageError(f"the task's loss does not depend on the parameter(s) {', '.join(unused[:4])}{more} on a "
                         "first batch: several ranks cannot tell them from ones they wait for (torch's DDP fails, "
                         "Horovod zero-fills them), so one rank and many would train differently; freeze them "
                         "(requires_grad_(False)) or leave them out of the model")


def unused_parameters(task: Task, model: nn.Module, device: torch.device) -> list[str]:
    """The trainable parameters a training-mode forward and loss of a first batch do not reach. The model's
    buffers (BatchNorm statistics) and the random state are put back, so the check changes nothing."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not named:
        return []
    inputs, targets = (t.to(device) for t in first_batch(task))
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        loss = task.loss(model(inputs).float(), targets)
        grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)
    return [name for (name, _), grad in zip(named, grads, strict=True) if grad is None]


def as_number(value: Any) -> float | None:
    """A metric's value as a float, or None when it is not one number."""
    if isinstance(value, Tensor):
        return float(value) if value.numel() == 1 and not value.is_complex() else None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):  # numpy's scalars are numbers.Real too
        return float(value)
    return None


def task_optimizer(rule: torch.optim.Optimizer, task: Task, model: nn.Module) -> torch.optim.Optimizer:
    """The ``--optimizer`` rule rebuilt over the task's parameter groups and with its options (the flags' values
    stay the defaults of every group), or ``rule`` itself when the task has neither; bad groups are one line."""
    if task.param_groups is None and not task.optimizer_options:
        return rule
    groups: Any = [{"params": list(model.parameters())}]
    if task.param_groups is not None:
        groups = call_user(task.param_groups, "the task's param_groups", model)
        if not (isinstance(groups, list) and groups and all(isinstance(g, dict) and "params" in g for g in groups)):
            raise UsageError("the task's param_groups must return a list of dicts, each with 'params'")
        groups = [{**g, "params": list(g["params"])} for g in groups]
        grouped = {id(p) for g in groups for p in g["params"]}
        left = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in grouped]
        if left:
            raise UsageError(f"the task's param_groups leave out {', '.join(left[:4])}"
                             f"{f' and {len(left) - 4} more' if len(left) > 4 else ''}: they would never be trained; "
                             "put every trainable parameter in a group")
    accepted = inspect.signature(type(rule)).parameters  # defaults may hold more than the constructor takes
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    options = {**{k: v for k, v in rule.defaults.items() if takes_any or k in accepted}, **task.optimizer_options}
    try:
        return type(rule)(groups, **options)
    except Exception as exc:  # the optimizer's own checks raise what they like (betas of one value: IndexError)
        raise UsageError(f"the task's optimizer options {dict(task.optimizer_options)} or groups do not fit "
                         f"{type(rule).__name__} ({type(exc).__name__}: {one_line(exc)})") from None


def task_data(task: Task, spec: DataSpec, rank: int, size: int, device: torch.device) -> DatasetPipeline:
    """The task's datasets through hpcdl's sharded order (:mod:`hpcdl.data.user`)."""
    return DatasetPipeline(spec, rank, size, device, train=task.train_data, test=task.eval_data, collate=task.collate)
