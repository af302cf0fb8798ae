"""Same seed, world size and flags: bit-identical weights on CPU, at every world size (docs/training.md's promise).

Two ranks cannot show a wrong reduction order (a + b == b + a exactly); three and four ranks can, since
floating-point addition is not associative. Each world size runs twice and the final weights (and
momentum) are compared bit for bit. ``--deterministic off`` (Horovod's timing-dependent tensor fusion)
is the control: it shows the comparison can fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.backends import backend_param
from tests.support.data_files import write_cifar10
from tests.support.mpi_harness import run_train

pytestmark = pytest.mark.processes

FLAGS = ("--dataset", "cifar10", "--model", "resnet20", "--epochs", "1", "--max-steps", "4", "--batch-size", "4",
         "--workers", "0", "--seed", "7", "--warmup-epochs", "0", "--stall-timeout", "0")


@pytest.fixture(scope="module")
def cifar(tmp_path_factory) -> Path:
    return write_cifar10(tmp_path_factory.mktemp("cifar"), per_batch=8)


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    newest = sorted((run_dir / "checkpoints").glob("ckpt-*.pt"))[-1]
    saved = torch.load(newest, map_location="cpu", weights_only=False)
    state = {f"model.{k}": v for k, v in saved["model"].items()}
    for index, slot in saved["optimizer"]["state"].items():
        state |= {f"optimizer.{index}.{k}": v for k, v in slot.items() if isinstance(v, torch.Tensor)}
    return state


def train_twice(nprocs: int, data: Path, out: Path, *extra: str) -> list[str]:
    """Two identical runs; the names of the tensors that differ between their final states."""
    states = []
    for attempt in ("a", "b"):
        job = run_train(nprocs, out / f"np{nprocs}-{attempt}", "--data-dir", str(data), *FLAGS, *extra, timeout=240)
        assert job.returncode == 0, job.stderr[-3000:]
        states.append(final_state(out / f"np{nprocs}-{attempt}"))
    first, second = states
    assert first.keys() == second.keys()
    return [name for name in first if not torch.equal(first[name], second[name])]


@pytest.mark.parametrize("nprocs, backend", [
    *(backend_param(n, "horovod", id=f"{n}-horovod") for n in (1, 2, 3, 4)),
    backend_param(3, "torch", id="3-torch"),  # three ranks: where a reduction order could differ between runs
])
def test_two_identical_runs_end_bit_identical(nprocs: int, backend: str, cifar: Path, tmp_path: Path) -> None:
    differ = train_twice(nprocs, cifar, tmp_path, "--backend", backend)
    assert not differ, f"{len(differ)} tensors differ on {nprocs} ranks under {backend}, e.g. {differ[:3]}"


LAYOUTS = {  # one 3-rank run's gradients reduced in one fused buffer, or one tensor at a time
    "fused": {"HOROVOD_FUSION_THRESHOLD": str(64 << 20), "HOROVOD_CYCLE_TIME": "50", "HOROVOD_AUTOTUNE": "0"},
    "alone": {"HOROVOD_FUSION_THRESHOLD": "0", "HOROVOD_AUTOTUNE": "0"},
}


def differing_tensors(data: Path, out: Path, *extra: str) -> list[str]:
    """The same 3-rank run under each buffer layout of LAYOUTS; the tensors whose final values differ."""
    states = []
    for name, env in LAYOUTS.items():
        job = run_train(3, out / name, "--data-dir", str(data), *FLAGS, *extra, timeout=240, env=env)
        assert job.returncode == 0, job.stderr[-3000:]
        states.append(final_state(out / name))
    first, second = states
    return [name for name in first if not torch.equal(first[name], second[name])]


def test_the_reduction_order_changes_the_weights_unless_deterministic(cifar: Path, tmp_path: Path) -> None:
    """The control, made certain: where a gradient sits in the buffer MPI reduces decides the order its
    three ranks' values are added in, and with it the last bits. Horovod's fusion picks that place by
    timing, which is why runs drift. Forcing two layouts shows the comparison above has teeth, and
    ``--deterministic`` (the CPU default) must give the same bits whatever the environment asks for."""
    assert differing_tensors(cifar, tmp_path / "off", "--deterministic", "off"), \
        "fused and per-tensor reduction ended bit-identical on 3 ranks: the comparison above may prove nothing"
    assert differing_tensors(cifar, tmp_path / "on", "--deterministic", "on") == []
