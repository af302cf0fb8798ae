"""The checkpointer over Stateful parts, in one process (a one-rank communicator stands in for MPI's)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hpcdl.persistence import checkpoint_files
from hpcdl.persistence.checkpointer import Checkpointer, load_parts, rng_state, set_rng_state
from hpcdl.runtime.errors import StorageError, UsageError
from tests.support.comm import OneRank


def parts(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()  # momentum buffers exist
    return {"model": model, "optimizer": optimizer, "absent": None}


def test_what_is_saved_is_what_each_part_says_and_loads_back(tmp_path: Path) -> None:
    saver = Checkpointer(tmp_path, "run-1", OneRank(), keep=2)
    original = parts(0)
    saver.save(original, {"format": "test", "config": {"a": 1}}, global_step=5)
    state = saver.read_latest(lambda state, path: None)
    assert state is not None
    assert set(state) == {"format", "config", "run_id", "global_step", "world_size", "model", "optimizer", "absent",
                          "rng"}
    assert (state["run_id"], state["global_step"], state["world_size"], state["absent"]) == ("run-1", 5, 1, None)
    restored = parts(1)
    assert not torch.equal(restored["model"].weight, original["model"].weight)
    load_parts(restored, state)
    assert torch.equal(restored["model"].weight, original["model"].weight)
    buffers = [restored["optimizer"].state[p]["momentum_buffer"] for p in restored["model"].parameters()]
    expected = [original["optimizer"].state[p]["momentum_buffer"] for p in original["model"].parameters()]
    assert all(torch.equal(a, b) for a, b in zip(buffers, expected, strict=True))


def test_only_the_newest_are_kept_and_the_check_sees_the_newest(tmp_path: Path) -> None:
    saver = Checkpointer(tmp_path, "run-1", OneRank(), keep=2)
    for step in (1, 2, 3):
        saver.save(parts(step), {}, global_step=step)
    assert [checkpoint_files.step_of(p) for p in checkpoint_files.list_checkpoints(saver.directory)] == [3, 2]
    seen = []
    saver.read_latest(lambda state, path: seen.append((state["global_step"], path.name)))
    assert seen == [(3, "ckpt-000000003.pt")]


def test_a_failed_write_is_a_storage_error_and_leaves_the_earlier_checkpoint(tmp_path: Path, monkeypatch) -> None:
    saver = Checkpointer(tmp_path, "run-1", OneRank(), keep=3)
    saver.save(parts(0), {}, global_step=1)

    def full(*_: Any, **__: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(StorageError, match=r"could not write the checkpoint of step 2 to .*checkpoints \(.*No space"):
        saver.save(parts(0), {}, global_step=2)
    assert [p.name for p in checkpoint_files.list_checkpoints(saver.directory)] == ["ckpt-000000001.pt"]


def test_none_readable_is_one_line_and_no_checkpoint_is_none(tmp_path: Path) -> None:
    saver = Checkpointer(tmp_path, "run-1", OneRank(), keep=3)
    assert saver.read_latest(lambda state, path: None) is None
    saver.directory.mkdir(parents=True)
    (saver.directory / "ckpt-000000004.pt").write_bytes(b"garbage")
    with pytest.raises(UsageError, match="none of the 1 checkpoint"):
        saver.read_latest(lambda state, path: None)


def test_rng_state_round_trip() -> None:
    state = rng_state()
    expected = (torch.rand(3), random.random())
    set_rng_state(state)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
