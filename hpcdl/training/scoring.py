"""What a run measures and what "best" means: image classification for hpcdl's own models, a task's loss and
metrics for a user's (:mod:`hpcdl.training.task`).

The loop asks a :class:`Scoring` for the training batch's accuracy term (the "correct" slot of
:class:`~hpcdl.persistence.metrics.DeviceSums`) and for the evaluation's sums; the epoch driver asks it which test
value decides "best" (and ``--target-accuracy`` / ``--target-metric``) and in which direction. Every value is an
exact mean over examples: per-batch means are weighted by the batch's examples and summed over ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from hpcdl.persistence.metrics import DeviceSums, allreduce_sums
from hpcdl.training.task import Task, as_number


class Scoring:
    """Built-in image classification: cross-entropy and accuracy; "best" is the highest test accuracy."""

    best_key = "test_accuracy"
    goal = "max"
    train_accuracy = True  # the training rows carry train_accuracy

    def correct(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """The batch's count of correct predictions, on the device (0 where accuracy is not measured)."""
        return (outputs.argmax(1) == targets).sum()

    def evaluate(self, batches: Iterable[tuple[Tensor, Tensor]], forward: Callable[[Tensor], Tensor],
                 device: torch.device, comm: Any, beat: Callable[..., None]) -> dict[str, float]:
        """Loss and accuracy over the whole evaluation set (each rank's disjoint shard, allreduced). ``beat``: the
        stall watchdog's, called after each batch and, with phase="collective", before the sums are reduced."""
        sums = DeviceSums(device)
        for inputs, targets in batches:
            outputs = forward(inputs).float()
            sums.add(F.cross_entropy(outputs, targets, reduction="sum"), self.correct(outputs, targets), len(targets))
            beat()
        beat(phase="collective")
        totals = sums.reduced(comm)
        count = max(totals["count"], 1.0)
        return {"test_loss": totals["loss"] / count, "test_accuracy": totals["correct"] / count}

    def improved(self, value: float, best: float | None) -> bool:
        return best is None or (value > best if self.goal == "max" else value < best)

    def line(self, train_loss: float, train_accuracy: float, test: dict[str, float]) -> str:
        """The epoch line's metrics."""
        return (f"train loss {train_loss:.4f} acc {train_accuracy:.4f} | test loss {test['test_loss']:.4f} "
                f"acc {test['test_accuracy']:.4f}")


class TaskScoring(Scoring):
    """A task's loss and metrics; "best" is ``Task.best`` in ``Task.goal``'s direction."""

    def __init__(self, task: Task) -> None:
        self.loss, self.metrics = task.loss, dict(task.metrics)
        self.best_key, self.goal = f"test_{task.best}", task.goal or "min"  # a checked task has its goal
        self.train_accuracy = "accuracy" in self.metrics

    def line(self, train_loss: float, train_accuracy: float, test: dict[str, float]) -> str:
        accuracy = f" acc {train_accuracy:.4f}" if self.train_accuracy else ""
        return f"train loss {train_loss:.4f}{accuracy} | test " + " ".join(
            f"{name.removeprefix('test_')} {value:.4g}" for name, value in test.items())

    def correct(self, outputs: Tensor, targets: Tensor) -> Tensor:
        if not self.train_accuracy:
            return torch.zeros((), device=outputs.device)
        return number_tensor(self.metrics["accuracy"](outputs, targets), outputs.device) * len(targets)

    def evaluate(self, batches: Iterable[tuple[Tensor, Tensor]], forward: Callable[[Tensor], Tensor],
                 device: torch.device, comm: Any, beat: Callable[..., None]) -> dict[str, float]:
        names = ["loss", *self.metrics]
        totals = torch.zeros(len(names) + 1, dtype=torch.float64, device=device)  # each mean x examples, examples
        for inputs, targets in batches:
            outputs = forward(inputs).float()
            values = [self.loss(outputs, targets), *(metric(outputs, targets) for metric in self.metrics.values())]
            n = len(targets)
            totals += torch.stack([number_tensor(v, device).double() * n for v in values]
                                  + [torch.tensor(float(n), dtype=torch.float64, device=device)])
            beat()
        beat(phase="collective")
        reduced = allreduce_sums({str(i): v for i, v in enumerate(totals.tolist())}, comm)
        count = max(reduced[str(len(names))], 1.0)
        return {f"test_{name}": reduced[str(i)] / count for i, name in enumerate(names)}


def number_tensor(value: Any, device: torch.device) -> Tensor:
    """A metric's value (a scalar tensor or a number) as a 0-d float tensor on the device, without a host read."""
    if isinstance(value, Tensor):
        return value.detach().reshape(()).float()
    number = as_number(value)
    return torch.tensor(float("nan") if number is None else number, device=device)


def scoring_of(task: Task | None) -> Scoring:
    return Scoring() if task is None else TaskScoring(task)
