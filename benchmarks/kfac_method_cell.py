"""The large-batch cell (MNIST, batch 4096, ``--kfac-preset large-batch``) with each K-FAC method, interleaved.

    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/kfac_method_cell.py --seeds 0 1 2 --refresh-results
    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/kfac_method_cell.py --dry-run   # the commands only

kfac_large_batch.py's ``--target-cell`` run of hpcdl's K-FAC (its tuned rate and warm-up, one rank, one thread,
one run at a time), once per ``--kfac-methods`` entry (``--kfac-method`` added to the preset's flags), seed by
seed and method by method within a seed, so that a change in the shared machine's load falls on every method
alike. Results: ``<out>.json`` (kfac_large_batch's format, the methods named ``kfac-<method>``) and the
markdown table on stdout: steps and training seconds to 98.5 % and 99 %, final accuracy, seconds a step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import kfac_large_batch as study
import studies

from hpcdl.persistence import outputs
from hpcdl.runtime.errors import UsageError, run_main

TUNING = "kfac_large_batch_tune.json"  # the committed tuning study: hpcdl K-FAC's rate and warm-up at batch 4096


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--kfac-methods", nargs="+", choices=("eigen", "inverse", "newton"),
                        default=["eigen", "newton", "inverse"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--data-dir", default=None, help="MNIST's IDX files (default: hpcdl.fetch_mnist's)")
    parser.add_argument("--out", type=Path, default=None,
                        help="results stem (default: runs/bench/; benchmarks/results with --refresh-results)")
    parser.add_argument("--dry-run", action="store_true", help="print the runs' commands and exit")
    outputs.add_arguments(parser)
    own = parser.parse_args(argv)
    results = outputs.checkout_results()
    if results is None:
        raise UsageError(f"no benchmarks/results here to read {TUNING} from: run from a source checkout")
    out = None if own.dry_run else outputs.results_stem(
        own.out, "kfac_methods_1host", (".json",), refresh_results=own.refresh_results, force=own.force, flag="--out")
    flags = ["--target-cell", "--tuned-from", str(results / TUNING), "--methods", "kfac", "--jobs", "1",
             "--threads", "1"]
    args = study.parse_args(flags + (["--data-dir", own.data_dir] if own.data_dir else []))
    tuning = study.load_outcomes(args.tuned_from)
    (tuned,) = [c for c in study.tuned_settings(tuning, study.tuning_seed(tuning, args.tuned_from))
                if c.method == "kfac"]
    plan = [(seed, method) for seed in own.seeds for method in own.kfac_methods]

    def cell_args(method: str) -> argparse.Namespace:
        return argparse.Namespace(**{**vars(args), "kfac_flags": f"--kfac-method {method}"})

    cells = {seed: study.Cell("kfac", 4096, tuned.lr, seed, tuned.warmup) for seed in own.seeds}
    if own.dry_run:
        for seed, method in plan:
            print(" ".join(study.train_command(cells[seed], cell_args(method), Path("/tmp") / method)))
        return 0
    assert out is not None
    for seed, method in plan:
        studies.check_flags(study.train_flags(cells[seed], cell_args(method)))
    meta = dict(load_before=os.getloadavg()[0], argv=sys.argv[1:] if argv is None else argv,
                kfac_preset=study.RECORDED_PRESET, epochs=args.epochs, jobs=1, threads=1, ranks=1, planned=len(plan),
                lr=tuned.lr, warmup=tuned.warmup)
    start = time.perf_counter()
    outcomes: list[study.Outcome] = []
    with studies.session("kfac_method_cell") as scratch:
        for seed, method in plan:
            (outcome,) = study.run_cells([cells[seed]], cell_args(method), scratch / method)
            outcomes.append(replace(outcome, cell=replace(outcome.cell, method=f"kfac-{method}")))
            study.write_results(outcomes, out, meta)
    meta.update(load_after=os.getloadavg()[0], seconds=time.perf_counter() - start)
    study.write_results(outcomes, out, meta)
    print("\n".join(study.markdown(outcomes)))
    return 0 if all(o.returncode == 0 for o in outcomes) else 1


if __name__ == "__main__":
    run_main(main, program="kfac_method_cell")
