"""Settings a GPU run depends on, checked in a real (CPU) run: --compile warms up on the shape the loop
trains on, and TF32 is set through one API (the fp32_precision flags K-FAC switches per stage)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from hpcdl.training.config import parse_config
from hpcdl.training.train import train

pytestmark = pytest.mark.processes  # two in-process training runs of ~25 s: kept out of the fast tier

COMMON = ["--dataset", "synthetic", "--model", "resnet20", "--synthetic-shape", "3", "16", "16", "--synthetic-size",
          "128", "--batch-size", "16", "--no-progress", "--max-steps", "2", "--warmup-epochs", "0"]


class ShapeRecorder(nn.Module):
    """Stands in for torch.compile: records the input shape of every call (a compiled model with
    static shapes recompiles at the first shape it was not warmed up on)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.inner = model
        self.shapes: list[tuple[int, ...]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.shapes.append(tuple(x.shape))
        return self.inner(x)


def test_compile_warms_up_on_the_micro_batch_the_loop_trains_on(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[ShapeRecorder] = []

    def fake_compile(model: nn.Module, **_: object) -> nn.Module:
        made.append(ShapeRecorder(model))
        return made[-1]

    monkeypatch.setattr(torch, "compile", fake_compile)
    train(parse_config([*COMMON, "--compile", "--batches-per-allreduce", "2", "--output-dir", str(tmp_path)]))
    (recorder,) = made
    warm_up, trained = recorder.shapes[0], set(recorder.shapes[1:])
    assert len(recorder.shapes) == 1 + 2 * 2  # the warm-up, then 2 steps of 2 micro-batches
    assert trained == {warm_up} == {(16, 3, 16, 16)}


def test_a_run_sets_tf32_only_through_the_fp32_precision_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def legacy_write(value: bool) -> None:
        raise AssertionError("the legacy allow_tf32 switch was written: torch 2.13 then raises on reading it")

    monkeypatch.setattr(torch._C, "_set_cublas_allow_tf32", legacy_write)
    monkeypatch.setattr(torch._C, "_set_cudnn_allow_tf32", legacy_write)
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv  # type: ignore[attr-defined]
    saved = (matmul.fp32_precision, conv.fp32_precision)
    matmul.fp32_precision, conv.fp32_precision = "none", "none"  # torch's defaults differ; start from neither
    seen: set[str] = set()

    def record(module: nn.Module, args: object) -> None:
        seen.add(f"{matmul.fp32_precision}/{conv.fp32_precision}")

    hook = nn.modules.module.register_module_forward_pre_hook(record)
    try:
        train(parse_config([*COMMON, "--kfac", "--kfac-inv-update-freq", "1", "--output-dir", str(tmp_path)]))
        after = (matmul.fp32_precision, conv.fp32_precision)
    finally:
        hook.remove()
        matmul.fp32_precision, conv.fp32_precision = saved
    assert seen == {"tf32/tf32"}  # every forward of the run, K-FAC's own stages (ieee, restored) aside
    assert after == ("tf32", "tf32")
