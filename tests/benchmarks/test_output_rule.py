"""Every program that writes results decides where through one rule (hpcdl.run.outputs), and so never
replaces the results committed in benchmarks/results without --refresh-results.

Each program under benchmarks/ and hpcdl/bench/ is run (tests/benchmarks/output_probe.py) up to the
point where it asks where its results go, with and without --refresh-results: it must ask the rule,
before measuring anything, and pass the flag through. A new program must be listed here (with the
argv of its cheapest run, or as writing no file), and a path built into benchmarks/results by hand
fails the source check, so a script that bypasses the rule cannot come in unnoticed.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hpcdl.run import outputs

pytestmark = pytest.mark.processes

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "benchmarks" / "results"
# program -> argv of its cheapest run (what it needs to reach its output decision), and the name it writes under
CASES: dict[str, tuple[list[str], str]] = {
    "benchmarks/train_throughput.py": ([], "train_throughput_cpu"),
    "benchmarks/loader_throughput.py": ([], "loader_throughput_cpu"),
    "benchmarks/network.py": ([], "network"),
    "benchmarks/deterministic_cost.py": ([], "deterministic_cost"),
    "benchmarks/kfac_overhead.py": ([], "kfac_overhead"),
    "benchmarks/kfac_convergence.py": ([], "kfac_convergence_digits"),
    "benchmarks/kfac_eigen_scaling.py": ([], "kfac_eigen_scaling"),
    "benchmarks/kfac_large_batch.py": (["--reduced", "--dataset", "digits", "--methods", "sgd"],
                                       "kfac_large_batch_reduced"),
    "benchmarks/kfac_traffic.py": (["predict"], "kfac_traffic_predict"),
    "benchmarks/transformer_lm.py": ([], "transformer_lm"),
    "hpcdl/bench/allreduce.py": ([], "allreduce_np1"),
}
# A second way into a program that writes elsewhere than its main path does.
EXTRA = [("benchmarks/kfac_large_batch.py", ["--report", str(COMMITTED / "kfac_large_batch_target.json")],
          "kfac_large_batch")]
NO_RESULTS = {
    "hpcdl/bench/probe.py": "prints one JSON line and writes no file",
    # reads the committed results to write the figures marked in README, docs and the studies' notes (its job;
    # --check changes nothing): no measurement of its own to write
    "benchmarks/figures.py": "writes documents from the committed results, not results",
}


def programs() -> list[str]:
    """Every runnable program (``if __name__ == "__main__"``) under benchmarks/ and hpcdl/bench/."""
    found = [*sorted((REPO / "benchmarks").glob("*.py")), *sorted((REPO / "hpcdl" / "bench").glob("*.py"))]
    return [str(p.relative_to(REPO)) for p in found if '__name__ == "__main__"' in p.read_text()]


def invocation(program: str) -> str:
    return f"-m {program[:-3].replace('/', '.')}" if program.startswith("hpcdl/") else str(REPO / program)


def snapshot() -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in COMMITTED.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def probed(tmp_path_factory) -> dict[tuple[str, str, bool], dict[str, Any]]:
    """What each program asked the rule, by (program, first argument, --refresh-results given)."""
    tmp = tmp_path_factory.mktemp("probe")
    runs = [(program, argv, name) for program, (argv, name) in CASES.items()] + EXTRA
    cases = [{"program": invocation(program), "argv": [*argv, *refresh],
              "key": [program, " ".join(argv), bool(refresh)]}
             for program, argv, _ in runs for refresh in ([], ["--refresh-results"])]
    (tmp / "cases.json").write_text(json.dumps(cases))
    before = snapshot()
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("output_probe.py")), str(tmp / "cases.json"),
                           str(tmp / "report.json")], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert snapshot() == before, "a program changed benchmarks/results while only deciding where to write"
    return {tuple(row["key"]): row for row in json.loads((tmp / "report.json").read_text())}  # type: ignore[misc]


def test_every_program_is_listed() -> None:
    unlisted = sorted(set(programs()) - set(CASES) - set(NO_RESULTS))
    assert not unlisted, f"list these in CASES (argv reaching the output decision) or NO_RESULTS: {unlisted}"
    assert set(CASES) | set(NO_RESULTS) <= set(programs())  # nothing listed that is gone


@pytest.mark.parametrize(("program", "argv", "name"), [(p, a, n) for p, (a, n) in CASES.items()] + EXTRA,
                         ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_each_program_asks_the_one_rule_and_passes_refresh_results(probed, program: str, argv: list[str],
                                                                   name: str) -> None:
    for refresh in (False, True):
        row = probed[(program, " ".join(argv), refresh)]
        assert row["decided"], f"{program} {argv} ended without asking hpcdl.run.outputs: {row.get('ending')}"
        assert row["requested"] is None and row["name"] == name, row
        assert row["refresh_results"] is refresh, row


def test_no_program_builds_a_path_into_benchmarks_results_itself() -> None:
    """``REPO / "benchmarks" / "results"`` or ``Path(".../benchmarks/results")`` in a program bypasses the rule."""
    offenders = []
    for program in sorted(set(programs()) - set(NO_RESULTS)):
        for node in ast.walk(ast.parse((REPO / program).read_text())):
            joined = (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)
                      and isinstance(node.right, ast.Constant) and node.right.value == "results")
            literal = (isinstance(node, ast.Call) and any(
                isinstance(arg, ast.Constant) and isinstance(arg.value, str) and "benchmarks/results" in arg.value
                for arg in node.args))
            if joined or literal:
                offenders.append(f"{program}:{node.lineno}")
    assert not offenders, offenders


def test_the_rule_writes_elsewhere_by_default_and_into_benchmarks_results_only_when_asked(tmp_path: Path,
                                                                                          monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    stem = outputs.results_stem(None, "thing", (".json",))
    assert stem.resolve().is_relative_to(tmp_path / "runs" / "bench" / "thing") and not outputs.is_committed(stem)
    folder = outputs.results_folder(None, "thing")
    assert folder.resolve().is_relative_to(tmp_path / "runs" / "bench" / "thing") and folder.is_dir()
    assert outputs.results_folder(None, "thing", refresh_results=True) == COMMITTED
    with pytest.raises(outputs.UsageError, match="add --refresh-results"):
        outputs.results_folder(COMMITTED, "thing")
    with pytest.raises(outputs.UsageError, match="use one or the other"):
        outputs.results_folder(tmp_path / "mine", "thing", refresh_results=True)
    with pytest.raises(outputs.UsageError, match="add --refresh-results"):
        outputs.results_stem(COMMITTED / "kfac_large_batch_target", "thing", (".json",))
    assert outputs.results_folder(tmp_path / "mine", "thing") == tmp_path / "mine"
