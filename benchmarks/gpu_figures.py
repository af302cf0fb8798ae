"""README's GPU rows, computed from the results files benchmarks/gpu_suite.sh writes on the device machine.

    .venv/bin/python benchmarks/gpu_figures.py --collect FILES_AT --refresh-results   # -> benchmarks/results/
    .venv/bin/python benchmarks/figures.py                          # then README's GPU rows are written from them

A row is there only for a results file that is: where none is, README says that no GPU figure is measured yet
and which command measures them. Each row names the GPU it was measured on (each file records it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path

import figures
from figures import table

# results file -> the suite's run that writes it
FILES = {"train_throughput_cuda": "A", "amp_dtype_cuda": "A", "loader_throughput_cuda": "A",
         "train_throughput_cuda_backends": "B", "train_throughput_cuda_compile": "C"}
MODES = {"fp32": "fp32 (TF32)", "amp": "--amp bf16", "amp+cl": "--amp bf16 --channels-last on"}


def _have(name: str) -> bool:
    return (figures.RESULTS / f"{name}.json").is_file()


def _loop_rows(name: str, modes: dict[str, str]) -> list[tuple[str, ...]]:
    r = figures.results(name)
    rows = []
    for mode, label in modes.items():
        if mode not in r["modes"]:
            continue  # a run cut short: the modes it finished
        m = r["modes"][mode]
        hpcdl, bare = (r["batch"] / statistics.median(m[f"{who}_step_seconds"]) for who in ("hpcdl", "bare"))
        rows.append((r["device_name"], f"hpcdl.train {label}, {r['model']}, batch {r['batch']}",
                     f"{hpcdl:,.0f} img/s, {figures.times(m['speed_ratio'], 3)} the bare loop's {bare:,.0f}",
                     "≥ 0.97× the bare loop"))
    return rows


def _amp_rows() -> list[tuple[str, ...]]:
    r = figures.results("amp_dtype_cuda")
    rows = []
    for model, m in r["models"].items():
        if "summary" not in m:
            continue
        s = m["summary"]
        unit = "img/s" if model == "resnet50" else "tokens/s"
        rows.append((r["device_name"], f"--amp auto's choice, {model} (bare loop, {r['steps']} steps)",
                     f"bf16 {s['bf16']['items_per_second']:,.0f} {unit}, fp16 + GradScaler "
                     f"{s['fp16']['items_per_second']:,.0f} ({figures.times(m['fp16_over_bf16'])}); last-quarter loss "
                     f"bf16 {s['bf16']['final_loss']:.3f}, fp16 {s['fp16']['final_loss']:.3f}, fp32 "
                     f"{s['fp32']['final_loss']:.3f}; fp16 steps skipped {s['fp16']['skipped_steps']}",
                     "decides --amp auto"))
    return rows


def _loader_rows() -> list[tuple[str, ...]]:
    r = figures.results("loader_throughput_cuda")
    if "prefetch_factor" not in r:  # the run of 2026-11-28: too few timed batches to see past the read-ahead queue
        rates = [statistics.median(w["folder-gpu"]) for w in r["pipeline_alone"].values() if "folder-gpu" in w]
        workers = max(int(w) for w in r["pipeline_alone"])
        return [(r["device_name"], f"input pipeline alone, nvJPEG, batch {r['batch_size']}",
                 f"{max(rates):,.0f} img/s; the CPU decoders not measured: their {r['timed_batches']} timed batches "
                 f"came from the {4 * workers} batches {workers} workers read ahead", "—")]
    rows = []
    for workers, rates in r["pipeline_alone"].items():
        gpu, cpu = (statistics.median(rates[n]) for n in ("folder-gpu", "folder-cpu"))
        rows.append((r["device_name"], f"input pipeline alone, {workers} workers, batch {r['batch_size']}",
                     f"nvJPEG {gpu:,.0f} img/s, {figures.times(r['ratios'][workers]['folder-gpu/folder-cpu'])} "
                     f"libjpeg-turbo's {cpu:,.0f}", "—"))
    if "training" in r:
        t = r["training"]
        rows.append((r["device_name"], f"{t['model']} fed by nvJPEG, {t['workers']} workers",
                     f"{figures.times(t['fraction_of_synthetic']['folder-gpu'])} the speed on synthetic data",
                     "—"))
    return rows


def _backend_rows() -> list[tuple[str, ...]]:
    r = figures.results("train_throughput_cuda_backends")
    horovod, torch = (r["backends"][b]["images_per_second_1_rank"] for b in ("horovod", "torch"))
    return [(r["device_name"], f"Horovod + NCCL against NCCL DDP, {r['model']}, 1 rank",
             f"DDP {torch:,.0f} img/s, Horovod {horovod:,.0f}: {figures.times(r['torch_over_horovod_1_ranks'], 3)}",
             "within 3 %")]


def _table() -> str:
    have = [name for name in FILES if _have(name)]
    if not have:
        return ("\nNo GPU figures are measured yet: `bash benchmarks/kfac_gpu.sh` (K-FAC), then "
                "`bash benchmarks/gpu_suite.sh --run A` (then `--run B`, `--run C`) on the device machine measure "
                "them, as docs/gpu.md says.\n")
    rows: list[tuple[str, ...]] = []
    if _have("train_throughput_cuda"):
        rows += _loop_rows("train_throughput_cuda", MODES)
    if _have("train_throughput_cuda_compile"):
        rows += _loop_rows("train_throughput_cuda_compile", {"compile": "--compile (bf16, channels_last)"})
    if _have("amp_dtype_cuda"):
        rows += _amp_rows()
    if _have("loader_throughput_cuda"):
        rows += _loader_rows()
    if _have("train_throughput_cuda_backends"):
        rows += _backend_rows()
    text = table(["GPU", "what", "measured", "target"], rows)
    missing = sorted({FILES[name] for name in FILES if name not in have})
    if missing:
        text += (f"\nNot measured yet: run {', '.join(missing)} of `bash benchmarks/gpu_suite.sh` "
                 "on the device machine (docs/gpu.md).\n")
    return text


FIGURES = {"gpu.table": _table}


def collect(files_at: Path, results: Path) -> list[str]:
    """The suite's results files named in FILES, from ``files_at/results.tar.gz``, and K-FAC's (``kfac_gpu.sh --out
    $OUT/kfac_gpu``: its gathered JSON and fp32 plot) into ``results``."""
    archive = files_at / "results.tar.gz"
    kfac = [files_at / "kfac_gpu" / name for name in ("kfac_gpu.json", "kfac_gpu_fp32.png")]
    if not archive.is_file() and not kfac[0].is_file():
        raise SystemExit(f"gpu_figures.py: error: neither results.tar.gz nor kfac_gpu/kfac_gpu.json in {files_at} "
                         "(the device call's $OUT, as it came back)")
    taken = []
    if kfac[0].is_file():
        json.loads(kfac[0].read_text())  # whole, or refused here
        for path in (p for p in kfac if p.is_file()):
            (results / path.name).write_bytes(path.read_bytes())
            taken.append(path.name)
    if not archive.is_file():
        return taken
    with tarfile.open(archive) as tar:
        for name in FILES:
            try:
                member = tar.extractfile(f"results/{name}.json")
            except KeyError:
                continue
            if member is None:
                continue
            text = member.read().decode()
            json.loads(text)  # a file the suite cut off mid-write is refused here, not by figures.py later
            (results / f"{name}.json").write_text(text)
            taken.append(f"{name}.json")
    return taken


def main(argv: Sequence[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from hpcdl.persistence import outputs
    from hpcdl.runtime.errors import UsageError

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--collect", type=Path, required=True, metavar="FILES_AT",
                        help="the folder the suite's files came back in (holding results.tar.gz)")
    parser.add_argument("--output-dir", type=Path, help="where the results files go (default: a new folder under "
                        "runs/bench/; --refresh-results: benchmarks/results, where README's rows read them)")
    outputs.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        folder = outputs.results_folder(args.output_dir, "gpu_suite", refresh_results=args.refresh_results)
    except UsageError as err:
        parser.error(str(err))
    taken = collect(args.collect, folder)
    print(f"took {', '.join(taken) if taken else 'no results file'} into {folder}"
          + ("; now run .venv/bin/python benchmarks/figures.py" if args.refresh_results else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
