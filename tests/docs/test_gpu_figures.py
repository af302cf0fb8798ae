"""README's GPU rows (benchmarks/gpu_figures.py): computed from the suite's results files, a row for each file
there is, and a plain 'not measured yet' with the command where there is none. Fixture files here, written the
way the benchmarks write them; nothing committed to benchmarks/results."""

from __future__ import annotations

import importlib
import io
import json
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
DEVICE = "NVIDIA H200"
LOOP = {"device": "cuda", "device_name": DEVICE, "model": "resnet50", "batch": 128, "size": 224, "modes": {
    "fp32": {"hpcdl_step_seconds": [0.064, 0.0640], "bare_step_seconds": [0.0625, 0.0627],
             "paired_speed_ratios": [0.976, 0.980], "speed_ratio": 0.978},
    "amp": {"hpcdl_step_seconds": [0.032, 0.032], "bare_step_seconds": [0.0316, 0.0318],
            "paired_speed_ratios": [0.9875, 0.99375], "speed_ratio": 0.990625}}}
AMP = {"device": "cuda", "device_name": DEVICE, "steps": 15, "models": {"resnet50": {
    "summary": {"bf16": {"items_per_second": 4292.0, "final_loss": 2.3012, "skipped_steps": 0},
                "fp16": {"items_per_second": 4909.0, "final_loss": 2.3034, "skipped_steps": 1},
                "fp32": {"items_per_second": 2121.0, "final_loss": 2.3001, "skipped_steps": 0}},
    "fp16_over_bf16": 1.1437}}}
BACKENDS = {"device": "cuda", "device_name": DEVICE, "model": "resnet50", "modes": {}, "backends": {
    "horovod": {"images_per_second_1_rank": 2000.0}, "torch": {"images_per_second_1_rank": 2050.0}},
    "torch_over_horovod_1_ranks": 1.025}


@pytest.fixture()
def gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """benchmarks/gpu_figures.py reading its results files from ``tmp_path``."""
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.append(str(REPO / "benchmarks"))
    figures = importlib.import_module("figures")
    monkeypatch.setattr(figures, "RESULTS", tmp_path)
    figures.results.cache_clear()
    yield importlib.import_module("gpu_figures")
    figures.results.cache_clear()


def write(folder: Path, name: str, content: dict[str, Any]) -> None:
    (folder / f"{name}.json").write_text(json.dumps(content))


def test_without_results_files_it_says_so_and_gives_the_command(gpu: Any, tmp_path: Path) -> None:
    text = gpu.FIGURES["gpu.table"]()
    assert text.strip().startswith("No GPU figures are measured yet")
    assert "`bash benchmarks/gpu_suite.sh --run A`" in text and "|" not in text


def test_rows_are_computed_from_the_files_there_are(gpu: Any, tmp_path: Path) -> None:
    write(tmp_path, "train_throughput_cuda", LOOP)
    write(tmp_path, "amp_dtype_cuda", AMP)
    write(tmp_path, "train_throughput_cuda_backends", BACKENDS)
    text = gpu.FIGURES["gpu.table"]()
    rows = [line for line in text.splitlines() if line.startswith(f"| {DEVICE} |")]
    assert len(rows) == 4  # fp32, amp (amp+cl was cut short: no row), ResNet-50's dtypes, the backends
    # 128 images / 0.064 s = 2,000 img/s; the bare loop's median 0.0626 s: 2,045 img/s
    assert "hpcdl.train fp32 (TF32), resnet50, batch 128 | 2,000 img/s, 0.978× the bare loop's 2,045 |" in rows[0]
    assert "4,000 img/s, 0.991× the bare loop's" in rows[1]
    assert ("bf16 4,292 img/s, fp16 + GradScaler 4,909 (1.14×); last-quarter loss bf16 2.301, fp16 2.303, "
            "fp32 2.300; fp16 steps skipped 1") in rows[2]
    assert "DDP 2,050 img/s, Horovod 2,000: 1.025× | within 3 % |" in rows[3]
    assert "Not measured yet: run A, C of `bash benchmarks/gpu_suite.sh`" in text  # the loader (A), --compile (C)


def test_collect_takes_the_suites_files_from_its_archive(gpu: Any, tmp_path: Path, capsys) -> None:
    files_at, folder = tmp_path / "files", tmp_path / "out"
    files_at.mkdir()
    with tarfile.open(files_at / "results.tar.gz", "w:gz") as tar:
        for name, content in (("results/train_throughput_cuda.json", json.dumps(LOOP)),
                              ("results/train_summary.json", "{}"), ("logs/loop.log", "fp32 ...")):
            data = content.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert gpu.main(["--collect", str(files_at), "--output-dir", str(folder)]) == 0
    assert sorted(p.name for p in folder.iterdir()) == ["train_throughput_cuda.json"]  # only what a row reads
    assert json.loads((folder / "train_throughput_cuda.json").read_text()) == LOOP
    with pytest.raises(SystemExit, match="neither results.tar.gz nor kfac_gpu/kfac_gpu.json"):
        gpu.main(["--collect", str(tmp_path / "nothing"), "--output-dir", str(folder)])


def test_collect_takes_k_fac_s_gathered_results(gpu: Any, tmp_path: Path) -> None:
    """kfac_gpu.sh --out $OUT/kfac_gpu: its gathered JSON (and plot) come back beside no suite archive."""
    files_at, folder = tmp_path / "files", tmp_path / "out"
    (files_at / "kfac_gpu").mkdir(parents=True)
    folder.mkdir()
    report = {"kind": "kfac_gpu", "steps": []}
    (files_at / "kfac_gpu" / "kfac_gpu.json").write_text(json.dumps(report))
    (files_at / "kfac_gpu" / "kfac_gpu_amp.json").write_text("{}")
    assert gpu.main(["--collect", str(files_at), "--output-dir", str(folder)]) == 0
    assert sorted(p.name for p in folder.iterdir()) == ["kfac_gpu.json"]
    assert json.loads((folder / "kfac_gpu.json").read_text()) == report
    (files_at / "kfac_gpu" / "kfac_gpu.json").write_text('{"cut off')
    with pytest.raises(json.JSONDecodeError):
        gpu.main(["--collect", str(files_at), "--output-dir", str(folder)])
