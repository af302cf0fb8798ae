"""Every program that writes results decides where through one rule (hpcdl.persistence.outputs), and so never
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

from hpcdl.persistence import outputs

pytestmark = pytest.mark.processes

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "benchmarks" / "results"
# program -> argv of its cheapest run (what it needs to reach its output decision), and the name it writes under
CASES: dict[str, tuple[list[str], str]] = {
    "benchmarks/train_throughput.py": ([], "train_throughput_cpu"),
    "benchmarks/loader_throughput.py": ([], "loader_throughput_cpu"),
    "benchmarks/network.py": ([], "network"),
    "benchmarks/deterministic_cost.py": ([], "deterministic_cost"),
    "benchmarks/cpu_layout.py": ([], "cpu_layout"),
    "benchmarks/kfac_overhead.py": ([], "kfac_overhead"),
    "benchmarks/kfac_convergence.py": ([], "kfac_convergence_digits"),
    "benchmarks/kfac_eigen_scaling.py": ([], "kfac_eigen_scaling"),
    "benchmarks/kfac_large_batch.py": (["--reduced", "--dataset", "digits", "--methods", "sgd"],
                                       "kfac_large_batch_reduced"),
    "benchmarks/kfac_traffic.py": (["predict"], "kfac_traffic_predict"),
    "benchmarks/kfac_phases.py": ([], "kfac_phases"),
    "benchmarks/kfac_decomposition_time.py": ([], "kfac_decomposition_time_cpu"),
    "benchmarks/kfac_method_cell.py": ([], "kfac_methods_1host"),
    "benchmarks/phase_overhead.py": ([], "phase_overhead"),
    "benchmarks/transformer_lm.py": ([], "transformer_lm"),
    "benchmarks/kfac_transformer.py": ([], "kfac_transformer"),
    "benchmarks/kfac_gpu.py": (["--kfac-pytorch", "none"], "kfac_gpu"),
    "hpcdl/bench/allreduce.py": ([], "allreduce_np1"),
    "benchmarks/amp_dtype.py": ([], "amp_dtype_cpu"),
    "benchmarks/gpu_figures.py": (["--collect", "/nonexistent"], "gpu_suite"),  # a folder of the suite's files
}
# A second way into a program that writes elsewhere than its main path does.
EXTRA = [("benchmarks/kfac_large_batch.py", ["--report", str(COMMITTED / "kfac_large_batch_target.json")],
          "kfac_large_batch")]
# How each program that writes <stem><suffix> files is told the stem (network.py and kfac_gpu.py write a folder of
# named files).
DOTTED = ("dotted/study-lr0.05", "dotted/study-lr0.1")  # two studies whose names differ only after a dot


def stem_args(program: str, stem: str) -> list[str]:
    if program == "hpcdl/bench/allreduce.py":
        folder, name = stem.rsplit("/", 1)
        return ["--output-dir", folder, "--name", name]
    return ["--output" if "throughput" in program or "deterministic" in program else "--out", stem]


STEM_PROGRAMS = [program for program in CASES
                 if program not in ("benchmarks/network.py", "benchmarks/gpu_figures.py", "benchmarks/kfac_gpu.py")]
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
    dotted = [[*CASES[program][0], *stem_args(program, stem)] for program in STEM_PROGRAMS for stem in DOTTED]
    cases += [{"program": invocation(program), "argv": argv, "key": [program, " ".join(argv), False]}
              for program, argv in zip([p for p in STEM_PROGRAMS for _ in DOTTED], dotted, strict=True)]
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
        assert row["decided"], f"{program} {argv} ended without asking hpcdl.persistence.outputs: {row.get('ending')}"
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


# ---- one output rule for every writer (issue 38, kind 1) --------------------------------------------------------


def test_the_rule_names_files_whole_and_strips_only_a_suffix_of_its_own() -> None:
    assert outputs.output_file(Path("runs/x/sgd-lr0.05"), ".json") == Path("runs/x/sgd-lr0.05.json")
    assert outputs.given_stem(Path("runs/x/sgd-lr0.05"), (".json", ".png")) == Path("runs/x/sgd-lr0.05")
    assert outputs.given_stem(Path("runs/x/sgd-lr0.05.json"), (".json", ".png")) == Path("runs/x/sgd-lr0.05")
    assert outputs.given_stem(Path("runs/x/a.csv"), (".json",)) == Path("runs/x/a.csv")
    assert outputs.given_stem(None, (".json",)) is None


@pytest.mark.parametrize("program", STEM_PROGRAMS)
def test_a_stem_with_a_dot_reaches_the_rule_whole(probed, program: str) -> None:
    """``--out runs/x/sgd-lr0.05`` is checked as ``sgd-lr0.05.json``, the file written (a stem cut at its last dot
    was checked as one file and written as another, and two such studies wrote the same file)."""
    for stem in DOTTED:
        argv = [*CASES[program][0], *stem_args(program, stem)]
        row = probed[(program, " ".join(argv), False)]
        assert row["decided"] and row["requested"] == stem, row


def test_no_writer_names_a_file_by_cutting_at_the_last_dot() -> None:
    """Every file a study writes or reads back is named by outputs.output_file: ``Path.with_suffix`` cuts
    ``sgd-lr0.05`` to ``sgd-lr0`` (the check, the write and --keep's reading must name one file)."""
    sources = [*programs(), "benchmarks/studies.py", "hpcdl/bench/report.py"]
    offenders = [f"{source}:{node.lineno}" for source in sources for node in ast.walk(ast.parse((REPO / source)
                 .read_text())) if isinstance(node, ast.Attribute) and node.attr == "with_suffix"]
    assert not offenders, offenders


def test_two_studies_whose_names_differ_after_a_dot_both_survive_and_a_rerun_refuses(tmp_path: Path) -> None:
    """End to end with the cheapest study (kfac_traffic predict); the other studies' writers are the rule's too
    (the two tests above, and tests/benchmarks/test_study_runs.py for the accuracy studies)."""
    script, env = str(REPO / "benchmarks" / "kfac_traffic.py"), dict(os.environ, PYTHONPATH=str(REPO))
    written = {}
    for stem in DOTTED:
        done = subprocess.run([sys.executable, script, "predict", "--out", str(tmp_path / stem)], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        path = tmp_path / f"{stem}.json"
        assert f"wrote {path}" in done.stdout, done.stdout[-500:]
        written[path] = path.read_bytes()
    assert sorted(p.name for p in (tmp_path / "dotted").iterdir()) == ["study-lr0.05.json", "study-lr0.1.json"]
    again = subprocess.run([sys.executable, script, "predict", "--out", str(tmp_path / DOTTED[0])], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and again.stderr.strip().count("\n") == 0, again.stderr
    assert "study-lr0.05.json already exists; add --force" in again.stderr
    assert all(path.read_bytes() == data for path, data in written.items())
