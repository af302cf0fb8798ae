"""What users ask for when they bring a model of their own, on the digits that ship with hpcdl:

    mpirun -np 2 .venv/bin/python -m hpcdl.train --task examples.own_model:task --optimizer adamw --base-lr 0.003 --output-dir runs/own

- a model whose forward returns ``(logits, loss)`` (nanoGPT's, Hugging Face's): :class:`LogitsOnly` hands hpcdl
  the logits, and the task's ``loss`` computes the loss as the model would;
- parameter groups: no weight decay on norms and biases (:func:`no_decay_on_norms_and_biases`);
- optimizer options beyond the flags: AdamW's betas (``optimizer_options``);
- the run's best evaluation in one's own model, outside hpcdl: :func:`load_best`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from hpcdl.data import read_dataset
from hpcdl.training.task import Task, accuracy


class Classifier(nn.Module):
    """A user's model as it is written elsewhere: ``forward(x, targets)`` returns ``(logits, loss)``."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU())
        self.head = nn.Linear(64, classes)

    def forward(self, x: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        logits = self.head(self.body(x))
        return logits, None if targets is None else F.cross_entropy(logits, targets)


class LogitsOnly(nn.Module):
    """hpcdl calls ``model(inputs)`` and wants one tensor: the logits of a model that returns ``(logits, loss)``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)[0]


def no_decay_on_norms_and_biases(model: nn.Module, weight_decay: float = 0.05) -> list[dict[str, Any]]:
    """Two groups: matrices decay, norms' weights and every bias do not (what GPT recipes do)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def digits(split: str) -> TensorDataset:
    data = getattr(read_dataset("digits", None), split)
    return TensorDataset(data.images.float() / 16.0, data.labels)


def task() -> Task:
    return Task(model=LogitsOnly(Classifier()), train_data=digits("train"), eval_data=digits("test"),
                loss=F.cross_entropy, metrics={"accuracy": accuracy}, best="accuracy", goal="max",
                param_groups=no_decay_on_norms_and_biases, optimizer_options={"betas": (0.9, 0.95)})


def load_best(run_dir: str | Path) -> Classifier:
    """The run's best evaluation (``best.pt`` in its folder) in a plain ``Classifier``: the checkpoint's ``model``
    is the state dict of what the task trained, here the wrapper, whose keys start with ``model.``."""
    saved = torch.load(Path(run_dir) / "best.pt", map_location="cpu", weights_only=True)
    model = Classifier()
    LogitsOnly(model).load_state_dict(saved["model"])
    return model.eval()
