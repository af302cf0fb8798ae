"""Where tools around training write their results, and whether they can run at all.

Benchmarks and plots follow the rules training follows: they never replace what they were not
asked to replace, and they refuse with one line where they cannot do their job.

* :func:`results_stem` decides where a tool writes ``<stem><suffix>`` files (each named by
  :func:`output_file`, never ``Path.with_suffix``, which cuts a stem such as ``sgd-lr0.05``), and
  :func:`results_folder` where one that writes a folder of files writes them. By default a new
  directory of its own, ``runs/bench/<name>/<YYYYmmdd-HHMMSS>-<suffix>/`` (never shared, as run
  directories are not). The figures committed in the repository (``benchmarks/results/``) are
  replaced only with ``--refresh-results``; any other existing file only with ``--force``. Every
  script that writes results decides its paths here and nowhere else
  (tests/benchmarks/test_output_rule.py runs each one to check).
* :func:`require_launcher` refuses a multi-rank benchmark started as one process (``python -m
  ...`` without ``mpirun``/``srun``), which would otherwise measure nothing and write a result
  that looks like one.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpcdl.persistence import rundir
from hpcdl.runtime import launcher
from hpcdl.runtime.errors import UsageError, rank0_then_all

BENCH_PARENT = Path("runs") / "bench"


def checkout_results() -> Path | None:
    """``benchmarks/results`` of the source checkout hpcdl runs from, or None for an installed package."""
    checkout = Path(__file__).resolve().parents[2]  # hpcdl/persistence/outputs.py lies two folders down
    results = checkout / "benchmarks" / "results"
    return results if results.is_dir() else None


def is_committed(path: Path) -> bool:
    """True for a path inside the ``benchmarks/results`` folder of any hpcdl checkout (not only this one)."""
    resolved = path.resolve()
    for folder in (resolved, *resolved.parents):
        if folder.name == "results" and folder.parent.name == "benchmarks" \
                and (folder.parent.parent / "hpcdl" / "__init__.py").is_file():
            return True
    return False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The two flags every result-writing tool takes (same names, same meaning everywhere)."""
    parser.add_argument("--refresh-results", action="store_true",
                        help="replace the results committed in benchmarks/results (default: write under runs/bench/)")
    parser.add_argument("--force", action="store_true", help="replace output files that already exist")


def output_file(stem: Path, suffix: str) -> Path:
    """``stem`` + ``suffix``: the one way every writer names its files, the checks and ``--keep``'s reading too
    (not ``with_suffix``, which cuts at the last dot: ``sgd-lr0.05`` and ``sgd-lr0.1`` would both be ``sgd-lr0``)."""
    return stem.with_name(stem.name + suffix)


def given_stem(path: Path | None, suffixes: Sequence[str]) -> Path | None:
    """The stem a user named on the command line: ``path`` whole, less one of the tool's own ``suffixes`` when it
    ends in one (``runs/a/sgd-lr0.05`` stays whole; ``runs/a/sgd-lr0.05.json`` is ``runs/a/sgd-lr0.05``)."""
    if path is None:
        return None
    for suffix in suffixes:
        if path.name.endswith(suffix) and len(path.name) > len(suffix):
            return path.with_name(path.name[: -len(suffix)])
    return path


def check_outputs(paths: Sequence[Path], *, force: bool = False, refresh_results: bool = False,
                  flag: str = "--output") -> None:
    """UsageError (one line) when writing ``paths`` would replace something it was not asked to."""
    for path in paths:
        if is_committed(path) and not refresh_results:
            raise UsageError(f"{path} is in benchmarks/results, the results committed in the repository; add "
                             f"--refresh-results to replace them, or choose another {flag}")
        if path.is_dir():
            raise UsageError(f"{path} is a directory; {flag} names the file to write")
        if path.exists() and not force and not (refresh_results and is_committed(path)):
            raise UsageError(f"{path} already exists; add --force to replace it, or choose another {flag}")


def results_stem(requested: Path | None, name: str, suffixes: Sequence[str], *, refresh_results: bool = False,
                 force: bool = False, flag: str = "--output", comm: Any = None) -> Path:
    """Where a tool writes ``<stem><suffix>`` for each of ``suffixes``: the stem, with its folder created.

    ``requested`` is the stem the user asked for (None: the default). Without it the results go
    to a new folder under ``runs/bench/<name>/``, or with ``--refresh-results`` to the checkout's
    ``benchmarks/results/<name>``. Collective when ``comm`` is given: rank 0 decides, every rank
    gets the same stem or the same UsageError.
    """
    return Path(rank0_then_all(lambda: str(_decide(requested, name, suffixes, refresh_results, force, flag)), comm))


def _decide(requested: Path | None, name: str, suffixes: Sequence[str], refresh_results: bool, force: bool,
            flag: str) -> Path:
    if requested is None:
        if refresh_results:
            committed = checkout_results()
            if committed is None:
                raise UsageError("--refresh-results replaces the results of a source checkout, and hpcdl runs from an "
                                 f"installed package; name the output with {flag}")
            stem = committed / name
        else:
            return rundir.default_directory(BENCH_PARENT / name) / name  # new, so nothing to replace
    else:
        stem = requested
        if refresh_results and not is_committed(stem):
            raise UsageError(f"--refresh-results replaces results in benchmarks/results, but {flag} names {stem}; "
                             "use one or the other")
    check_outputs([output_file(stem, suffix) for suffix in suffixes], force=force,
                  refresh_results=refresh_results, flag=flag)
    try:
        stem.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create {stem.parent} for the results ({exc.strerror or exc})") from None
    if not os.access(stem.parent, os.W_OK):
        raise UsageError(f"cannot write results to {stem.parent} (permission denied)")
    return stem


def results_folder(requested: Path | None, name: str, *, refresh_results: bool = False,
                   flag: str = "--output-dir") -> Path:
    """The folder a tool writes its several result files into, created: ``requested``, else a new folder under
    ``runs/bench/<name>/``, or with ``--refresh-results`` the checkout's ``benchmarks/results``. A requested
    folder inside ``benchmarks/results`` needs ``--refresh-results`` (UsageError, one line)."""
    if requested is None:
        if not refresh_results:
            return rundir.default_directory(BENCH_PARENT / name)
        committed = checkout_results()
        if committed is None:
            raise UsageError("--refresh-results replaces the results of a source checkout, and hpcdl runs from an "
                             f"installed package; name the folder with {flag}")
        return committed
    if is_committed(requested) and not refresh_results:
        raise UsageError(f"{requested} is in benchmarks/results, the results committed in the repository; add "
                         f"--refresh-results to replace them, or choose another {flag}")
    if refresh_results and not is_committed(requested):
        raise UsageError(f"--refresh-results replaces results in benchmarks/results, but {flag} names {requested}; "
                         "use one or the other")
    if requested.exists() and not requested.is_dir():
        raise UsageError(f"{requested} is a file; {flag} names a folder")
    try:
        requested.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create {requested} for the results ({exc.strerror or exc})") from None
    return requested


def require_launcher(min_ranks: int, program: str, comm: Any = None) -> None:
    """UsageError on every rank when the job has fewer than ``min_ranks`` ranks (the same verdict everywhere)."""
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    size = comm.Get_size()
    if size >= min_ranks:
        return
    how = (f"mpirun -np {min_ranks} python -m {program} ... (or srun -n {min_ranks} --mpi=pmix ..., "
           f"ibrun on TACC systems)")
    if size == 1 and not launcher.launched():
        raise UsageError(f"{program} measures {min_ranks} or more ranks and was started as a single process, "
                         f"without a launcher; run: {how}")
    raise UsageError(f"{program} needs at least {min_ranks} ranks, this job has {size}; run: {how}")
