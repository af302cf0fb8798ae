"""Time of one factor's decomposition by K-FAC's methods, size by size, side by side in one process.

    PYTHONPATH=. python benchmarks/kfac_decomposition_time.py                       # CPU, 1 thread, 64..2048
    PYTHONPATH=. python benchmarks/kfac_decomposition_time.py --device cuda --batch 4 --out /tmp/gpu
    PYTHONPATH=. python benchmarks/kfac_decomposition_time.py --dry-run             # small sizes, one repeat

Imports only torch and kfac (no setup on a GPU machine). For each size n a factor like K-FAC's: the running
average F = ξ F_prev + (1 − ξ) F_batch (ξ = 0.95) of rank-deficient batch moments with a decaying spectrum, and
γ such that cond(F + γI) is about ``--condition`` (the real factors of tests/kfac/test_kfac_newton.py measure
50 to 3,000 at the large-batch preset's damping). Timed, interleaved round by round, median of ``--repeats``:

- eigen: ``torch.linalg.eigh`` in float32 (what 'eigen' does on the factor's device);
- cholesky: ``kfac.solve.damped_inverse`` (what 'inverse' does);
- newton cold: Newton–Schulz from X₀ = αI; newton warm: from the exact inverse of F_prev (what 'newton' does
  from the second decomposition on); on CUDA also both with ``tf32`` (TF32 products, float32 polish).

Results go to ``<out>.json`` (default under runs/bench/, benchmarks/results only with ``--refresh-results``).
``--batch b`` decomposes b factors of the size at once (eigen: one batched eigh; newton: one stack), as the
preconditioner does for layers of one size. Each row also gives the steps Newton–Schulz took and its relative
error against float64 ``eigh``. Prints a table of milliseconds and ratios to eigen.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpcdl.persistence import outputs  # noqa: E402
from hpcdl.runtime.errors import run_main  # noqa: E402
from hpcdl.runtime.numbers import integer, real  # noqa: E402
from kfac import newton, solve  # noqa: E402

DECAY = 0.95


def factor_pair(n: int, condition: float, seed: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, ...]:
    """(F_prev, F, γ as a 0-dim tensor): running averages of moments of n/4 rows with a log-spaced spectrum."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(0, -4, n, dtype=torch.float64)

    def moment() -> torch.Tensor:
        rows = torch.randn(max(n // 4, 2), n, generator=g, dtype=torch.float64) * scales
        return rows.T @ rows / rows.shape[0]

    previous = sum(moment() * DECAY**k for k in range(8)) * (1 - DECAY)
    current = DECAY * previous + (1 - DECAY) * moment()
    top = float(torch.linalg.eigvalsh(current)[-1])
    gamma = top / (condition - 1)
    return previous.to(dtype).to(device), current.to(dtype).to(device), torch.tensor(gamma)


def timed(fn: Callable[[], object], device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(n: int, args: argparse.Namespace) -> dict:
    pairs = [factor_pair(n, args.condition, seed, torch.float32, args.device) for seed in range(args.batch)]
    previous = [p for p, _, _ in pairs]
    factors = [f for _, f, _ in pairs]
    gammas = [float(gm) for _, _, gm in pairs]
    warm_from = [solve.damped_inverse(p, gm, torch.float64)[0].float() for p, gm in zip(previous, gammas, strict=True)]
    stack = torch.stack(factors)
    runs: dict[str, Callable[[], object]] = {
        "eigen": lambda: torch.linalg.eigh(stack),
        "cholesky": lambda: [solve.damped_inverse(f, gm, torch.float32) for f, gm in zip(factors, gammas, strict=True)],
        "newton cold": lambda: newton.newton_inverses(factors, gammas, [None] * len(factors), torch.float32),
        "newton warm": lambda: newton.newton_inverses(factors, gammas, warm_from, torch.float32),
    }
    if args.device == "cuda":
        runs["newton cold tf32"] = lambda: newton.newton_inverses(factors, gammas, [None] * len(factors),
                                                                  torch.float32, tf32=True)
        runs["newton warm tf32"] = lambda: newton.newton_inverses(factors, gammas, warm_from, torch.float32, tf32=True)
    for fn in runs.values():  # warm-up: kernels, workspaces
        fn()
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():  # interleaved: a load change hits every method alike
            seconds[name].append(timed(fn, args.device))
    row: dict = {"n": n, "batch": args.batch, "ms": {k: 1e3 * statistics.median(v) for k, v in seconds.items()}}
    exact = [solve.damped_inverse(f.double(), gm, torch.float64)[0] for f, gm in zip(factors, gammas, strict=True)]
    for name in [k for k in runs if k.startswith("newton")]:
        start = None if "cold" in name else warm_from
        outcomes = newton.newton_inverses(factors, gammas, [None] * len(factors) if start is None else start,
                                          torch.float32, tf32="tf32" in name)
        row.setdefault("steps", {})[name] = max(o.iterations for o in outcomes)
        row.setdefault("converged", {})[name] = all(o.inverse is not None for o in outcomes)
        row.setdefault("error", {})[name] = max(
            float((o.inverse.double() - e).norm() / e.norm()) if o.inverse is not None else float("nan")
            for o, e in zip(outcomes, exact, strict=True))
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=integer(2), nargs="+", default=[64, 128, 256, 512, 1024, 2048])
    parser.add_argument("--batch", type=integer(1), default=1, help="factors of each size decomposed together")
    parser.add_argument("--condition", type=real(1, low_open=True), default=300.0,
                        help="cond(F + γI) of the test factors")
    parser.add_argument("--repeats", type=integer(1), default=5)
    parser.add_argument("--threads", type=integer(1), default=1, help="torch intra-op threads (CPU)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, default=None,
                        help="write <out>.json (default: runs/bench/; benchmarks/results with --refresh-results)")
    outputs.add_arguments(parser)
    parser.add_argument("--dry-run", action="store_true", help="sizes 64 and 128, one repeat: a wiring check")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if args.dry_run:
        args.sizes, args.repeats = [64, 128], 1
    out = outputs.results_stem(args.out, f"kfac_decomposition_time_{args.device}", (".json",),
                               refresh_results=args.refresh_results, force=args.force, flag="--out")
    torch.set_num_threads(args.threads)
    names = None
    rows = []
    for n in args.sizes:
        row = measure(n, args)
        rows.append(row)
        if names is None:
            names = list(row["ms"])
            print("n      " + "  ".join(f"{k:>18s}" for k in names) + "   newton steps cold/warm")
        cells = [f"{row['ms'][k]:9.2f} ({row['ms'][k] / row['ms']['eigen']:5.2f}x)" for k in names]
        print(f"{n:<6d} " + "  ".join(cells) + f"   {row['steps']['newton cold']}/{row['steps']['newton warm']}",
              flush=True)
    meta = {"device": args.device, "threads": args.threads, "batch": args.batch, "condition": args.condition,
            "repeats": args.repeats, "torch": torch.__version__, "argv": sys.argv[1:] if argv is None else argv}
    if args.device == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
    outputs.output_file(out, ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"results: {outputs.output_file(out, '.json')}")
    return 0


if __name__ == "__main__":
    run_main(main, program="kfac_decomposition_time")
