"""What every accuracy study does the same way, written once: run ``python -m hpcdl.train`` (the one
training application, so a study measures what users run), read its metrics back, alternate the
contenders so that a shared machine's load hits both alike, and find when a target was first reached.

A study runs inside :func:`session`: its scratch folder is removed and every run under way is ended
(with everything it started) on any exit, and Ctrl-C or SIGTERM become :class:`StudyStopped`, which the
study answers by saving what ran and saying so in one line. Runs of more than one rank go through
``launch/mpirun.sh`` (root, oversubscription, virtual clusters: the launcher's rules, not a bare
``mpirun``), whose arguments :func:`check_launch` tries before the first run. ``--keep`` keeps a recorded
run only when :func:`differing_settings` finds nothing between its command and the one the study would
run now.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

from hpcdl.persistence import outputs
from hpcdl.persistence.outputs import output_file
from hpcdl.runtime.errors import UsageError
from hpcdl.runtime.numbers import real
from hpcdl.runtime.processes import end_trees
from hpcdl.training.config import TrainConfig, option_name, parse_config

REPO = Path(__file__).resolve().parents[1]
T = TypeVar("T")


@dataclass
class TrainRun:
    """One ``hpcdl.train`` process: its command, exit status, metrics rows and summary."""

    command: list[str]
    returncode: int
    rows: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl, one per evaluation
    summary: dict[str, Any] | None = None  # summary.json (None when the run did not finish)
    wall_seconds: float = 0.0
    log_tail: str = ""  # the last lines of its output, when it failed


def check_flags(flags: Sequence[str]) -> TrainConfig:
    """hpcdl.train's own parser on a study's flags: a bad one is a one-line UsageError before any run."""
    return parse_config(list(flags))


def train_command(flags: Sequence[str], ranks: int = 1, vcluster: str | None = None, threads: int = 1) -> list[str]:
    """``python -m hpcdl.train FLAGS``; for more than one rank (or on the nodes of a virtual cluster) through
    launch/mpirun.sh, which knows what a bare ``mpirun`` does not (root, more ranks than cores, the cluster)."""
    if vcluster is None and ranks == 1:
        return [sys.executable, "-m", "hpcdl.train", *flags]
    where = ["--vcluster", vcluster] if vcluster is not None else []
    return ["bash", str(REPO / "launch" / "mpirun.sh"), *where, "-np", str(ranks), "--threads", str(threads), "--",
            *flags]


def check_launch(ranks: int = 1, vcluster: str | None = None, threads: int = 1) -> None:
    """UsageError (the launcher's own line) when launch/mpirun.sh would refuse these settings, e.g. a virtual
    cluster that does not exist: asked once before the first run, not found by each run in turn."""
    command = train_command([], ranks, vcluster, threads)
    if command[0] != "bash":
        return
    done = subprocess.run(command, env=dict(os.environ, HPCDL_DRY_RUN="1"), capture_output=True, text=True,
                          timeout=120, check=False)
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        why = next((line for line in lines if "error" in line.lower()), lines[-1] if lines else "")
        raise UsageError(f"launch/mpirun.sh refuses {' '.join(command[2:-1])}: {why.removeprefix('error: ')}")


def link_rate(vcluster: str | None) -> str | None:
    """The rate a virtual cluster's links are shaped to ('1gbit'), for a study's meta; None on one host or unshaped
    (a cluster brought up without ``--rate``: its links then run at the veth's memory speed)."""
    if vcluster is None:
        return None
    from hpcdl.tools import vcluster as clusters

    cluster = clusters.load(vcluster)
    return cluster.rate if cluster is not None else None


@dataclass
class StartedRun:
    """An ``hpcdl.train`` process under way: what :func:`finish_train` needs to collect it."""

    command: list[str]
    output_dir: Path
    proc: subprocess.Popen[bytes]
    start: float

    @property
    def log(self) -> Path:
        return output_file(self.output_dir, ".log")  # the one rule: names hold dots (lr0.4)


def start_train(flags: Sequence[str], output_dir: Path, *, ranks: int = 1, threads: int = 1,
                env: dict[str, str] | None = None, python_path: Sequence[str] = (),
                vcluster: str | None = None) -> StartedRun:
    """Start hpcdl.train into ``output_dir``, its log to ``output_dir``.log; ``python_path`` goes before the
    repository on PYTHONPATH (a plugin's package that must shadow one of ours, e.g. kfac-pytorch's ``kfac``)."""
    command = train_command([*flags, "--output-dir", str(output_dir), "--no-progress"], ranks, vcluster, threads)
    run_env = dict(os.environ, OMP_NUM_THREADS=str(threads), **(env or {}))
    run_env["PYTHONPATH"] = os.pathsep.join(filter(None, [*python_path, str(REPO), run_env.get("PYTHONPATH", "")]))
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    log = output_file(output_dir, ".log")
    # The run's parent folder as working directory: `python -m` puts it first on sys.path, never the
    # caller's. The log is a file, never a pipe nobody reads.
    # A session of its own: a Ctrl-C at the terminal reaches the study, which ends its runs itself (end_runs).
    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=output_dir.parent, env=run_env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    _RUNNING[proc.pid] = proc
    return StartedRun(command, output_dir, proc, time.perf_counter())


def finish_train(started: StartedRun, timeout: float) -> TrainRun:
    """Wait for the run (killed ``timeout`` seconds after its start) and read back what it wrote."""
    killed = ""
    try:
        returncode = started.proc.wait(timeout=max(timeout - (time.perf_counter() - started.start), 1.0))
    except subprocess.TimeoutExpired:
        end_trees([started.proc.pid])  # mpirun's ranks too
        started.proc.wait()
        returncode, killed = -9, f"(killed after {timeout:.0f} s)"
    _RUNNING.pop(started.proc.pid, None)  # ended: a signal that cut the wait short leaves it for end_runs
    run = TrainRun(started.command, returncode, wall_seconds=time.perf_counter() - started.start)
    metrics, summary = started.output_dir / "metrics.jsonl", started.output_dir / "summary.json"
    if metrics.exists():
        run.rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    if summary.exists():
        run.summary = json.loads(summary.read_text())
    if returncode != 0:
        lines = started.log.read_text(errors="replace").strip().splitlines()[-3:]
        run.log_tail = "\n".join([*lines, killed] if killed else lines)
    return run


def run_train(flags: Sequence[str], output_dir: Path, *, timeout: float = 3600.0, required: str = "",
              **options: Any) -> TrainRun:
    """Run hpcdl.train into ``output_dir`` (:func:`start_train`'s ``options``) and read back what it wrote; its log
    goes to ``output_dir``.log. A ``required`` run (``required`` names it) is one the study cannot go on without:
    its failure ends the study in one line, with the run's last lines."""
    run = finish_train(start_train(flags, output_dir, **options), timeout)
    if required and (run.returncode != 0 or run.summary is None):
        why = run.log_tail or f"see {output_file(output_dir, '.log')}"
        raise UsageError(f"{required} failed (exit {run.returncode}): {why}")
    return run


def run_pool(starters: Sequence[Callable[[], StartedRun]], jobs: int, timeout: float) -> Iterator[tuple[int, TrainRun]]:
    """Run ``jobs`` at a time, yielding (index in ``starters``, its TrainRun) as each ends: a slow run never
    holds a free slot, and a caller can save after every run."""
    pending = list(enumerate(starters))
    running: list[tuple[int, StartedRun]] = []
    while pending or running:
        while pending and len(running) < jobs:
            index, starter = pending.pop(0)
            running.append((index, starter()))
        while True:
            ended = next((n for n, (_, r) in enumerate(running)
                          if r.proc.poll() is not None or time.perf_counter() - r.start > timeout), None)
            if ended is not None:
                break
            time.sleep(0.5)
        index, started = running.pop(ended)
        yield index, finish_train(started, timeout)


# The runs under way (by pid), so that a study that ends for any reason ends them too.
_RUNNING: dict[int, subprocess.Popen[bytes]] = {}


def end_runs() -> None:
    """End every run under way, with all it started (mpirun's ranks included)."""
    running = [proc for proc in _RUNNING.values() if proc.poll() is None]
    end_trees([proc.pid for proc in running])
    for proc in running:
        proc.wait()
    _RUNNING.clear()


class StudyStopped(Exception):
    """Ctrl-C or SIGTERM ended the study: it saves what ran and says so in one line."""

    def __init__(self, sig: signal.Signals) -> None:
        super().__init__(f"stopped by {sig.name}")
        self.signal = sig

    @property
    def exit_code(self) -> int:
        """128 + the signal's number, the shell's convention (130 after Ctrl-C, 143 after SIGTERM)."""
        return 128 + int(self.signal)


def _stop(signum: int, frame: FrameType | None) -> None:
    raise StudyStopped(signal.Signals(signum))


@contextlib.contextmanager
def session(program: str) -> Iterator[Path]:
    """A study's scratch folder; inside, Ctrl-C and SIGTERM raise :class:`StudyStopped`. On any exit (an error,
    a signal, the end) every run under way is ended and the scratch folder removed."""
    scratch = Path(tempfile.mkdtemp(prefix=f"{program}-"))
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield scratch
    finally:
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)  # the clean-up itself is not cut short
        try:
            end_runs()
            shutil.rmtree(scratch, ignore_errors=True)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


# ---- what a recorded run was made with ---------------------------------------------------------------

# Words of hpcdl.train's command that name where a run writes, not what it trains.
_PLACE_FLAGS = {"--output-dir": 1, "--no-progress": 0}
# What may differ without changing what is trained or measured: where it writes and how it keeps it, the progress
# bar, the stall watchdog's patience.
_PLACE_FIELDS = {"output_dir", "progress", "resume", "keep_checkpoints", "stall_timeout"}


def add_results_arguments(parser: argparse.ArgumentParser, stem: str, run_timeout: float) -> None:
    """The options every accuracy study takes alike: how long one run may take, where the results go (``--out``,
    hpcdl.persistence.outputs' --refresh-results and --force) and ``--keep`` (see :func:`parse_study_args`)."""
    parser.add_argument("--run-timeout", type=real(0, low_open=True), default=run_timeout,
                        help="seconds before a run is killed")
    parser.add_argument("--out", type=Path, default=None,
                        help="results stem: STEM.json/.png (default: a new folder under runs/bench/; "
                             f"--refresh-results replaces benchmarks/results/{stem}*)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the finished runs already in STEM.json whose command is the one this study would "
                             "run now (and add to them); a run made with other settings is refused, naming them")
    outputs.add_arguments(parser)


def parse_study_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser``'s arguments; ``--keep`` adds to named results, never to a new folder nobody will find."""
    args = parser.parse_args(argv)
    if args.keep and args.out is None and not args.refresh_results:
        parser.error("--keep adds to the results at --out: name them (or add --refresh-results for the committed ones)")
    return args


def refuse_changed(out: Path, name: str, recorded: str | Sequence[str], now: str | Sequence[str]) -> None:
    """``--keep``'s UsageError (one line) when run ``name`` kept in ``out``.json was made with other settings than
    the study would use now: a ``--max-steps 2`` trial is never kept as the real study's run."""
    if differing := differing_settings(recorded, now):
        raise UsageError(f"--keep: {output_file(out, '.json')} holds {name} run with other settings "
                         f"({'; '.join(differing)}); rerun it without --keep (with --force to replace the file), "
                         "or choose another --out")


def stopped(program: str, stop: StudyStopped, runs: int, out: Path | None) -> int:
    """Says in one line what a stopped study saved; its exit status."""
    where = f" in {output_file(out, '.json')}" if out is not None and runs else ""
    print(f"{program}: {stop}: {runs} finished run(s) saved{where}; the same command with --keep runs the rest",
          file=sys.stderr, flush=True)
    return stop.exit_code


def check_mnist(data_dir: Path | None) -> Path:
    """MNIST's folder (``data_dir``, or hpcdl.fetch_mnist's), read before any run: a missing or incomplete one is a
    one-line UsageError saying how to fetch it (hpcdl.data reads the files), never a failure of every run."""
    from hpcdl.data.mnist import load_mnist
    from hpcdl.tools.fetch_mnist import DEFAULT_OUTPUT

    data_dir = data_dir or DEFAULT_OUTPUT
    if not data_dir.is_dir():
        raise UsageError(f"MNIST not found in {data_dir} (no folder); fetch it with: "
                         f"python -m hpcdl.fetch_mnist --output {data_dir}")
    load_mnist(data_dir)
    return data_dir


def split_command(command: str | Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """A recorded run's command as (how it was launched: ranks, threads, vcluster; hpcdl.train's flags without
    those naming where it wrote). Understands ``python -m hpcdl.train``, ``mpirun -np N ... hpcdl.train`` and
    ``launch/mpirun.sh [--vcluster V] -np N --threads T -- ...``."""
    words = shlex.split(command) if isinstance(command, str) else list(command)
    if "hpcdl.train" in words:
        at = words.index("hpcdl.train")
        head, flags = words[:at], words[at + 1:]
    elif "--" in words:
        at = words.index("--")
        head, flags = words[:at], words[at + 1:]
    else:
        head, flags = words, []
    launch = {"ranks": "1", "threads": "", "vcluster": ""}  # threads: one rank's command does not say
    for flag, key in (("-np", "ranks"), ("--threads", "threads"), ("--vcluster", "vcluster")):
        if flag in head[:-1]:
            launch[key] = head[head.index(flag) + 1]
    kept, skip = [], 0
    for word in flags:
        if skip:
            skip -= 1
        elif word.split("=", 1)[0] in _PLACE_FLAGS:
            skip = _PLACE_FLAGS[word.split("=", 1)[0]] if "=" not in word else 0
        else:
            kept.append(word)
    return launch, kept


def differing_settings(recorded: str | Sequence[str], now: str | Sequence[str]) -> list[str]:
    """How a recorded run's command differs from the one a study would run now, one phrase per setting
    (``--max-steps 2, now none``); [] when both train the same (where they write aside). hpcdl.train's own parser
    reads both, so the same setting spelt two ways is the same."""
    (launch_then, flags_then), (launch_now, flags_now) = split_command(recorded), split_command(now)
    phrases = [f"{key} {launch_then[key] or 'none'}, now {launch_now[key] or 'none'}"
               for key in launch_then if launch_then[key] != launch_now[key]
               and (key != "threads" or (launch_then[key] and launch_now[key]))]
    try:
        then = dataclasses.asdict(parse_config(flags_then))
    except UsageError as exc:
        return [*phrases, f"its command no longer parses ({exc})"]
    current = dataclasses.asdict(parse_config(flags_now))
    for name in then:
        if name not in _PLACE_FIELDS and then[name] != current.get(name):
            phrases.append(f"{option_name(name)} {_shown(then[name])}, now {_shown(current.get(name))}")
    return phrases


def _shown(value: Any) -> str:
    return "none" if value is None else " ".join(map(str, value)) if isinstance(value, list | tuple) else str(value)


def interleaved(first: Sequence[T], second: Sequence[T], seeds: Sequence[int]) -> list[tuple[T, int]]:
    """The two kinds of contender alternating within each seed, the order reversed on every other seed.

    Neighbouring runs see nearly the same load from other jobs, so per-seed pairs stay fair even
    when the machine's load drifts during a study.
    """
    mixed: list[T] = []
    for i in range(max(len(first), len(second))):
        mixed += [*first[i:i + 1], *second[i:i + 1]]
    plan: list[tuple[T, int]] = []
    for n, seed in enumerate(seeds):
        plan += [(item, seed) for item in (mixed if n % 2 == 0 else mixed[::-1])]
    return plan


def first_reaching(points: Sequence[dict[str, float]], target: float, key: str = "accuracy") -> dict[str, float] | None:
    """The first point (in training order) whose ``key`` reaches ``target``; None if none does.

    A later dip below the target does not undo the first hit: a user stopping at the target would
    have stopped there.
    """
    return next((p for p in points if p[key] >= target), None)


def median_or_inf(values: Sequence[float | None]) -> float:
    """Median where a run that never reached the target counts as 'more than the budget' (inf)."""
    return statistics.median([math.inf if v is None else v for v in values])
