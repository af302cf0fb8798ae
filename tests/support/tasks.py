"""Tasks for the tests of ``--task`` (tests/training/test_task*.py): a built-in model as a task, and bad ones."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from hpcdl.data import read_dataset
from hpcdl.data.augment import Normalizer
from hpcdl.data.registry import entry
from hpcdl.training.models import build_model
from hpcdl.training.task import Task, accuracy


def digits_task() -> Task:
    """hpcdl's own digits_cnn on its own digits, brought as a task: the same model, data, loss and order."""
    splits = read_dataset("digits", None)
    normalize = Normalizer(entry("digits").norm, torch.device("cpu"), channels_last=False)
    train = TensorDataset(normalize(splits.train.images), splits.train.labels)
    test = TensorDataset(normalize(splits.test.images), splits.test.labels)
    return Task(model=build_model("digits_cnn", 10, 1), train_data=train, eval_data=test, loss=F.cross_entropy,
                metrics={"accuracy": accuracy}, best="accuracy", goal="max")


def digits_model(num_classes: int, in_channels: int) -> nn.Module:
    """``--model tests.support.tasks:digits_model``: the built-in digits_cnn, as a user's model."""
    return build_model("digits_cnn", num_classes, in_channels)


def tiny_regression(features: int = 4, count: int = 64) -> Task:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(count, features, generator=generator)
    y = x.sum(1, keepdim=True)
    data = TensorDataset(x, y)
    return Task(model=nn.Linear(features, 1), train_data=data, eval_data=data, loss=F.mse_loss)


# ---- bad tasks: each one a row of docs/training.md's "Your own model" refusals

NOT_A_FUNCTION = 42


def returns_a_model() -> nn.Module:
    return nn.Linear(4, 1)


def raises() -> Task:
    raise ValueError("no data here\nsecond line of the message")


def wrong_shapes() -> Task:
    """The model takes 4 features; the data have 3."""
    task = tiny_regression()
    data = TensorDataset(torch.zeros(64, 3), torch.zeros(64, 1))
    return Task(model=task.model, train_data=data, eval_data=data, loss=task.loss)


def loss_not_scalar() -> Task:
    task = tiny_regression()
    task.loss = lambda outputs, targets: (outputs - targets) ** 2
    return task


def metric_not_a_number() -> Task:
    task = tiny_regression()
    task.metrics = {"errors": lambda outputs, targets: outputs - targets}
    return task


class Stream(IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        yield torch.zeros(4), torch.zeros(1)


def iterable_data() -> Task:
    task = tiny_regression()
    task.train_data = Stream()
    return task


class Unbatchable(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return torch.zeros(index + 1), torch.zeros(1)  # ragged: cannot be stacked


def ragged_data() -> Task:
    task = tiny_regression()
    task.train_data = Unbatchable()
    return task
