"""TrainState through the checkpointer, in one process: the file keeps its documented layout, and a file in
that layout written without the checkpointer (as hpcdl.train's checkpoints before it) restores."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch
from torch import nn

from hpcdl.persistence import checkpoint_files
from hpcdl.persistence.checkpointer import Checkpointer
from hpcdl.training import runstate
from hpcdl.training.config import TrainConfig
from hpcdl.training.runstate import FORMAT, FORMAT_VERSION, Progress, TrainState
from tests.support.comm import OneRank

# The keys of the table in hpcdl/training/runstate.py's docstring (checkpoint format 2).
DOCUMENTED = {"format", "format_version", "run_id", "global_step", "world_size", "config", "progress", "model",
              "optimizer", "scaler", "kfac", "rng"}




@pytest.fixture(autouse=True)
def one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runstate, "agree", lambda check: check())  # no MPI in the fast tier


def train_state(seed: int, weight_decay: float = 1e-4) -> TrainState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=weight_decay)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return TrainState(model, optimizer, scaler=None, preconditioner=None)


def test_a_saved_checkpoint_has_the_documented_layout(tmp_path: Path) -> None:
    state = train_state(0)
    state.progress.global_step, state.progress.epoch = 12, 1
    runstate.save(state, Checkpointer(tmp_path, "run-a", OneRank(), keep=1), TrainConfig())
    saved = torch.load(checkpoint_files.list_checkpoints(tmp_path / "checkpoints")[0], weights_only=True)
    assert set(saved) == DOCUMENTED
    assert (saved["format"], saved["format_version"], saved["global_step"]) == (FORMAT, FORMAT_VERSION, 12)
    assert saved["progress"] == dataclasses.asdict(state.progress)
    assert saved["config"] == dataclasses.asdict(TrainConfig())


def test_a_file_in_the_documented_layout_restores_with_the_changes_applied(tmp_path: Path) -> None:
    source = train_state(0)
    progress = Progress(epoch=2, step_in_epoch=3, global_step=25, best_accuracy=0.5, stop_reason="epochs")
    rng = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    old = {  # written by hand, key by key, as the format's table says
        "format": FORMAT, "format_version": FORMAT_VERSION, "run_id": "old-run", "global_step": 25, "world_size": 1,
        "config": dataclasses.asdict(TrainConfig()), "progress": dataclasses.asdict(progress),
        "model": source.model.state_dict(), "optimizer": source.optimizer.state_dict(), "scaler": None, "kfac": None,
        "rng": [rng],
    }
    checkpoint_files.save(tmp_path / "checkpoints", old, keep=1)
    expected_next = torch.rand(2)  # what the restored RNG state gives

    config = dataclasses.replace(TrainConfig(), weight_decay=5e-4, epochs=30)
    target = train_state(1, weight_decay=config.weight_decay)
    found = runstate.read_latest(Checkpointer(tmp_path, "new-run", OneRank(), keep=1))
    assert found is not None
    runstate.restore(target, found, config, rank=0, world_size=1, where=tmp_path)

    for a, b in zip(target.model.state_dict().values(), source.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    momentum = [target.optimizer.state[p]["momentum_buffer"] for p in target.model.parameters()]
    expected = [source.optimizer.state[p]["momentum_buffer"] for p in source.model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(momentum, expected, strict=True))
    assert target.optimizer.param_groups[0]["weight_decay"] == 5e-4  # the new flag acts on the restored state
    assert (target.progress.epoch, target.progress.step_in_epoch, target.progress.global_step) == (2, 3, 25)
    assert sorted(target.progress.resumed_with_changes) == ["--epochs 15 -> 30", "--weight-decay 0.0001 -> 0.0005"]
    assert torch.equal(torch.rand(2), expected_next)  # same ranks and batch: the exact RNG stream goes on


def test_a_checkpoint_of_another_model_is_one_line(tmp_path: Path) -> None:
    source = train_state(0)
    runstate.save(source, Checkpointer(tmp_path, "run-a", OneRank(), keep=1), TrainConfig())
    found = runstate.read_latest(Checkpointer(tmp_path, "run-b", OneRank(), keep=1))
    assert found is not None
    model = nn.Linear(4, 2)
    other = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), None, None)
    with pytest.raises(runstate.UsageError, match=f"the checkpoint in {tmp_path} does not fit this model") as raised:
        runstate.restore(other, found, TrainConfig(), rank=0, world_size=1, where=tmp_path)
    # torch's header line ends in a colon; the detail after it is kept (it used to be cut off there)
    assert "Error(s) in loading state_dict for Linear: " in str(raised.value) and "Missing key" in str(raised.value)
    assert "\n" not in str(raised.value)


def test_a_changed_weight_decay_leaves_a_task_groups_own_value(tmp_path: Path) -> None:
    """A task's group without weight decay (norms, biases) keeps 0 when --weight-decay changes on a resume (it used
    to be set to the flag in every group, so a resume with unchanged flags was exact only by luck)."""
    def grouped(weight_decay: float) -> TrainState:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
        groups = [{"params": [model[0].weight]}, {"params": [model[0].bias, *model[1].parameters()],
                                                  "weight_decay": 0.0}]
        return TrainState(model, torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=weight_decay), None,
                          None)

    runstate.save(grouped(1e-4), Checkpointer(tmp_path, "run-a", OneRank(), keep=1), TrainConfig())
    for weight_decay in (1e-4, 5e-4):
        target = grouped(weight_decay)
        found = runstate.read_latest(Checkpointer(tmp_path, "run-b", OneRank(), keep=1))
        assert found is not None
        config = dataclasses.replace(TrainConfig(), weight_decay=weight_decay)
        runstate.restore(target, found, config, rank=0, world_size=1, where=tmp_path)
        assert [g["weight_decay"] for g in target.optimizer.param_groups] == [weight_decay, 0.0]
