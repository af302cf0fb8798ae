"""--compile: the warm-up that compiles the graphs before training leaves no trace, and compiled training trains.

Compiled (inductor) kernels do not reproduce eager float32 results bit for bit: on resnet20 a single step's
gradient differed by about 0.3 % (relative, max) between eager and any torch.compile of the same model and
batch, hpcdl's or a fresh one alike. So the training test checks closeness, not equality.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpcdl.data import DataSpec, build_pipeline
from hpcdl.training.config import parse_config
from hpcdl.training.job import compile_and_warm_up
from hpcdl.training.models import build_model
from hpcdl.training.train import train

pytestmark = pytest.mark.processes  # inductor compiles in worker processes: not in the fast tier

# mnist_resnet: convolutions, BatchNorm and residual adds like resnet20 at a third of its layers (compiling is
# most of these tests' time), and no dropout, whose RNG differs between eager and compiled runs.
COMMON = ["--dataset", "synthetic", "--model", "mnist_resnet", "--synthetic-shape", "3", "16", "16",
          "--synthetic-size", "96", "--batch-size", "16", "--no-progress", "--seed", "4"]


@pytest.mark.slow
def test_the_warm_up_changes_no_state_and_leaves_no_gradient() -> None:
    torch.manual_seed(0)
    model = build_model("mnist_resnet", 10, 3)  # BatchNorm: the dummy step would move its statistics
    before = {k: v.clone() for k, v in model.state_dict().items()}
    spec = DataSpec(dataset="synthetic", data_dir=None, batch_size=8, test_batch_size=8, workers=0, seed=0,
                    synthetic_shape=(3, 16, 16), synthetic_size=32)
    data = build_pipeline(spec, 0, 1, torch.device("cpu"))
    compiled = compile_and_warm_up(model, data, spec, torch.device("cpu"), None)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # BatchNorm statistics too
    assert all(p.grad is None for p in model.parameters())
    assert compiled is not model


@pytest.mark.slow
def test_compiled_training_runs_and_learns_the_same_batches(tmp_path: Path) -> None:
    """Two compiled steps move the weights as the eager steps do, up to inductor's own rounding (see above)."""
    start = train(parse_config([*COMMON, "--max-steps", "1", "--base-lr", "1e-9", "--output-dir", str(tmp_path / "0")]))
    eager = train(parse_config([*COMMON, "--max-steps", "2", "--output-dir", str(tmp_path / "eager")]))
    compiled = train(parse_config([*COMMON, "--max-steps", "2", "--compile", "--output-dir", str(tmp_path / "c")]))
    assert compiled.summary["stop_reason"] == "max_steps" and compiled.summary["config"]["compile"] is True
    initial, reference = start.model.state_dict(), eager.model.state_dict()
    for name, value in compiled.model.state_dict().items():
        if not value.is_floating_point() or "running" in name:
            continue
        eager_step, compiled_step = reference[name] - initial[name], value - initial[name]
        cosine = torch.nn.functional.cosine_similarity(eager_step.flatten(), compiled_step.flatten(), dim=0)
        assert cosine > 0.95, f"{name}: the compiled update points elsewhere (cosine {cosine:.3f})"
