"""K-FAC's overhead on one GPU, beside SGD and kfac-pytorch, in one command and under five minutes, with no setup.

    bash benchmarks/kfac_gpu.sh --out DIR --budget SECONDS [--dry-run] [--kfac-pytorch PATH]

Runs from the GPU machine's own Python with ``PYTHONPATH=.`` (kfac/ imports only torch; the benchmark needs
torch, torchvision, numpy, tqdm and matplotlib, which such images carry): ResNet-50, batch 64, 224x224, SGD against
K-FAC with its GPU method (``newton``: Newton–Schulz inverses from matrix products; eigen's H200 figures are
issue 44's) at (factor, inverse) update frequencies (1, 10) and (10, 100), in fp32 (TF32 on) and with ``--amp``, each
step by benchmarks/kfac_overhead.py (contenders alternating step by step, phases with a synchronised round), peak
memory in fresh processes (fp32). kfac-pytorch comes from a local copy (``--kfac-pytorch``, default
``.kfac-pytorch`` when present: a folder holding its ``kfac`` package, e.g. ``git archive`` of its checkout; no
install and no dist-info needed, benchmarks/kfac_pytorch_adapter.py).

Each step has its own time limit, a share of ``--budget`` in proportion to its estimate (from issue 44's H200
figures); a step writes its results as it goes (DIR/kfac_gpu_<step>.json after every frequency), and DIR/kfac_gpu.json
gathers them after every step, so a limit that cuts a step short keeps what it measured. ``--dry-run`` prints the
plan with its estimate and exits non-zero when the estimate does not fit the budget.
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
ROUNDS = 2
# ms per step on one H200, ResNet-50 batch 64 (issue 44: fp32 without TF32; TF32 and AMP are faster, so these
# over-estimate): SGD, hpcdl's K-FAC and kfac-pytorch at each frequency.
STEP_MS = {"sgd": 33.0, (1, 10): (243.0, 254.0), (10, 100): (62.5, 72.6)}
PROCESS_S = 20.0  # a fresh process: CUDA's start, cuDNN's autotuning of the first steps
WARMUP_STEPS = 3  # per contender and frequency, beside 3 SGD steps once


@dataclass(frozen=True)
class Step:
    """One kfac_overhead.py run: its name (DIR/<name>.json), arguments and estimated seconds."""

    name: str
    arguments: tuple[str, ...]
    estimate_s: float


def timing_seconds(with_kfac_pytorch: bool) -> float:
    """The estimated seconds of one precision's timing rounds (all frequencies), its synchronised rounds included."""
    total = PROCESS_S + WARMUP_STEPS * STEP_MS["sgd"] / 1e3
    for factors, inverse in CONFIGS:
        period = inverse  # lcm(factors, inverse) for these pairs
        ours, theirs = STEP_MS[(factors, inverse)]
        contenders = STEP_MS["sgd"] + ours + (theirs if with_kfac_pytorch else 0.0)
        total += WARMUP_STEPS * (ours + theirs) / 1e3 + (ROUNDS * contenders + STEP_MS["sgd"] + ours) * period / 1e3
    return total


def memory_seconds(with_kfac_pytorch: bool) -> float:
    """SGD's and every frequency's peak memory, each in a fresh process of at most 12 steps."""
    processes = 1 + len(CONFIGS) * (2 if with_kfac_pytorch else 1)
    return processes * (PROCESS_S + 12 * STEP_MS[(1, 10)][1] / 1e3)


def plan(kfac_pytorch: Path | None) -> list[Step]:
    both = kfac_pytorch is not None
    # newton: the method for GPUs (matrix products only); eigen's H200 figures are issue 44's (243 ms at (1, 10))
    common = ["--device", "cuda", "--configs", " ".join(f"{f},{i}" for f, i in CONFIGS), "--rounds", str(ROUNDS),
              "--kfac-method", "newton"]
    if both:
        common += ["--kfac-pytorch", str(kfac_pytorch)]
    return [Step("fp32", (*common, "--precisions", "fp32"), timing_seconds(both) + memory_seconds(both)),
            Step("amp", (*common, "--precisions", "amp", "--no-memory"), timing_seconds(both))]


def limits(steps: list[Step], budget: float) -> list[float]:
    """Each step's time limit: the budget shared in proportion to the estimates."""
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
    for step, limit in zip(steps, limits(steps, args.budget), strict=True):
        start = time.monotonic()
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


if __name__ == "__main__":
    sys.exit(main())
