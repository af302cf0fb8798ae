"""Time of K-FAC's eigendecomposition phase on 1 rank against 2 ranks (resnet32's factors).

    .venv/bin/python benchmarks/kfac_eigen_scaling.py            # launches the runs, writes results
    mpirun -np 2 .venv/bin/python benchmarks/kfac_eigen_scaling.py --worker   # one measurement

The launcher runs the worker under ``mpirun -np 1`` and ``-np 2`` (one intra-op thread per rank,
so that the only difference is the number of ranks) and, for context, one rank with 2 threads.
Open MPI runs with mpi_yield_when_idle=1: on a machine with no core to spare per rank, a rank
waiting in MPI (Horovod's background thread does every cycle) must not spin on a core the other
rank's decompositions need; the default busy polling is measured too, for context.
A worker builds resnet32, captures real factors from one CIFAR-shaped batch, then runs steps in
which every factor is decomposed (inv_update_freq=1) and records the decomposition phase of each
step: the owned eigendecompositions plus the broadcast of the results (grad_worker_fraction=1,
every rank receives everything). The phase time of a step is the slowest rank's; the benchmark
reports the median over steps, and also the CPU seconds of the busiest rank's decompositions,
which other processes on a shared machine do not inflate. Target from the issue: at least 1.7x faster on 2 ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from figures import figure, results, save_json, table, times  # noqa: E402

from hpcdl.persistence import outputs  # noqa: E402
from hpcdl.runtime.console import RankZeroParser  # noqa: E402
from hpcdl.runtime.errors import run_main  # noqa: E402
from hpcdl.runtime.numbers import integer, real  # noqa: E402


def worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
    import torch
    import torch.nn.functional as F

    from hpcdl.runtime import world
    from hpcdl.training.models import build_model
    from kfac import KFACPreconditioner

    w = world.init()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model("resnet32", num_classes=10, in_channels=3)
    pre = KFACPreconditioner(model, factor_update_freq=10**6, inv_update_freq=1, grad_worker_fraction=args.fraction)
    g = torch.Generator().manual_seed(w.rank)
    x, y = torch.randn(args.batch_size, 3, 32, 32, generator=g), torch.randint(0, 10, (args.batch_size,), generator=g)
    from mpi4py import MPI

    # CPU seconds of this rank's own decompositions (one thread per rank: they run in this thread).
    # Unlike wall time it does not change when other processes share the cores.
    import kfac.decompose

    cpu = [0.0]
    decompose = kfac.decompose._recover

    def timed_decompose(*a):
        start = time.thread_time()
        result = decompose(*a)
        cpu[0] += time.thread_time() - start
        return result

    kfac.decompose._recover = timed_decompose
    comm = world.comm()
    times, cpu_times = [], []
    for step in range(args.steps + 1):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        comm.Barrier()
        before, cpu[0] = pre.timings.get("decompositions", 0.0), 0.0
        pre.step()
        mine = pre.timings["decompositions"] - before
        slowest = comm.allreduce(mine, op=MPI.MAX)
        slowest_cpu = comm.allreduce(cpu[0], op=MPI.MAX)
        if step > 0:  # step 0 also warms up the allocator and the worker threads
            times.append(slowest)
            cpu_times.append(slowest_cpu)
    if w.rank == 0:
        loads = pre.assignment.loads([layer.a_dim for layer in pre.layers], [layer.g_dim for layer in pre.layers])
        print(json.dumps({"ranks": w.size, "threads": args.threads, "fraction": args.fraction, "times_s": times,
                          "median_s": statistics.median(times), "min_s": min(times), "cpu_s": cpu_times,
                          "median_cpu_s": statistics.median(cpu_times), "loads": loads}), flush=True)


def launch(ranks: int, threads: int, fraction: float, steps: int, batch_size: int,
           yield_when_idle: bool = True) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               HOROVOD_DYNAMIC_PROCESS_SETS="1", PYTHONUNBUFFERED="1",
               OMPI_MCA_mpi_yield_when_idle="1" if yield_when_idle else "0")
    cmd = ["timeout", "600", "mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(ranks), sys.executable,
           __file__, "--worker", "--threads", str(threads), "--fraction", str(fraction), "--steps", str(steps),
           "--batch-size", str(batch_size)]
    print("$", " ".join(cmd[2:]), flush=True)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"run failed (exit {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> None:
    parser = RankZeroParser(prog="benchmarks/kfac_eigen_scaling.py", description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help="measure (run under mpirun)")
    parser.add_argument("--threads", type=integer(1, 256), default=1)
    parser.add_argument("--fraction", type=real(0, low_open=True, high=1), default=1.0)
    parser.add_argument("--steps", type=integer(1), default=8)
    parser.add_argument("--batch-size", type=integer(1), default=64)
    parser.add_argument("--out", type=Path, default=None,
                        help="results stem: STEM.json/.png (default: a new folder under runs/bench/; "
                             "--refresh-results replaces benchmarks/results/kfac_eigen_scaling.*)")
    outputs.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    args.out = outputs.results_stem(args.out, "kfac_eigen_scaling", (".json", ".png"),
                                    refresh_results=args.refresh_results, force=args.force, flag="--out")

    runs = {
        "1 rank x 1 thread": launch(1, 1, 1.0, args.steps, args.batch_size),
        "2 ranks x 1 thread": launch(2, 1, 1.0, args.steps, args.batch_size),
        "1 rank x 2 threads": launch(1, 2, 1.0, args.steps, args.batch_size),
        # Context: Open MPI's default busy polling. Each rank's Horovod background thread waits in MPI
        # every cycle; polling, it takes a core from the decompositions when ranks have no spare cores.
        "2 ranks x 1 thread, MPI busy polling": launch(2, 1, 1.0, args.steps, args.batch_size, yield_when_idle=False),
    }
    base = runs["1 rank x 1 thread"]["median_s"]
    speedup = base / runs["2 ranks x 1 thread"]["median_s"]
    cpu_speedup = runs["1 rank x 1 thread"]["median_cpu_s"] / runs["2 ranks x 1 thread"]["median_cpu_s"]
    report = {"model": "resnet32", "batch": args.batch_size, "runs": runs, "speedup_2_ranks": speedup,
              "cpu_speedup_2_ranks": cpu_speedup, "target": 1.7}
    save_json(args.out, report, indent=2)
    with figure(args.out, figsize=(7.5, 3.6)) as (_, ax):
        names = list(runs)
        ax.bar([n.replace(", ", ",\n") for n in names], [runs[n]["median_s"] * 1e3 for n in names],
               color=["tab:gray", "tab:blue", "tab:orange", "tab:red"])
        for i, n in enumerate(names):
            ax.text(i, runs[n]["median_s"] * 1e3, f"{base / runs[n]['median_s']:.2f}x", ha="center", va="bottom")
        ax.tick_params(axis="x", labelsize=8)
        ax.set_ylabel("decomposition phase per inverse update (ms)")
        ax.set_title("K-FAC eigendecompositions of resnet32's factors")
    verdict = "target met" if speedup >= 1.7 else "target MISSED"
    print(f"2 ranks: {speedup:.2f}x faster than 1 in wall time ({verdict}), {cpu_speedup:.2f}x less CPU time on the "
          f"busiest rank; wrote {args.out}.json/.png")


# ---- the figures the documents quote (benchmarks/figures.py) -------------------------------------------

def _speedup() -> str:
    r = results("kfac_eigen_scaling")
    one, two = r["runs"]["1 rank x 1 thread"], r["runs"]["2 ranks x 1 thread"]
    return f"{times(r['speedup_2_ranks'])} ({1000 * one['median_s']:.0f} → {1000 * two['median_s']:.0f} ms)"


def _polling() -> str:
    runs = results("kfac_eigen_scaling")["runs"]
    spinning, yielding = runs["2 ranks x 1 thread, MPI busy polling"], runs["2 ranks x 1 thread"]
    slower = times(spinning["median_s"] / yielding["median_s"], 1)
    return f"{slower} slower ({1000 * spinning['median_s']:.0f} against {1000 * yielding['median_s']:.0f} ms)"


def _table() -> str:
    runs = results("kfac_eigen_scaling")["runs"]
    one = runs["1 rank x 1 thread"]["median_s"]
    return table(["run", "median wall ms (slowest rank)", "speedup vs 1 rank", "CPU ms of the busiest rank"],
                 [(name, f"{1000 * r['median_s']:.1f}", times(one / r["median_s"]), f"{1000 * r['median_cpu_s']:.1f}")
                  for name, r in runs.items()])


FIGURES = {"eigen.speedup": _speedup, "eigen.polling": _polling, "eigen.table": _table}


if __name__ == "__main__":
    run_main(main, program="kfac_eigen_scaling.py")
