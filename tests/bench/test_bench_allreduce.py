"""The allreduce benchmark: its helpers (sizes, the alpha-beta model) and one tiny run on 2 ranks.

Speed is not asserted here (benchmarks measure, tests check): the run checks that every
implementation is measured at every size and that the CSV, JSON and plot are complete.
"""

from __future__ import annotations

import csv
import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest

from hpcdl.bench import alphabeta, report, timing
from hpcdl.bench.sizes import format_size, parse_size
from hpcdl.persistence import outputs
from hpcdl.runtime import launcher
from hpcdl.runtime.errors import UsageError
from tests.support.backends import HOROVOD
from tests.support.mpi_harness import PYTHON, REPO, error_lines, mpi_env, run_mpi

pytestmark = pytest.mark.processes  # starts processes: not in the fast tier



@pytest.mark.parametrize(
    ("text", "nbytes"),
    [("4", 4), ("4B", 4), ("64K", 65536), ("64kb", 65536), ("4MB", 4 << 20), ("256MiB", 256 << 20), ("1G", 1 << 30)],
)
def test_parse_size(text: str, nbytes: int) -> None:
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "banana", "4 TB", "-4", "1.5M"])
def test_parse_size_rejects_nonsense(text: str) -> None:
    with pytest.raises(Exception, match="not a size"):
        parse_size(text)


def test_format_size_and_message_sizes() -> None:
    assert [format_size(n) for n in (4, 1000, 4096, 4 << 20, 1 << 30)] == ["4 B", "1000 B", "4 KiB", "4 MiB", "1 GiB"]
    assert timing.message_sizes(4, 256 << 20) == [4 << k for k in range(27)]
    assert timing.message_sizes(5, 40) == [8, 16, 32]


def test_iterations_fill_the_budget_within_limits() -> None:
    assert timing.iterations(1e-3, 0.2) == 200
    assert timing.iterations(1e-7, 0.2) == timing.MAX_ITERATIONS
    assert timing.iterations(5.0, 0.2) == timing.MIN_ITERATIONS


def test_ring_model_by_hand() -> None:
    model = alphabeta.AlphaBeta(alpha=1e-6, bandwidth=1e9)
    # 4 ranks: 6 steps of 1 us, and 2 * 3/4 of 1 MB at 1 GB/s = 1.5 ms.
    assert model.ring_seconds(1e6, 4) == pytest.approx(6e-6 + 1.5e-3)
    assert model.naive_seconds(1e6, 4) == pytest.approx(6 * (1e-6 + 1e-3))
    assert alphabeta.network(100, 2).bandwidth == pytest.approx(12.5e9)
    assert pytest.approx(102.2e6, rel=1e-3) == alphabeta.RESNET50_GRADIENT_BYTES


@pytest.mark.parametrize("ranks", [2, 3, 8])
def test_fit_recovers_the_parameters_that_made_the_data(ranks: int) -> None:
    truth = alphabeta.AlphaBeta(alpha=25e-6, bandwidth=3.2e9)
    sizes = timing.message_sizes(4, 64 << 20)
    noise = np.random.default_rng(0).uniform(0.97, 1.03, len(sizes))
    times = [truth.ring_seconds(n, ranks) * k for n, k in zip(sizes, noise, strict=True)]
    fitted = alphabeta.fit_ring(sizes, times, ranks)
    assert fitted.alpha == pytest.approx(truth.alpha, rel=0.05)
    assert fitted.bandwidth == pytest.approx(truth.bandwidth, rel=0.05)


def test_bus_bandwidth_and_ratios() -> None:
    def row(name: str, nbytes: int, us: float) -> report.Row:
        return report.Row(name, nbytes, nbytes // 4, 4, 1, 1, 1, us, us, us)

    fast = row("MPI.Allreduce", 8 << 20, 1000.0)
    assert fast.algbw_gbps == pytest.approx((8 << 20) / 1e-3 / 1e9)
    assert fast.busbw_gbps == pytest.approx(fast.algbw_gbps * 1.5)
    rows = [fast, row("ring", 8 << 20, 1250.0), row("ring", 1 << 20, 1.0), row("MPI.Allreduce", 1 << 20, 9.0)]
    assert report.bandwidth_ratios(rows, "ring", "MPI.Allreduce", 4 << 20) == {8 << 20: pytest.approx(0.8)}


def test_tiny_run_on_two_ranks_writes_complete_results(tmp_path: Path) -> None:
    result = run_mpi(
        2,
        [
            "-m",
            "hpcdl.bench.allreduce",
            "--max-size",
            "64",
            "--rounds",
            "1",
            "--seconds",
            "0.02",
            "--output-dir",
            str(tmp_path),
            "--name",
            "tiny",
        ],
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with (tmp_path / "tiny.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    implementations = [
        "MPI.Allreduce",
        *(["horovod"] if HOROVOD else []),  # a setup without Horovod leaves its row out, with a note
        "torch.distributed (gloo)",
        "naive",
        "ring",
        "recursive_doubling",
        "rabenseifner",
    ]
    assert {r["implementation"] for r in rows} == set(implementations)
    assert sorted({int(r["bytes"]) for r in rows}) == [4, 8, 16, 32, 64]
    assert len(rows) == 5 * len(implementations)
    assert set(rows[0]) == set(report.COLUMNS)
    assert all(float(r["latency_us"]) > 0 and float(r["busbw_GBps"]) > 0 for r in rows)
    document = json.loads((tmp_path / "tiny.json").read_text())
    assert document["meta"]["ranks"] == 2 and len(document["rows"]) == len(rows)
    predictions = document["alpha_beta"]["predictions"]
    assert [p["ranks"] for p in predictions] == [64, 512, 4096]
    assert all(math.isfinite(p["ring_ms"]) and p["ring_ms"] > 0 for p in predictions)
    assert (tmp_path / "tiny.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "bus bandwidth (GB/s)" in result.stdout and "ResNet-50" in result.stdout


def test_bad_size_is_one_line_error_and_nonzero_exit(tmp_path: Path) -> None:
    result = run_mpi(
        2, ["-m", "hpcdl.bench.allreduce", "--max-size", "banana", "--output-dir", str(tmp_path)], timeout=120
    )
    assert result.returncode != 0
    assert result.stderr.count("error:") == 1 and "not a size" in result.stderr and "Traceback" not in result.stderr
    assert not any(tmp_path.iterdir())


# ------------------------------------------------------------------ where results go, and who may run

QUICK = [
    "-m",
    "hpcdl.bench.allreduce",
    "--max-size",
    "16",
    "--rounds",
    "1",
    "--seconds",
    "0.01",
    "--no-horovod",
    "--no-gloo",
    "--algorithms",
    "ring",
]


def fake_checkout(root: Path) -> Path:
    """A folder shaped like an hpcdl checkout, with committed results in it."""
    (root / "hpcdl").mkdir(parents=True)
    (root / "hpcdl" / "__init__.py").write_text("")
    results = root / "benchmarks" / "results"
    results.mkdir(parents=True)
    for suffix in (".csv", ".json", ".png"):
        (results / f"allreduce_np2{suffix}").write_text("committed")
    return results


def test_a_two_rank_benchmark_started_without_a_launcher_refuses_in_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in mpi_env().items() if k not in launcher.LAUNCHED_VARS}
    result = subprocess.run(
        [PYTHON, *QUICK, "--output-dir", str(tmp_path)], capture_output=True, text=True, env=env, cwd=REPO, timeout=120
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        "hpcdl.bench.allreduce: error: hpcdl.bench.allreduce measures 2 or more ranks and was started as a single "
        "process, without a launcher; run: mpirun -np 2 python -m hpcdl.bench.allreduce ... (or srun -n 2 --mpi=pmix "
        "..., ibrun on TACC systems)"
    ]
    assert not any(tmp_path.iterdir())


def test_one_rank_under_a_launcher_is_told_to_start_more() -> None:
    result = run_mpi(1, QUICK, timeout=120)
    assert result.returncode == 2
    assert error_lines(result.stderr) == [
        "hpcdl.bench.allreduce: error: hpcdl.bench.allreduce needs at least 2 ranks, this job has 1; run: mpirun -np 2 "
        "python -m hpcdl.bench.allreduce ... (or srun -n 2 --mpi=pmix ..., ibrun on TACC systems)"
    ]


def test_committed_results_are_replaced_only_with_refresh_results(tmp_path: Path) -> None:
    results = fake_checkout(tmp_path / "checkout")
    refused = run_mpi(2, [*QUICK, "--output-dir", str(results)], timeout=120)
    assert refused.returncode == 2
    assert error_lines(refused.stderr) == [
        f"hpcdl.bench.allreduce: error: {results / 'allreduce_np2.csv'} is in benchmarks/results, the results "
        "committed in the repository; add --refresh-results to replace them, or choose another --output-dir/--name"
    ]
    assert (results / "allreduce_np2.csv").read_text() == "committed"
    refreshed = run_mpi(2, [*QUICK, "--output-dir", str(results), "--refresh-results"], timeout=180)
    assert refreshed.returncode == 0, refreshed.stderr[-2000:]
    assert (results / "allreduce_np2.csv").read_text().startswith("implementation,")


def test_default_results_go_to_a_new_folder_under_runs_bench(tmp_path: Path, monkeypatch) -> None:
    """One run writes under runs/bench/allreduce_np2/<new folder>/; the next run's folder is new because the rule
    makes one per call: the call the program makes, made again here, gets another folder beside it."""
    first = run_mpi(2, QUICK, timeout=180, cwd=tmp_path, env={"PYTHONPATH": str(REPO)})
    assert first.returncode == 0, first.stderr[-2000:]
    (written,) = tmp_path.glob("runs/bench/allreduce_np2/*/allreduce_np2.csv")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]  # nothing else, no benchmarks/results
    monkeypatch.chdir(tmp_path)
    again = outputs.results_stem(None, "allreduce_np2", (".csv", ".json", ".png")).resolve()
    assert again.name == "allreduce_np2" and again.parent.parent == written.parent.parent
    assert again.parent != written.parent and not any(again.parent.iterdir())


def test_existing_results_elsewhere_need_force(tmp_path: Path) -> None:
    (tmp_path / "mine.json").write_text("earlier")
    refused = run_mpi(2, [*QUICK, "--output-dir", str(tmp_path), "--name", "mine"], timeout=120)
    assert refused.returncode == 2
    assert error_lines(refused.stderr)[0].endswith(
        "mine.json already exists; add --force to replace it, or choose another --output-dir/--name"
    )
    assert (tmp_path / "mine.json").read_text() == "earlier" and not (tmp_path / "mine.csv").exists()


def test_results_stem_decisions(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    results = fake_checkout(tmp_path / "checkout")
    stem = outputs.results_stem(None, "thing", (".json",))
    assert stem.name == "thing" and stem.parent.parent == Path("runs/bench/thing") and stem.parent.is_dir()
    with pytest.raises(UsageError, match="--refresh-results replaces results in benchmarks/results, but --out names"):
        outputs.results_stem(tmp_path / "x", "thing", (".json",), refresh_results=True, flag="--out")
    with pytest.raises(UsageError, match="is in benchmarks/results"):
        outputs.results_stem(results / "allreduce_np2", "x", (".png",), force=True)
    assert (
        outputs.results_stem(results / "allreduce_np2", "x", (".png",), refresh_results=True)
        == results / "allreduce_np2"
    )
    assert outputs.output_file(Path("a/allreduce_cycle0.03ms"), ".png") == Path("a/allreduce_cycle0.03ms.png")
    assert outputs.is_committed(REPO / "benchmarks" / "results" / "allreduce_np2.png")
    assert outputs.checkout_results() == REPO / "benchmarks" / "results"


def test_json_results_are_strict_json(tmp_path: Path) -> None:
    """One rank has no bus bandwidth (NaN): it is written as null, so any JSON reader can read the file."""
    row = report.Row("MPI.Allreduce", 64, 16, 1, 1, 1, 1, 5.0, 5.0, 5.0)
    report.write_json(tmp_path / "r.json", [row], meta={"x": float("inf")})

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    document = json.loads((tmp_path / "r.json").read_text(), parse_constant=refuse)
    assert document["rows"][0]["busbw_GBps"] is None and document["meta"]["x"] is None
