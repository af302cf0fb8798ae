"""Training throughput: hpcdl.train against a bare PyTorch loop, side by side, in every speed mode.

    .venv/bin/python benchmarks/train_throughput.py                       # CPU: resnet32, batch 64, 32x32
    .venv/bin/python benchmarks/train_throughput.py --device cuda         # GPU: resnet50, batch 128, 224x224
    .venv/bin/python benchmarks/train_throughput.py --modes fp32 amp --rounds 4 --skip-scaling
    .venv/bin/python benchmarks/train_throughput.py --modes --backends horovod torch   # the backends' scaling only
    .venv/bin/python benchmarks/train_throughput.py --modes --backends horovod torch --kfac   # and K-FAC's step
    .venv/bin/python benchmarks/train_throughput.py --modes --backends horovod torch --kfac --vcluster bk \
        --output runs/bench/backends_2nodes                      # the same on 2 virtual nodes, 1 rank each

For each mode (fp32; amp: bf16 autocast; amp+cl: bf16 + channels_last; compile: torch.compile, fp32
on CPU and amp+cl on CUDA) this one process alternates, pair by pair (AB BA AB ...), between

* A: ``hpcdl.train.train`` on one rank with ``--dataset synthetic`` (data generated on the device),
  two epochs of ``--steps`` steps; the second epoch's time is measured (evaluation excluded), and
* B: a bare loop: the same model, precision and memory format, the batch already on the device,
  forward, backward, SGD step and nothing else, timed over the same number of steps after a warm-up.

On CUDA each mode starts with an untimed bare-loop warm-up (cuDNN's autotuning of that precision and
layout, once per process), so that neither side's first round pays it.

The median over pairs of B's step time / A's step time is hpcdl's speed relative to the bare loop
(1.0 = as fast). Part 2 launches ``mpirun -np 1`` and ``-np 2`` under each ``--backends`` (Horovod,
torch.distributed: the same flags, run after run in alternating order) and reports each one's images/s and
scaling efficiency, and torch's images/s over Horovod's at the most ranks measured (``--vcluster``: through
launch/mpirun.sh on a virtual cluster's nodes, one rank per node). On CUDA each rank needs a GPU of its own, so a
one-GPU machine measures 1 rank only (NCCL DDP against Horovod's NCCL path). Results: JSON and a bar chart, under
runs/bench/ (``--output`` to write elsewhere, ``--refresh-results`` into benchmarks/results/); the figures the
documents quote are computed from them in train_throughput_figures.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from figures import figure, save_json  # noqa: E402

from hpcdl.runtime.console import RankZeroParser  # noqa: E402
from hpcdl.runtime.errors import run_main  # noqa: E402
from hpcdl.runtime.numbers import integer  # noqa: E402
from hpcdl.training.config import BACKENDS, default_backend  # noqa: E402

MODES = ("fp32", "amp", "amp+cl", "compile")
SHAPES = {"cpu": dict(model="resnet32", batch=64, size=32), "cuda": dict(model="resnet50", batch=128, size=224)}

SUFFIXES = (".json", ".png")  # the files it writes, each <stem><suffix> (hpcdl.persistence.outputs.output_file)


def mode_flags(mode: str, device: str) -> list[str]:
    """hpcdl.train flags of a mode; the bare loop reads the same choices from :func:`mode_settings`."""
    amp, channels_last, compiled = mode_settings(mode, device)
    return ["--amp", amp or "off", "--channels-last", "on" if channels_last else "off",
            *(["--compile"] if compiled else [])]


def mode_settings(mode: str, device: str) -> tuple[str | None, bool, bool]:
    """(amp dtype name or None, channels_last, compiled)."""
    if mode == "fp32":
        return None, False, False
    if mode == "amp":
        return "bf16", False, False
    if mode == "amp+cl":
        return "bf16", True, False
    return ("bf16", True, True) if device == "cuda" else (None, False, True)


def hpcdl_step_seconds(mode: str, args: argparse.Namespace, output_dir: str) -> float:
    """hpcdl.train's time per step in its second epoch (the first warms up: cuDNN autotuning, compilation)."""
    from hpcdl.training.config import parse_config
    from hpcdl.training.train import train

    shape = SHAPES[args.device]
    config = parse_config([
        "--dataset", "synthetic", "--model", shape["model"], "--batch-size", str(shape["batch"]),
        "--synthetic-shape", "3", str(shape["size"]), str(shape["size"]), "--synthetic-size",
        str(args.steps * shape["batch"]), "--epochs", "2", "--output-dir", output_dir, "--no-progress",
        "--keep-checkpoints", "1", "--device", args.device, "--test-batch-size", str(shape["batch"]),
        "--workers", "0", *mode_flags(mode, args.device)])
    train(config)
    rows = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    return rows[-1]["epoch_seconds"] / args.steps


def bare_step_seconds(mode: str, args: argparse.Namespace, warm_up_only: bool = False) -> float:
    """The same model, precision and memory format in a loop with nothing else in it, the batch already on the
    device (the fastest the framework could possibly be). ``warm_up_only``: the warm-up steps alone, timed."""
    import torch
    from torch import nn

    from hpcdl.training.models import build_model

    shape, device = SHAPES[args.device], torch.device(args.device)
    amp, channels_last, compiled = mode_settings(mode, args.device)
    torch.manual_seed(0)
    model = build_model(shape["model"], 10, 3).to(device)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=fmt)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    step_model = torch.compile(model) if compiled else model
    images = torch.randn(shape["batch"], 3, shape["size"], shape["size"], device=device).to(memory_format=fmt)
    labels = torch.randint(0, 10, (shape["batch"],), device=device)
    criterion = nn.CrossEntropyLoss()
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if amp else contextlib.nullcontext())

    def steps(n: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            with autocast:
                loss = criterion(step_model(images).float(), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / n

    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    warm_up = steps(max(3, args.steps // 2))  # warm-up, as hpcdl's first epoch
    return warm_up if warm_up_only else steps(args.steps)


def launch(ranks: int, vcluster: str | None) -> list[str]:
    """The words that start ``ranks`` ranks of hpcdl.train, one thread each: a bare mpirun on this machine, or
    launch/mpirun.sh on a virtual cluster's nodes (it knows their addresses, interface and agent)."""
    if vcluster is None:
        return ["mpirun", "-np", str(ranks), "--bind-to", "none", sys.executable, "-m", "hpcdl.train"]
    return ["bash", str(REPO / "launch" / "mpirun.sh"), "--vcluster", vcluster, "-np", str(ranks), "--threads", "1",
            "--"]


def images_per_second(backend: str, ranks: int, args: argparse.Namespace, kfac: bool = False) -> float:
    """hpcdl.train's images/s in its second epoch on ``ranks`` ranks (one thread each on the CPU, one GPU each
    on CUDA) under ``backend`` (with ``--kfac``: K-FAC's step, its collectives over the backend's
    communicator)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    shape = SHAPES[args.device]
    with tempfile.TemporaryDirectory() as out:
        cmd = [*launch(ranks, args.vcluster), "--dataset", "synthetic", "--model", shape["model"],
               "--batch-size", str(shape["batch"]),
               "--synthetic-shape", "3", str(shape["size"]), str(shape["size"]),
               "--synthetic-size", str(args.steps * shape["batch"] * ranks), "--epochs", "2",
               "--output-dir", f"{out}/r", "--no-progress", "--keep-checkpoints", "1", "--device", args.device,
               "--backend", backend, *(["--kfac"] if kfac else [])]
        done = subprocess.run(cmd, env=env, cwd=REPO, timeout=1800, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"hpcdl.train --backend {backend} on {ranks} rank(s) failed (exit {done.returncode}): "
                               + " | ".join(done.stderr.strip().splitlines()[-5:]))
        rows = [json.loads(line) for line in (Path(out) / "r" / "metrics.jsonl").read_text().splitlines()]
    return float(rows[-1]["images_per_second"])


def check_vcluster(args: argparse.Namespace) -> None:
    """UsageError (one line) before any run when ``--vcluster`` cannot give each of the 2 ranks a node."""
    from hpcdl.runtime.errors import UsageError
    from hpcdl.tools import vcluster

    if args.device != "cpu":
        raise UsageError("--vcluster measures CPU ranks (virtual nodes share this machine's devices): drop "
                         "--device cuda")
    cluster = vcluster.load(args.vcluster)
    if cluster is None:
        raise UsageError(f"no virtual cluster named {args.vcluster!r}; start one with .venv/bin/python -m "
                         f"hpcdl.tools.vcluster up --nodes 2 --name {args.vcluster}")
    if len(cluster.nodes) < 2:
        raise UsageError(f"virtual cluster {args.vcluster!r} has {len(cluster.nodes)} node(s); the 2-rank runs need 2")


def rank_counts(device: str) -> tuple[int, ...]:
    """1 and 2 ranks, except on a machine with one GPU (two ranks may not share one: hpcdl refuses)."""
    if device == "cuda":
        import torch

        return (1, 2) if torch.cuda.device_count() >= 2 else (1,)
    return (1, 2)


def scaling(args: argparse.Namespace) -> dict:
    """images/s of hpcdl.train on 1 and 2 ranks under each backend (same per-rank batch), the median of
    ``--rounds`` runs taken in alternating backend order; the first backend's figures also at the top level."""
    variants = [*args.backends, *(f"{backend}+kfac" for backend in args.backends if args.kfac)]
    counts = rank_counts(args.device)
    runs: dict[str, dict[int, list[float]]] = {variant: {n: [] for n in counts} for variant in variants}
    loads: list[float] = []  # the machine's 1-minute load before each run: a shared machine's timings drift
    for round_ in range(args.rounds):
        order = variants if round_ % 2 == 0 else list(reversed(variants))
        for ranks in counts:
            for variant in order:
                backend, _, kfac = variant.partition("+")
                loads.append(round(os.getloadavg()[0], 2))
                runs[variant][ranks].append(images_per_second(backend, ranks, args, kfac=bool(kfac)))
    result: dict = {"backends": {}, "load": loads}
    most = max(counts)
    for backend, by_ranks in runs.items():
        figures = {f"images_per_second_{n}_rank": statistics.median(by_ranks[n]) for n in counts}
        if most == 2:
            figures["scaling_efficiency_2_ranks"] = figures["images_per_second_2_rank"] / (
                2 * figures["images_per_second_1_rank"])
        result["backends"][backend] = {**figures, "runs": by_ranks}
    result.update({k: v for k, v in result["backends"][args.backends[0]].items() if k != "runs"})
    for suffix in ("", "+kfac"):
        if {f"horovod{suffix}", f"torch{suffix}"} <= set(runs):
            torch_, horovod = (result["backends"][f"{b}{suffix}"][f"images_per_second_{most}_rank"]
                               for b in ("torch", "horovod"))
            result[f"torch_over_horovod_{most}_ranks{suffix.replace('+', '_')}"] = torch_ / horovod
    return result


def plot(report: dict, stem: Path) -> None:
    modes = list(report["modes"])
    shape = SHAPES[report["device"]]
    ips = lambda seconds: shape["batch"] / seconds  # noqa: E731
    with figure(stem, figsize=(7, 4)) as (_, ax):
        if not modes:  # the scaling part alone: each backend's images/s on 1 and 2 ranks
            backends = list(report.get("backends", {}))
            counts = [n for n in (1, 2) if f"images_per_second_{n}_rank" in report["backends"][backends[0]]]
            width = 0.8 / len(counts)
            for k, ranks in enumerate(counts):
                ax.bar([i + (k - (len(counts) - 1) / 2) * width for i in range(len(backends))],
                       [report["backends"][b][f"images_per_second_{ranks}_rank"] for b in backends], width,
                       label=f"{ranks} rank(s)")
            ax.set_xticks(list(range(len(backends))), [f"--backend {b}" for b in backends])
            where = "1 thread per rank" if report["device"] == "cpu" else report["device_name"]
            ax.set_title(f"{shape['model']}, batch {shape['batch']} per rank, {where}")
        else:
            x = range(len(modes))
            ax.bar([i - 0.2 for i in x], [ips(statistics.median(report["modes"][m]["bare_step_seconds"]))
                                          for m in modes], 0.4, label="bare loop (batch on device)")
            ax.bar([i + 0.2 for i in x], [ips(statistics.median(report["modes"][m]["hpcdl_step_seconds"]))
                                          for m in modes], 0.4, label="hpcdl.train")
            for i, m in zip(x, modes, strict=True):
                ax.annotate(f"{report['modes'][m]['speed_ratio']:.2f}x", (i + 0.2, 0), ha="center", va="bottom")
            ax.set_xticks(list(x), modes)
            ax.set_title(f"{shape['model']}, batch {shape['batch']}, {report['device_name']}")
        ax.set_ylabel("images/s")
        ax.legend()


def main(argv: list[str] | None = None) -> None:
    parser = RankZeroParser(prog="benchmarks/train_throughput.py", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--modes", nargs="*", choices=MODES, default=list(MODES),
                        help="speed modes against the bare loop (none: only the scaling part)")
    parser.add_argument("--steps", type=integer(1), default=12, help="measured steps per round")
    parser.add_argument("--rounds", type=integer(1), default=4, help="pairs per mode, in alternating order")
    parser.add_argument("--skip-scaling", action="store_true")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=[default_backend()],
                        help="--backend values whose 1- and 2-rank scaling is measured side by side (default: "
                             "hpcdl.train's default backend)")
    parser.add_argument("--kfac", action="store_true", help="also measure each backend's scaling with --kfac")
    parser.add_argument("--vcluster", help="run the scaling part on this virtual cluster's nodes, one rank per node "
                        "(python -m hpcdl.tools.vcluster up; CPU only)")
    parser.add_argument("--output", type=Path, help="results stem: writes STEM.json and STEM.png (default: a new "
                        "folder under runs/bench/; --refresh-results replaces the committed figures)")
    from hpcdl.persistence import outputs

    outputs.add_arguments(parser)
    measure(parser.parse_args(argv))


def measure(args: argparse.Namespace) -> None:
    import torch
    from tqdm import tqdm

    from hpcdl.persistence import outputs
    from hpcdl.runtime import world
    from hpcdl.runtime.errors import UsageError

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but torch sees no GPU")
    if args.vcluster is not None:
        check_vcluster(args)
    stem = outputs.results_stem(outputs.given_stem(args.output, SUFFIXES),
                                f"train_throughput_{args.device}", SUFFIXES,
                                refresh_results=args.refresh_results, force=args.force)
    me = world.init(use_horovod=default_backend() == "horovod", torch_distributed=default_backend() == "torch")
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {me.threads} thread(s)"
    report: dict = {"device": args.device, "device_name": device_name, "steps": args.steps, "rounds": args.rounds,
                    "vcluster": args.vcluster, **SHAPES[args.device], "modes": {}}
    with tempfile.TemporaryDirectory() as scratch:
        for mode in args.modes:
            hpcdl_times: list[float] = []
            bare_times: list[float] = []
            # cuDNN autotunes each new convolution shape, precision and layout once per process (11 s for amp+cl's
            # first epoch on an H200): done here, outside every timed part, so no round pays it.
            warm_up = bare_step_seconds(mode, args, warm_up_only=True) if args.device == "cuda" else None
            for round_ in tqdm(range(args.rounds), desc=mode):
                # Pairs in alternating order (AB BA ...): neither side always runs second on a drifting machine.
                for side in ("hpcdl", "bare") if round_ % 2 == 0 else ("bare", "hpcdl"):
                    if side == "hpcdl":
                        hpcdl_times.append(hpcdl_step_seconds(mode, args, f"{scratch}/{mode}{round_}"))
                    else:
                        bare_times.append(bare_step_seconds(mode, args))
            ratios = [b / h for h, b in zip(hpcdl_times, bare_times, strict=True)]
            report["modes"][mode] = {"hpcdl_step_seconds": hpcdl_times, "bare_step_seconds": bare_times,
                                     "paired_speed_ratios": ratios, "speed_ratio": statistics.median(ratios),
                                     **({"warm_up_step_seconds": warm_up} if warm_up is not None else {})}
            batch = SHAPES[args.device]["batch"]
            print(f"{mode:8s} hpcdl.train {batch / statistics.median(hpcdl_times):8.1f} img/s | bare loop "
                  f"{batch / statistics.median(bare_times):8.1f} img/s | hpcdl/bare speed "
                  f"{statistics.median(ratios):.3f} (pairs {min(ratios):.3f}-{max(ratios):.3f})", flush=True)
            save_json(stem, report, indent=2)  # a run cut short keeps its modes
    if not args.skip_scaling:
        report.update(scaling(args))
        for backend, figures in report["backends"].items():
            per_rank = ", ".join(f"{n} rank(s) {figures[f'images_per_second_{n}_rank']:.0f} img/s"
                                 for n in rank_counts(args.device))
            efficiency = figures.get("scaling_efficiency_2_ranks")
            print(f"{backend:8s} {per_rank}"
                  + (f" -> scaling efficiency {100 * efficiency:.0f}%" if efficiency is not None else ""))
        for key in [k for k in report if k.startswith("torch_over_horovod_")]:
            ranks = key.split("_")[3]
            print(f"torch/horovod images/s at {ranks} rank{'s' if ranks != '1' else ''}"
                  f"{' with K-FAC' if key.endswith('kfac') else ''}: {report[key]:.3f}")
    plot(report, stem)
    print(f"wrote {save_json(stem, report, indent=2)} and {outputs.output_file(stem, '.png')}")


if __name__ == "__main__":
    run_main(main, program="train_throughput.py")
