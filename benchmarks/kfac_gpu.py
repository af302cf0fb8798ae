"""K-FAC's overhead on one GPU, beside SGD and kfac-pytorch, in one command and under five minutes, with no setup.

    bash benchmarks/kfac_gpu.sh --out DIR --budget SECONDS [--dry-run] [--kfac-pytorch PATH]

Runs from the GPU machine's own Python with ``PYTHONPATH=.`` (kfac/ imports only torch; the benchmark needs
torch, torchvision, numpy, tqdm and matplotlib, which such images carry): ResNet-50, batch 64, 224x224, SGD against
K-FAC with its GPU method (``newton``: Newton–Schulz inverses from matrix products; eigen's H200 figures are
issue 44's) at (factor, inverse) update frequencies (1, 10) and (10, 100), in fp32 (TF32 on) and with ``--amp``, each
step by benchmarks/kfac_overhead.py (contenders alternating step by step, phases timed by device events), peak
memory in fresh processes (fp32). kfac-pytorch comes from a local copy (``--kfac-pytorch``, default
``.kfac-pytorch`` when present: a folder holding its ``kfac`` package, e.g. ``git archive`` of its checkout; no
install and no dist-info needed, benchmarks/kfac_pytorch_adapter.py).

Each step has its own time limit, a share of ``--budget`` in proportion to its estimate (from issue 44's H200
figures), taken from what the steps before it left (time one did not need goes to the next); a step writes its
results as it goes (DIR/kfac_gpu_<step>.json after every frequency), and DIR/kfac_gpu.json gathers them after
every step, so a limit that cuts a step short keeps what it measured. ``--dry-run`` prints the plan with its
estimate and exits non-zero when the estimate does not fit the budget.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hpcdl.persistence import outputs  # noqa: E402
from hpcdl.runtime.numbers import real  # noqa: E402

CONFIGS = ((1, 10), (10, 100))
MEMORY_CONFIGS = ((1, 10),)  # issue 44's memory target at its costlier frequency; (10, 100) adds two processes
ROUNDS = 2
# ms per step on one H200, ResNet-50 batch 64, fp32 with TF32 (this benchmark's run of 2026-11-28, newton with IEEE
# statistics: an over-estimate for later packages): SGD, hpcdl's K-FAC and kfac-pytorch at each frequency.
STEP_MS = {"sgd": 25.5, (1, 10): (142.0, 69.0), (10, 100): (41.5, 66.0)}
PROCESS_S = 20.0  # a fresh process: CUDA's start, cuDNN's autotuning of the first steps
WARMUP_STEPS = 3  # per contender and frequency, beside 3 SGD steps once


@dataclass(frozen=True)
class Step:
    """One kfac_overhead.py run: its name (DIR/<name>.json), arguments and estimated seconds."""

    name: str
    arguments: tuple[str, ...]
    estimate_s: float


def timing_seconds(with_kfac_pytorch: bool, configs: tuple[tuple[int, int], ...] = CONFIGS) -> float:
    """The estimated seconds of one precision's timing rounds at ``configs``, its device-timed rounds included."""
    total = PROCESS_S + WARMUP_STEPS * STEP_MS["sgd"] / 1e3
    for factors, inverse in configs:
        period = inverse  # lcm(factors, inverse) for these pairs
        ours, theirs = STEP_MS[(factors, inverse)]
        contenders = STEP_MS["sgd"] + ours + (theirs if with_kfac_pytorch else 0.0)
        total += WARMUP_STEPS * (ours + theirs) / 1e3 + (ROUNDS * contenders + STEP_MS["sgd"] + ours) * period / 1e3
    return total


def memory_seconds(with_kfac_pytorch: bool) -> float:
    """SGD's and (1, 10)'s peak memory (the larger: its statistics every step), each in a fresh process of at most
    12 steps."""
    processes = 1 + len(MEMORY_CONFIGS) * (2 if with_kfac_pytorch else 1)
    return processes * (PROCESS_S + 12 * STEP_MS[(1, 10)][1] / 1e3)


def plan(kfac_pytorch: Path | None) -> list[Step]:
    both = kfac_pytorch is not None
    # newton: the method for GPUs (matrix products only); eigen's H200 figures are issue 44's (243 ms at (1, 10))
    # --kfac-tf32: the statistics and newton's first steps on the matrix units, as hpcdl.train runs K-FAC on CUDA
    ours = ["--device", "cuda", "--rounds", str(ROUNDS), "--kfac-method", "newton", "--kfac-tf32"]
    common = [*ours, "--configs", " ".join(f"{f},{i}" for f, i in CONFIGS)]
    if both:
        common += ["--kfac-pytorch", str(kfac_pytorch)]
    # bf16 statistics of the float32 model (statistics_dtype): what (1, 10) in fp32 needs, its A statistics in TF32
    # alone being 0.9x SGD's step (kfac_overhead.md); ours beside SGD only, at (1, 10)
    memory = ("--memory-configs", " ".join(f"{f},{i}" for f, i in MEMORY_CONFIGS))
    return [Step("fp32", (*common, "--precisions", "fp32", *memory), timing_seconds(both) + memory_seconds(both)),
            Step("amp", (*common, "--precisions", "amp", "--amp-dtype", "bf16", "--no-memory"), timing_seconds(both)),
            Step("fp32_bf16_statistics", (*ours, "--configs", "1,10", "--precisions", "fp32",
                                          "--kfac-statistics-precision", "bf16", "--no-memory"),
                 timing_seconds(False, ((1, 10),)))]


def limits(steps: list[Step], budget: float) -> list[float]:
    """Each step's time limit: the budget shared in proportion to the estimates (as planned; when the steps run,
    each takes its share of what the steps before it left, so that time one did not need goes to the next)."""
    total = sum(step.estimate_s for step in steps)
    return [budget * step.estimate_s / total for step in steps]


def command(step: Step, out: Path) -> list[str]:
    """The step's run; --force: the folder is this benchmark's, a rerun into it replaces its files."""
    return [sys.executable, str(REPO / "benchmarks" / "kfac_overhead.py"), *step.arguments, "--out",
            str(out / f"kfac_gpu_{step.name}"), "--force"]


def gather(out: Path, steps: list[Step], status: dict[str, str], meta: dict) -> None:
    """DIR/kfac_gpu.json: the plan, each step's status and whatever results its JSON holds so far."""
    report = dict(meta, steps=[])
    for step in steps:
        path = out / f"kfac_gpu_{step.name}.json"
        results = json.loads(path.read_text()) if path.is_file() else None
        report["steps"].append(dict(asdict(step), status=status[step.name], command=command(step, out),
                                    results=results))
    (out / "kfac_gpu.json").write_text(json.dumps(report, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/kfac_gpu.sh", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for the results (created; default: a new folder under runs/bench/)")
    parser.add_argument("--budget", type=real(0, low_open=True), default=280.0,
                        help="seconds for the whole benchmark (default 280)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, check it fits --budget, run nothing")
    parser.add_argument("--kfac-pytorch", type=Path, default=None,
                        help="kfac-pytorch's local copy (default: .kfac-pytorch if present; 'none' leaves it out)")
    outputs.add_arguments(parser)
    args = parser.parse_args(argv)
    kfac_pytorch = args.kfac_pytorch
    if kfac_pytorch is None and (REPO / ".kfac-pytorch").is_dir():
        kfac_pytorch = REPO / ".kfac-pytorch"
    if kfac_pytorch is not None and str(kfac_pytorch) == "none":
        kfac_pytorch = None
    if kfac_pytorch is not None:
        sys.path.insert(0, str(REPO / "benchmarks"))
        from kfac_pytorch_adapter import package_dir

        try:
            package_dir(kfac_pytorch)
        except ValueError as error:
            parser.error(f"--kfac-pytorch: {error}")
    steps = plan(kfac_pytorch)
    total = sum(step.estimate_s for step in steps)
    shown = args.out or Path("DIR")
    for step, limit in zip(steps, limits(steps, args.budget), strict=True):
        print(f"[kfac_gpu] {step.name}: about {step.estimate_s:.0f} s, limit {limit:.0f} s: "
              f"{' '.join(command(step, shown))}")
    print(f"[kfac_gpu] about {total:.0f} s of {args.budget:.0f} s; kfac-pytorch: {kfac_pytorch or 'left out'}")
    if total > args.budget:
        print(f"[kfac_gpu] the plan needs about {total:.0f} s, more than --budget {args.budget:.0f}", file=sys.stderr)
        return 2
    if args.dry_run:
        return 0
    stem = outputs.results_stem(None if args.out is None else args.out / "kfac_gpu", "kfac_gpu", (".json",),
                                refresh_results=args.refresh_results, force=True, flag="--out")
    args.out = stem.parent  # its own folder: a rerun into it replaces its files
    status = {step.name: "pending" for step in steps}
    meta = dict(kind="kfac_gpu", budget_s=args.budget, kfac_pytorch=str(kfac_pytorch) if kfac_pytorch else None,
                started=time.strftime("%Y-%m-%dT%H:%M:%S"))
    gather(args.out, steps, status, meta)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    failed = False
    began = time.monotonic()
    for index, step in enumerate(steps):
        start = time.monotonic()
        limit = limits(steps[index:], args.budget - (start - began))[0]
        try:
            code = subprocess.call(command(step, args.out), env=env, timeout=limit)
            status[step.name] = "done" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            status[step.name] = f"cut at its limit of {limit:.0f} s (what it measured is kept)"
        failed |= status[step.name] != "done"
        print(f"[kfac_gpu] {step.name}: {status[step.name]} after {time.monotonic() - start:.0f} s", flush=True)
        gather(args.out, steps, status, meta)
    print(f"[kfac_gpu] wrote {args.out / 'kfac_gpu.json'}")
    return 1 if failed else 0


# ---- the figures the documents quote (benchmarks/figures.py) -------------------------------------------

def _step(name: str, precision: str) -> dict:
    """One gathered run's step named ``precision`` (a plan() step: 'fp32', 'amp', ...): its plan, status and
    results (None if none); an empty step where the run's plan had no such step."""
    from figures import results

    return next((s for s in results(name)["steps"] if s["name"] == precision), dict(results=None))


def _rows(name: str, precision: str) -> list[dict]:
    """One gathered run's measurements at ``precision`` (those a step cut short had finished included)."""
    step = _step(name, precision)
    return step["results"]["results"] if step["results"] else []


def _label(name: str, precision: str) -> str:
    """A table row's precision, as the step ran it."""
    labels = {"fp32": "fp32 (TF32)", "fp32_bf16_statistics": "fp32 (TF32), K-FAC statistics in bf16"}
    return labels.get(precision) or _amp_label(name)


def _at(name: str, precision: str, factors: int, inverse: int) -> dict | None:
    wanted = (factors, inverse)
    return next((r for r in _rows(name, precision) if (r["factor_update_freq"], r["inv_update_freq"]) == wanted), None)


def _table() -> str:
    from figures import results, table, times

    device = results("kfac_gpu")["steps"][0]["results"]["device_name"]
    rows = []
    for precision in ("fp32", "amp", "fp32_bf16_statistics"):
        for factors, inverse in CONFIGS:
            r = _at("kfac_gpu", precision, factors, inverse)
            if r is None:
                continue
            before = _at("kfac_gpu_before", precision, factors, inverse)
            memory = (f"{r['peak_gib']:.2f} / {r['kfac_pytorch_measured_peak_gib']:.2f}" if r.get("peak_gib") else "—")
            theirs = r.get("kfac_pytorch_measured_ratio")
            rows.append((f"{_label('kfac_gpu', precision)}, ({factors}, {inverse})",
                         f"{r['sgd_ms']:.1f}", f"{r['kfac_ms']:.1f}", times(r["ratio"]),
                         times(theirs) if theirs else "—", times(before["ratio"]) if before else "—",
                         f"≤ {TARGET[(factors, inverse)]}×", memory))
    rounds = results("kfac_gpu")["steps"][0]["results"]["rounds"]
    return (f"\nOn one {device}, ResNet-50, batch 64, 224x224, newton, each ratio the median of {rounds} rounds "
            "with the contenders alternating step by step:\n"
            + table(["precision, (factor, inverse)", "SGD ms", "K-FAC ms", "K-FAC / SGD", "kfac-pytorch / SGD",
                     "kfac/ of 72c19af / SGD (its own run)", "target", "peak GiB, ours / kfac-pytorch's"], rows))


def _amp_label(name: str) -> str:
    """The autocast a gathered run's 'amp' step used: its recorded dtype, else float16 with the GradScaler
    (kfac_overhead.py's only choice before it recorded one)."""
    dtype = (_step(name, "amp")["results"] or {}).get("amp_dtype", "fp16")
    return "autocast bf16" if dtype == "bf16" else "autocast fp16 + GradScaler"


def _headline() -> str:
    from figures import times

    one, two = _at("kfac_gpu", "fp32", 1, 10), _at("kfac_gpu", "fp32", 10, 100)
    assert one is not None and two is not None
    return (f"{times(one['ratio'])} / {times(two['ratio'])} at (1, 10) / (10, 100) on one H200 (ResNet-50, batch 64; "
            f"kfac-pytorch {times(one['kfac_pytorch_measured_ratio'])} / "
            f"{times(two['kfac_pytorch_measured_ratio'])} in the same run; peak {one['peak_gib']:.2f} GiB against its "
            f"{one['kfac_pytorch_measured_peak_gib']:.2f})")


def _phases() -> str:
    r = _at("kfac_gpu", "fp32", 1, 10)
    assert r is not None
    phases = ", ".join(f"{k} {v:.1f}" for k, v in r["phase_ms_per_step"].items() if v)
    unattributed = 100 * r["unattributed_share"]
    return (f"{r['extra_ms_per_step']:.1f} ms a step over SGD's: {phases} ms (unattributed {unattributed:.0f} %; "
            f"phases from {r['phases_from']})")


def _conv_methods() -> str:
    from figures import results

    r = results("kfac_conv_methods_cuda")
    ieee, tf32 = (r["totals_ms"][p] for p in ("ieee", "tf32"))
    error = max(row["relative_error"] for row in r["rows"] if row["precision"] == "tf32")
    return (f"{ieee['fastest per layer']:.1f} ms in IEEE float32 and {tf32['fastest per layer']:.1f} ms in TF32 for "
            f"all {len(r['rows']) // 2} conv layers (each by its fastest method; the CPU's fixed rule "
            f"{tf32['fixed rule']:.1f} ms, the unfolded patches' Gram alone {tf32['unfold']:.1f} ms), TF32 within "
            f"{error:.0e} of float64")


def _floor() -> str:
    """What the A statistics alone cost at (1, 10), against the target: a floor under K-FAC's step there."""
    from figures import results, times

    tf32 = results("kfac_conv_methods_cuda")["totals_ms"]["tf32"]["fastest per layer"]
    r = _at("kfac_gpu", "fp32", 1, 10)
    assert r is not None
    return (f"the conv layers' A statistics alone, each by its fastest method in TF32, take {tf32:.1f} ms, "
            f"{times(tf32 / r['sgd_ms'])} SGD's {r['sgd_ms']:.1f} ms step: computed every step, they put K-FAC at "
            f"{times(1 + tf32 / r['sgd_ms'])} SGD's step at least, before G's statistics, the factors, the "
            f"decompositions and the preconditioning")


def _eigen() -> str:
    from figures import results, times

    eigen = results("kfac_overhead_eigen_cuda")["results"][0]
    newton = _at("kfac_gpu", "fp32", 1, 10)
    assert newton is not None
    return (f"eigen {times(eigen['ratio'])} SGD's step at (1, 10), its decompositions "
            f"{eigen['phase_ms_per_step']['decompositions']:.0f} ms a step against newton's "
            f"{newton['phase_ms_per_step']['decompositions']:.0f} ms")


TARGET = {(1, 10): 2.0, (10, 100): 1.15}
FIGURES = {"kfac_gpu.table": _table, "kfac_gpu.headline": _headline, "kfac_gpu.phases": _phases,
           "kfac_gpu.conv_methods": _conv_methods, "kfac_gpu.eigen": _eigen, "kfac_gpu.floor": _floor}


if __name__ == "__main__":
    sys.exit(main())
