"""Allreduce benchmark: MPI, Horovod, torch.distributed and our algorithms, side by side.

    mpirun -np 2 python -m hpcdl.bench.allreduce                      # results under runs/bench/allreduce_np2/
    mpirun -np 2 python -m hpcdl.bench.allreduce --refresh-results    # replace benchmarks/results/allreduce_np2.*

For every message size (float32, powers of two) each implementation is timed in turn; the
sweep over all sizes is repeated for several rounds, so that a burst of load on a shared
machine spoils no single implementation or size, and the best timed loop counts. Prints
OSU-style tables of latency and bus bandwidth, writes CSV, JSON and a log-log plot, fits the
alpha-beta model to our ring and predicts what a ResNet-50 gradient allreduce costs at scale
on a real network.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI
from tqdm import tqdm

from hpcdl.bench import alphabeta, contenders, report, timing
from hpcdl.bench.sizes import format_size, parse_size
from hpcdl.collectives import ALGORITHMS
from hpcdl.persistence import outputs
from hpcdl.runtime import world
from hpcdl.runtime.console import RankZeroParser, print0
from hpcdl.runtime.errors import UsageError, run_main
from hpcdl.runtime.numbers import integer, real

ACCEPTANCE_FROM_BYTES = 4 << 20  # the bandwidth targets apply from 4 MiB up
PROGRAM = "hpcdl.bench.allreduce"
TARGETS = {"ring": 0.80, "horovod": 0.90}  # fraction of MPI.Allreduce's bus bandwidth


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = RankZeroParser(prog="python -m hpcdl.bench.allreduce", description=__doc__.split("\n\n")[0])
    parser.add_argument("--min-size", type=parse_size, default=4, help="smallest message, e.g. 4, 1K (default 4 B)")
    parser.add_argument(
        "--max-size", type=parse_size, default=256 << 20, help="largest message, e.g. 64K, 256M (default 256M)"
    )
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=None,
        help="where CSV, JSON and PNG go (default: a new folder under runs/bench/)",
    )
    parser.add_argument("--name", default=None, help="file name stem (default allreduce_np<ranks>)")
    parser.add_argument(
        "--algorithms",
        nargs="*",
        choices=list(ALGORITHMS),
        default=list(ALGORITHMS),
        help="our algorithms to include (none: just MPI/Horovod/gloo)",
    )
    parser.add_argument(
        "--rounds", type=integer(1), default=5, help="sweeps over all sizes; the best timed loop counts (default 5)"
    )
    parser.add_argument("--seconds", type=real(0, low_open=True, high=3600), default=0.05,
                        help="time budget of one timed loop (default 0.05 s)")
    parser.add_argument("--no-horovod", action="store_true", help="leave Horovod out (and do not initialise it)")
    parser.add_argument("--no-gloo", action="store_true", help="leave torch.distributed (gloo) out")
    parser.add_argument(
        "--horovod-cycle-time-ms",
        type=real(0, low_open=True, high=60_000),
        default=None,
        help="HOROVOD_CYCLE_TIME for the Horovod rows (default: Horovod's own, or the environment's)",
    )
    parser.add_argument(
        "--network-gbps", type=real(0, low_open=True), default=100.0,
        help="link rate of the network to predict for (default 100 Gb/s)",
    )
    parser.add_argument(
        "--network-latency-us", type=real(0), default=2.0, help="its per-message latency, assumed (default 2 us)"
    )
    parser.add_argument(
        "--predict-ranks", type=integer(2), nargs="+", default=[64, 512, 4096], help="rank counts to predict for"
    )
    outputs.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.name is not None and (not args.name.strip() or "/" in args.name or args.name.startswith(".")):
        parser.error(f"--name is a file name stem without '/' or a leading '.', e.g. allreduce_np2 (got {args.name!r})")
    if args.min_size > args.max_size:
        parser.error(f"--min-size ({args.min_size} B) is larger than --max-size ({args.max_size} B)")
    if args.max_size < timing.FLOAT32_BYTES:
        parser.error("--max-size must be at least 4 bytes (one float32)")
    if args.rounds < 1 or args.seconds <= 0 or any(n < 2 for n in args.predict_ranks):
        parser.error("--rounds must be >= 1, --seconds > 0 and --predict-ranks >= 2")
    if args.network_gbps <= 0 or args.network_latency_us < 0:
        parser.error("--network-gbps must be > 0 and --network-latency-us >= 0")
    if args.horovod_cycle_time_ms is not None and args.horovod_cycle_time_ms <= 0:
        parser.error("--horovod-cycle-time-ms must be > 0")
    return args


def build_contenders(args: argparse.Namespace, comm: MPI.Comm) -> list[contenders.Contender]:
    chosen = [contenders.mpi_allreduce(comm)]
    if not args.no_horovod:
        chosen.append(contenders.horovod_allreduce(comm))
    if not args.no_gloo:
        gloo = contenders.gloo_allreduce(comm)
        if gloo is None:
            print0("note: torch.distributed with gloo could not start here; its row is left out")
        else:
            chosen.append(gloo)
    chosen += [contenders.ours(name, comm) for name in args.algorithms]
    return chosen


def verify(contender: contenders.Contender, message: np.ndarray, expected: float, comm: MPI.Comm) -> None:
    """Stop the benchmark on every rank if an implementation returns a wrong sum: fast and wrong is worthless."""
    result = contender.prepare(message, False)()
    ok = bool(np.all(result == expected))
    if not all(comm.allgather(ok)):  # every rank knows, so every rank stops by itself
        raise UsageError(
            f"{contender.name} returned a wrong allreduce result for {message.nbytes} bytes; check the MPI installation"
        )


def run(args: argparse.Namespace, comm: MPI.Comm, chosen: list[contenders.Contender]) -> list[report.Row]:
    """Time every contender at every size, sweeping all sizes once per round.

    Rounds sweep the whole size range, so the timed loops of one size are spread over the run
    and a burst of load from other jobs spoils at most one of them; the best loop counts.
    """
    ranks, rank = comm.Get_size(), comm.Get_rank()
    sizes = timing.message_sizes(args.min_size, args.max_size)
    expected = ranks * (ranks + 1) / 2  # every rank sends rank+1: the sum 1 + ... + N is exact in float32
    loops: dict[tuple[str, int], int] = {}  # timed iterations, calibrated in the first round
    best: dict[tuple[str, int], timing.Latency] = {}
    progress = tqdm(
        total=len(sizes) * len(chosen) * args.rounds, disable=rank != 0, unit="loop", mininterval=1, file=sys.stderr
    )
    for round_index in range(args.rounds):
        for nbytes in sizes:
            progress.set_description(f"round {round_index + 1}/{args.rounds} {format_size(nbytes):>8}")
            message = np.full(nbytes // timing.FLOAT32_BYTES, rank + 1, dtype=np.float32)
            for contender in chosen:
                key = (contender.name, nbytes)
                with contender.running():
                    if round_index == 0:
                        verify(contender, message, expected, comm)
                    call = contender.prepare(message, True)
                    if key not in loops:
                        loops[key] = timing.calibrate(call, comm, args.seconds)
                    latency = timing.measure(call, comm, loops[key])
                if key not in best or latency.mean < best[key].mean:
                    best[key] = latency
                del call
                progress.update()
    progress.close()
    return [
        report.Row(name, nbytes, nbytes // timing.FLOAT32_BYTES, ranks, timing.WARMUP, latency.iterations, args.rounds,
                   latency.mean * 1e6, latency.low * 1e6, latency.high * 1e6)
        for nbytes in sizes
        for name in (c.name for c in chosen)
        for latency in [best[(name, nbytes)]]
    ]  # fmt: skip


def scale_prediction(args: argparse.Namespace, rows: list[report.Row], ranks: int) -> dict[str, Any]:
    """Fit the ring model here, then predict a ResNet-50 gradient allreduce on the chosen network."""
    ring = [r for r in rows if r.implementation == "ring"]
    if ranks < 2 or len(ring) < 2:
        return {"note": "needs the ring measured at two or more sizes on two or more ranks"}
    fitted = alphabeta.fit_ring([r.bytes for r in ring], [r.latency_us * 1e-6 for r in ring], ranks)
    net = alphabeta.network(args.network_gbps, args.network_latency_us)
    slow_steps = alphabeta.AlphaBeta(fitted.alpha, net.bandwidth)  # our Python ring's per-step cost on that network
    nbytes = alphabeta.RESNET50_GRADIENT_BYTES
    return {
        "fitted_here": {"alpha_us": fitted.alpha * 1e6, "bandwidth_GBps": fitted.bandwidth / 1e9, "ranks": ranks},
        "network_assumed": {
            "gbps": args.network_gbps,
            "alpha_us": net.alpha * 1e6,
            "bandwidth_GBps": net.bandwidth / 1e9,
        },
        "message_bytes": nbytes,
        "predictions": [
            {
                "ranks": n,
                "ring_ms": net.ring_seconds(nbytes, n) * 1e3,
                "ring_bandwidth_term_ms": alphabeta.AlphaBeta(0.0, net.bandwidth).ring_seconds(nbytes, n) * 1e3,
                "ring_with_alpha_fitted_here_ms": slow_steps.ring_seconds(nbytes, n) * 1e3,
                "naive_ms": net.naive_seconds(nbytes, n) * 1e3,
            }
            for n in args.predict_ranks
        ],
    }


def describe_prediction(prediction: dict[str, Any]) -> str:
    if "note" in prediction:
        return f"# alpha-beta model: skipped ({prediction['note']})"
    here, net = prediction["fitted_here"], prediction["network_assumed"]
    lines = [
        f"# alpha-beta fit of our ring on {here['ranks']} ranks here: alpha = {here['alpha_us']:.1f} us per step, "
        f"B = {here['bandwidth_GBps']:.2f} GB/s",
        f"# assumed network: {net['gbps']:g} Gb/s link = {net['bandwidth_GBps']:.2f} GB/s, "
        f"alpha = {net['alpha_us']:g} us "
        "per step (an assumption, not measured)",
        f"# ring allreduce of a ResNet-50 gradient ({alphabeta.RESNET50_PARAMETERS:,} float32 = "
        f"{prediction['message_bytes'] / 1e6:.1f} MB) on that network:",
        f"# {'ranks':>6} {'ring (ms)':>10} {'of which bandwidth':>19} {'ring, alpha fitted here':>24} "
        f"{'naive (ms)':>12}",
    ]
    for p in prediction["predictions"]:
        lines.append(
            f"  {p['ranks']:>6} {p['ring_ms']:>10.1f} {p['ring_bandwidth_term_ms']:>19.1f} "
            f"{p['ring_with_alpha_fitted_here_ms']:>24.1f} {p['naive_ms']:>12.0f}"
        )
    return "\n".join(lines)


def acceptance(rows: list[report.Row]) -> dict[str, Any]:
    """The lowest busbw ratio to MPI.Allreduce at >= 4 MiB, per implementation with a target."""
    summary = {}
    for name, target in TARGETS.items():
        ratios = report.bandwidth_ratios(rows, name, "MPI.Allreduce", ACCEPTANCE_FROM_BYTES)
        if ratios:
            summary[name] = {
                "target": target,
                "min_ratio": min(ratios.values()),
                "met": min(ratios.values()) >= target,
                "ratios": {str(size): ratio for size, ratio in ratios.items()},
            }
    return summary


def metadata(args: argparse.Namespace, comm: MPI.Comm, me: world.World) -> dict[str, Any]:
    import torch

    hosts = sorted(set(comm.allgather(me.hostname)))
    horovod_version = None
    if not args.no_horovod:
        import horovod

        horovod_version = horovod.__version__
    return {
        "command": " ".join(["python -m hpcdl.bench.allreduce", *sys.argv[1:]]),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ranks": comm.Get_size(),
        "hosts": hosts,
        "cpu_cores_per_host": os.cpu_count(),
        "threads_per_rank": me.threads,
        "mpi_library": MPI.Get_library_version().splitlines()[0].strip(),
        "versions": {"python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__,
                     "mpi4py": __import__("mpi4py").__version__, "horovod": horovod_version},
        "horovod_env": {k: v for k, v in os.environ.items() if k.startswith("HOROVOD_")},
        "dtype": "float32",
        "op": "SUM",
        "timing": f"best of {args.rounds} rounds (each sweeps all sizes) of timed loops of about {args.seconds} s "
                  "(length "
                  f"calibrated from {timing.WARMUP} warm-up calls), averaged over ranks; Horovod is started only "
                  "while it is measured",
    }  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    load_before = os.getloadavg()
    me = world.init(use_horovod=False)  # Horovod runs only while it is measured (see contenders)
    outputs.require_launcher(2, PROGRAM)
    name = args.name or f"allreduce_np{world.comm().Get_size()}"
    stem = outputs.results_stem(
        args.output_dir / name if args.output_dir else None,
        name,
        (".csv", ".json", ".png"),
        refresh_results=args.refresh_results,
        force=args.force,
        flag="--output-dir/--name",
        comm=world.comm(),
    )
    if not args.no_horovod and importlib.util.find_spec("horovod") is None:
        print0("note: Horovod is not installed here; its row is left out (as with --no-horovod)")
        args.no_horovod = True
    if not args.no_horovod:
        if args.horovod_cycle_time_ms is not None:  # read by hvd.init, which the Horovod contender calls
            os.environ["HOROVOD_CYCLE_TIME"] = f"{args.horovod_cycle_time_ms:g}"
        import horovod.torch as hvd

        if not hasattr(hvd, "init"):
            raise UsageError(
                "Horovod's compiled extension is missing (run: bash scripts/setup.sh), or use --no-horovod"
            )
    comm = world.comm()
    chosen = build_contenders(args, comm)
    names = [c.name for c in chosen]
    print0(f"# allreduce of float32 (SUM) on {comm.Get_size()} ranks; implementations: {', '.join(names)}")
    rows = run(args, comm, chosen)
    prediction = scale_prediction(args, rows, comm.Get_size())
    targets = acceptance(rows)
    meta = metadata(args, comm, me)
    meta["load_average_1min"] = {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2)}
    if me.rank != 0:
        return

    print(report.table(rows, names, "latency_us"))
    print(report.table(rows, names, "busbw_gbps"))
    print(describe_prediction(prediction))
    load = meta["load_average_1min"]
    print(f"# load average (1 min) before/after: {load['before']} / {load['after']} "
          f"on {meta['cpu_cores_per_host']} cores "
          "(other jobs on the machine distort timings)")  # fmt: skip
    for name, result in targets.items():
        print(f"# {name} / MPI.Allreduce bus bandwidth at >= {format_size(ACCEPTANCE_FROM_BYTES)}: "
              f"lowest {result['min_ratio']:.2f} "
              f"(target >= {result['target']:.2f}: {'met' if result['met'] else 'NOT met'})")  # fmt: skip
    try:
        report.write_csv(outputs.output_file(stem, ".csv"), rows)
        report.write_json(
            outputs.output_file(stem, ".json"), rows, meta=meta, alpha_beta=prediction, acceptance=targets
        )
        hosts = ", ".join(meta["hosts"])
        title = f"allreduce, float32 SUM, {comm.Get_size()} ranks on {hosts} ({meta['cpu_cores_per_host']} cores)"
        report.plot(outputs.output_file(stem, ".png"), rows, names, title)
    except OSError as error:  # report writes atomically: a failed file leaves the previous one (or none)
        raise UsageError(str(error)) from None
    print(f"# wrote {stem}.csv, .json and .png", flush=True)


if __name__ == "__main__":
    run_main(main, PROGRAM)
