"""benchmarks/amp_dtype.py (--amp auto's evidence): on the CPU with tiny models, each dtype starts from the same
weights on the same batches, so the first step's loss of bf16 and fp16 is fp32's to half precision; the results
file holds what README's GPU rows read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes  # a child interpreter runs the benchmark

REPO = Path(__file__).resolve().parents[2]


def test_each_dtype_trains_the_same_start_and_the_file_has_the_summary(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "amp_dtype.py"), "--models", "transformer",
                           "--steps", "4", "--warmup", "1", "--rounds", "2", "--out", str(tmp_path / "amp")],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "amp.json").read_text())
    model = report["models"]["transformer"]
    runs = model["runs"]
    assert {dtype: len(r) for dtype, r in runs.items()} == {"bf16": 2, "fp16": 2, "fp32": 2}
    first = {dtype: r[0]["losses"][0] for dtype, r in runs.items()}
    assert first["bf16"] == pytest.approx(first["fp32"], rel=2e-2)  # bf16: 8 bits of mantissa
    assert first["fp16"] == pytest.approx(first["fp32"], rel=2e-3)  # fp16: 11
    assert runs["fp32"][0]["losses"] == runs["fp32"][1]["losses"]  # the same start, every round
    summary = model["summary"]
    assert set(summary) == {"bf16", "fp16", "fp32"} and model["fp16_over_bf16"] > 0
    assert all(set(s) == {"items_per_second", "final_loss", "skipped_steps"} for s in summary.values())


def test_cuda_without_a_gpu_is_one_line(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "amp_dtype.py"), "--device", "cuda",
                           "--out", str(tmp_path / "amp")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and done.stderr.strip().count("\n") == 0 and "no GPU" in done.stderr
