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


# ---- what users bring that the first-batch check must see (issue 46)

class DictItems(Dataset):
    """Items as dicts, the Hugging Face way."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"x": torch.full((4,), float(index)), "y": torch.tensor([float(index)])}


def dict_items() -> Task:
    task = tiny_regression()
    task.train_data = task.eval_data = DictItems()
    return task


def dict_items_collated() -> Task:
    task = dict_items()
    task.collate = lambda items: (torch.stack([i["x"] for i in items]), torch.stack([i["y"] for i in items]))
    return task


class Ragged(Dataset):
    """Sequences of lengths 1-4 and their sums: batched only by padding."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(index)
        x = torch.randn(1 + index % 4, generator=g)
        return x, x.sum().reshape(1)


def pad(items: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    inputs = torch.zeros(len(items), 4)
    for row, (x, _) in enumerate(items):
        inputs[row, : len(x)] = x
    return inputs, torch.stack([y for _, y in items])


def padded_sequences() -> Task:
    data = Ragged()
    return Task(model=nn.Linear(4, 1), train_data=data, eval_data=data, loss=F.mse_loss, collate=pad)


def lazy_model() -> Task:
    """nn.LazyLinear: parameters exist only after a first forward."""
    task = tiny_regression()
    task.model = nn.Sequential(nn.LazyLinear(8), nn.Tanh(), nn.Linear(8, 1))
    return task


class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 1)
        self.unused = nn.Linear(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.used(x)


def unused_parameter() -> Task:
    task = tiny_regression()
    task.model = WithUnused()
    return task


def unused_parameter_frozen() -> Task:
    task = unused_parameter()
    task.model.unused.requires_grad_(False)  # type: ignore[union-attr]
    return task


def eval_data_mismatch() -> Task:
    """Training data the model takes; evaluation data of another width."""
    task = tiny_regression()
    task.eval_data = TensorDataset(torch.zeros(8, 3), torch.zeros(8, 1))
    return task


def metric_named_loss() -> Task:
    task = tiny_regression()
    task.metrics = {"loss": lambda outputs, targets: (outputs - targets).abs().mean()}
    return task


def best_metric_without_goal() -> Task:
    task = tiny_regression()
    task.metrics = {"accuracy": lambda outputs, targets: ((outputs - targets).abs() < 0.5).float().mean()}
    task.best = "accuracy"
    return task


def numpy_metric() -> Task:
    import numpy

    task = tiny_regression()
    task.metrics = {"error": lambda outputs, targets: numpy.float32((outputs - targets).abs().mean().item())}
    return task
