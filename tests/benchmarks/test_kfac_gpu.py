"""benchmarks/kfac_gpu.sh (the no-setup GPU benchmark): its plan fits its budget, its steps' command lines are
kfac_overhead.py's, and its kfac-pytorch adapter loads a local copy beside our kfac."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hpcdl.runtime.errors import UsageError
from tests.support.scripts import load_benchmark

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu() -> Any:
    return load_benchmark("kfac_gpu")


@pytest.mark.processes
def test_the_suite_s_command_line_dry_runs_without_a_gpu_and_writes_nothing(tmp_path: Path) -> None:
    """The exact command benchmarks/gpu_suite.sh runs, with --dry-run: the plan, within the budget, exit 0."""
    out = tmp_path / "out"
    run = subprocess.run(["bash", "benchmarks/kfac_gpu.sh", "--out", str(out), "--budget", "275", "--dry-run",
                          "--kfac-pytorch", "none"], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHON=sys.executable))
    assert run.returncode == 0, run.stderr
    assert "[kfac_gpu] fp32:" in run.stdout and "[kfac_gpu] amp:" in run.stdout and "of 275 s" in run.stdout
    assert not out.exists()


def test_a_budget_the_plan_does_not_fit_is_refused_in_one_line(gpu: Any, tmp_path: Path, capsys) -> None:
    assert gpu.main(["--out", str(tmp_path), "--budget", "60", "--dry-run", "--kfac-pytorch", "none"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "more than --budget 60" in err[0]


def test_every_step_limit_is_a_share_of_the_budget_at_least_its_estimate(gpu: Any) -> None:
    steps = gpu.plan(None)
    budget = sum(s.estimate_s for s in steps) * 1.1
    shares = gpu.limits(steps, budget)
    assert sum(shares) == pytest.approx(budget)
    assert all(limit >= step.estimate_s for step, limit in zip(steps, shares, strict=True))


def test_time_a_step_did_not_need_goes_to_the_next(gpu: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step ends early: each next one's limit is its share of the budget that is left, larger than its planned
    share, and the last one's is all that is left."""
    steps = gpu.plan(None)
    budget = sum(s.estimate_s for s in steps) * 1.1
    planned = gpu.limits(steps, budget)
    clock = [1000.0]
    given = []

    def call(command: list[str], env: dict, timeout: float) -> int:
        given.append(timeout)
        clock[0] += 30.0  # every step takes 30 s
        return 0

    monkeypatch.setattr(gpu.subprocess, "call", call)
    monkeypatch.setattr(gpu.time, "monotonic", lambda: clock[0])
    assert gpu.main(["--out", str(tmp_path / "out"), "--budget", str(budget), "--kfac-pytorch", "none"]) == 0
    assert len(given) == len(steps) > 1 and given[0] == pytest.approx(planned[0])
    for index in range(1, len(steps)):
        left = budget - 30.0 * index
        assert given[index] == pytest.approx(gpu.limits(steps[index:], left)[0]) and given[index] > planned[index]
    assert given[-1] == pytest.approx(budget - 30.0 * (len(steps) - 1))


def test_each_step_s_arguments_parse_in_kfac_overhead(gpu: Any, tmp_path: Path) -> None:
    """kfac_overhead.py accepts every argument of the plan: without a GPU it stops at the CUDA check, after parsing."""
    overhead = load_benchmark("kfac_overhead")
    if overhead.torch.cuda.is_available():
        pytest.skip("a GPU would run the benchmark")
    for step in gpu.plan(_fake_kfac_pytorch(tmp_path)):
        with pytest.raises(UsageError, match="no CUDA GPU is visible"):
            overhead.main(gpu.command(step, tmp_path)[2:])


def _fake_kfac_pytorch(root: Path) -> Path:
    """A package laid out like kfac-pytorch's (``import kfac.x as x``, its version from importlib.metadata)."""
    package = root / "checkout" / "kfac"
    (package / "layers").mkdir(parents=True)
    (package / "__init__.py").write_text(
        "import importlib.metadata as importlib_metadata\nimport kfac.preconditioner as preconditioner\n"
        "from kfac.layers import eigen\n__version__ = importlib_metadata.version('kfac-pytorch')\n")
    (package / "base_preconditioner.py").write_text("")
    (package / "preconditioner.py").write_text("from kfac.layers.eigen import NAME\n")
    (package / "layers" / "__init__.py").write_text("")
    (package / "layers" / "eigen.py").write_text("NAME = __name__\n")
    (root / "checkout" / "pyproject.toml").write_text('[project]\nname = "kfac_pytorch"\nversion = "9.8.7"\n')
    return root / "checkout"


def test_a_local_copy_of_kfac_pytorch_loads_beside_our_kfac_without_installing(tmp_path: Path) -> None:
    adapter = load_benchmark("kfac_pytorch_adapter")
    copy = adapter.load_beside(_fake_kfac_pytorch(tmp_path), tmp_path / "scratch")
    try:
        assert copy.__name__ == adapter.RENAMED and copy.__version__ == "9.8.7"
        renamed = f"{adapter.RENAMED}.layers.eigen"
        assert renamed == copy.preconditioner.NAME  # its own imports renamed
        assert importlib.metadata.version("kfac-pytorch") == "9.8.7"
        import kfac

        assert Path(kfac.__file__).resolve().parent == REPO / "kfac"  # ours is still ``kfac``
    finally:
        sys.path.remove(str(tmp_path / "scratch"))
        for name in [m for m in sys.modules if m.startswith(adapter.RENAMED)]:
            del sys.modules[name]


def test_a_folder_without_kfac_pytorch_is_named_in_one_line(tmp_path: Path) -> None:
    adapter = load_benchmark("kfac_pytorch_adapter")
    with pytest.raises(ValueError, match="no kfac-pytorch under"):
        adapter.package_dir(tmp_path)


def test_kfac_pytorch_gets_the_loss_scale_in_the_form_it_understands() -> None:
    """kfac-pytorch recognises only the deprecated torch.cuda.amp.GradScaler and calls anything else for the scale;
    the adapter hands it the scaler's get_scale (its AMP run failed with "'GradScaler' object is not callable")."""
    adapter = load_benchmark("kfac_pytorch_adapter")
    received: dict[str, Any] = {}

    class Preconditioner:
        def __init__(self, model: Any, **options: Any) -> None:
            received.update(options)

        def step(self) -> None:
            pass

    package = SimpleNamespace(preconditioner=SimpleNamespace(KFACPreconditioner=Preconditioner))
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
    adapter.build(package, torch.nn.Linear(2, 2), factor_update_steps=1, inv_update_steps=10, damping=0.1,
                  factor_decay=0.95, kl_clip=0.01, lr=0.1, grad_scaler=scaler)
    assert received["grad_scaler"]() == 512.0
    adapter.build(package, torch.nn.Linear(2, 2), factor_update_steps=1, inv_update_steps=10, damping=0.1,
                  factor_decay=0.95, kl_clip=0.01, lr=0.1)
    assert received["grad_scaler"] is None
