"""benchmarks/kfac_large_batch.py: the reduced grid's wiring into hpcdl.train, its bookkeeping, and a
tiny end-to-end run (digits, two steps per run), so that a renamed flag on either side fails here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hpcdl.runtime.errors import UsageError
from hpcdl.training.config import parse_config
from tests.support.data_files import write_mnist

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "kfac_large_batch.py"


def test_every_reduced_run_is_a_valid_hpcdl_train_command(study: Any, tmp_path: Path) -> None:
    args = study.parse_args(["--reduced", "--dry-run"])
    cells = study.reduced_cells(args.methods, study.REDUCED_BATCHES, 0)
    assert {c.batch for c in cells} == {128, 4096} and {c.seed for c in cells} == {0}
    assert {c.method for c in cells} == set(study.DEFAULT_METHODS) == {"sgd", "lamb", "lars", "kfac",
                                                                        "kfac-pytorch-native"}
    inverse_every = {}
    for cell in cells:
        command = study.train_command(cell, args, tmp_path / cell.name)
        assert command[1:3] == ["-m", "hpcdl.train"]
        config = parse_config(command[3:])  # hpcdl.train's own parser: a renamed flag fails here
        assert config.batch_size * config.batches_per_allreduce == cell.batch
        peak = config.base_lr * config.batches_per_allreduce  # one rank: hpcdl scales by the accumulation
        assert peak == pytest.approx(cell.lr)
        assert config.seed == 0 and config.lr_schedule == "cosine"
        kfac = cell.method.startswith("kfac")
        # hpcdl's K-FAC holds the peak (a ramp defeats its KL clip); the others ramp up from 0.1x
        assert config.warmup_start_factor == (1.0 if cell.method == "kfac" else 0.1)
        assert config.kfac == kfac
        assert (config.kfac_impl != "hpcdl") == cell.method.startswith("kfac-pytorch")
        if cell.method == "kfac" and cell.batch == 4096:  # the documented preset, not a copy of its values
            assert config.kfac_preset == "large-batch" and "--kfac-damping" not in command
            assert "--kfac-kl-clip" not in command
            assert "--momentum" not in command  # the preset's own 0.5
            assert (config.kfac_inv_update_freq, config.kfac_factor_examples, config.kfac_grad_worker_fraction,
                    config.kfac_damping, config.kfac_kl_clip, config.momentum) == (2, 256, "auto", 0.003, 0.01, 0.5)
        else:
            assert config.momentum == 0.9
        # test accuracy 4 times an epoch: every 4 steps of 14 at 4096, every 117 of 468 at 128
        assert config.eval_every == {4096: 4, 128: 117}[cell.batch]
        if kfac:
            inverse_every[cell.method, cell.batch] = (config.kfac_inv_update_freq, config.kfac_factor_update_freq)
        if cell.method in ("sgd", "lamb", "lars"):
            assert config.optimizer == cell.method
    assert inverse_every == {("kfac", 4096): (2, 1), ("kfac", 128): (100, 10),  # (inverse, factors)
                             ("kfac-pytorch-native", 4096): (10, 1), ("kfac-pytorch-native", 128): (100, 10)}


def test_time_to_target_and_best_rates_from_hand_made_curves(study: Any) -> None:
    Cell, Outcome = study.Cell, study.Outcome
    rows = [dict(global_step=15 * (i + 1), train_seconds=10.0 * (i + 1), test_accuracy=a)
            for i, a in enumerate([0.97, 0.986, 0.991])]
    run = Outcome(Cell("kfac", 4096, 0.2, 0), 0, rows)
    assert run.to_target(0.985) == (30, 20.0) and run.to_target(0.99) == (45, 30.0)
    assert run.to_target(0.995) is None and run.final_accuracy == 0.991
    worse = Outcome(Cell("kfac", 4096, 0.4, 0), 0, [dict(rows[0], test_accuracy=0.98)])
    failed = Outcome(Cell("sgd", 4096, 0.4, 0), 1, rows)  # a failed run counts as 0, whatever it logged
    ok = Outcome(Cell("sgd", 4096, 0.1, 0), 0, [dict(rows[0], test_accuracy=0.95)])
    assert study.best_rates([run, worse, failed, ok], 4096) == {"kfac": 0.2, "sgd": 0.1}


def test_readme_and_the_study_state_the_batch_4096_figures_of_the_results_files(study: Any) -> None:
    """The verdict README and the study document give is computed here from the committed results files
    (with the study's own summary, not benchmarks/figures.py's) and is the figure both quote."""
    results = REPO / "benchmarks" / "results"
    outcomes = [o for name in ("kfac_large_batch_target_quiet", "kfac_large_batch_target_quiet_others")
                for o in study.load_outcomes(results / f"{name}.json")]
    rows = {r["method"]: r for r in study.summarise(outcomes) if r["batch"] == 4096}
    assert {r["seeds"] for r in rows.values()} == {3}
    kfac = rows["kfac"]
    fastest = min((rows[m] for m in ("sgd", "lamb", "lars") if rows[m]["seconds_98.5"] is not None),
                  key=lambda r: r["seconds_98.5"])
    ratio = kfac["seconds_98.5"] / fastest["seconds_98.5"]
    assert kfac["median_final"] >= 0.99 and ratio <= 0.6  # the two targets, from the data
    for document in ("README.md", "benchmarks/results/kfac_large_batch.md"):
        text = (REPO / document).read_text()
        assert f"<!--fig:lb.kfac.final-->{100 * kfac['median_final']:.2f} %<!--/fig-->" in text, document
        assert f"<!--fig:lb.ratio985-->{ratio:.2f}×<!--/fig-->" in text, document
    assert fastest["method"] == "lars"


def test_kfac_runs_are_named_by_what_differs_from_the_preset_of_their_time(study: Any, tmp_path: Path) -> None:
    def labels(extra: list[str], meta: dict[str, Any]) -> list[str]:
        command = ["python", "-m", "hpcdl.train", "--weight-decay", "5e-4", "--kfac-preset", "large-batch", *extra]
        run = study.Outcome(study.Cell("kfac", 4096, 0.4, 0), 0, [], command=command)
        study.write_results([run], tmp_path / "runs", dict(load_before=1.0, **meta))
        return [o.cell.method for o in study.load_outcomes(tmp_path / "runs.json")]

    now = dict(kfac_preset={})
    assert labels([], now) == ["kfac"]
    assert labels(["--momentum", "0.9", "--kfac-factor-examples", "4096"], now) == [
        "kfac stats of 4096 examples momentum 0.9"]
    assert labels(["--kfac-grad-worker-fraction", "0.5"], now) == ["kfac fraction 0.5"]
    # a file of the preset's earlier values (its meta records them) names its runs against them
    inv1 = dict(kfac_preset=dict(factors=1, inverse=1, damping=0.003, kl_clip=0.01, factor_examples=512, momentum=0.5,
                                 fraction=1.0))
    assert labels([], inv1) == ["kfac"]
    assert labels(["--kfac-inv-update-freq", "2"], inv1) == ["kfac inv every 2"]
    assert labels(["--kfac-grad-worker-fraction", "auto"], inv1) == ["kfac fraction auto"]  # a word, not a number
    assert labels(["--kfac-inv-update-freq", "1"], now) == ["kfac inv every 1"]  # today's preset: every 2nd step
    assert labels([], {}) == ["kfac"]  # no record: today's preset
    earlier = dict(kfac_preset=dict(factors=5, inverse=5, damping=0.1, kl_clip=0.01, label="kfac, earlier preset"))
    assert labels([], earlier) == ["kfac, earlier preset"]  # a preset that set neither examples nor momentum
    assert labels(["--kfac-damping", "1"], earlier) == ["kfac, earlier preset d 1"]
    assert labels(["--damping", "1"], earlier) == ["kfac, earlier preset d 1"]  # a file written under the old name


def test_committed_results_record_the_preset_they_ran_under() -> None:
    """Item 5 of issue 47: the preset's earlier values live in the results files' meta, not in the code."""
    for path in sorted((REPO / "benchmarks" / "results").glob("kfac_large_batch*.json")):
        recorded = json.loads(path.read_text())["meta"]["kfac_preset"]
        assert {"factors", "inverse", "damping", "kl_clip"} <= recorded.keys(), path.name


def test_report_takes_only_the_batches_named_after_a_file(study: Any, tmp_path: Path, capsys) -> None:
    rows = [dict(global_step=10, train_seconds=5.0, test_accuracy=0.99)]
    outcomes = [study.Outcome(study.Cell("sgd", b, 0.1, 0), 0, rows) for b in (128, 4096)]
    study.write_results(outcomes, tmp_path / "both", dict(load_before=1.0))
    assert study.report([f"{tmp_path / 'both.json'}@128"], tmp_path / "plot") == 0
    table = capsys.readouterr().out
    assert "| 128 | sgd |" in table and "| 4096 | sgd |" not in table


def test_bad_arguments_are_one_line(study: Any, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no rate for"):
        study.target_rates(study.parse_args(["--target-cell", "--dry-run", "--lrs", "sgd=0.1"]))
    with pytest.raises(UsageError, match="METHOD=LR"):
        study.target_rates(study.parse_args(["--target-cell", "--dry-run", "--lrs", "adam=0.1"]))


@pytest.mark.processes
@pytest.mark.timeout(900)  # six short hpcdl.train processes, two at a time: mostly start-up
def test_the_reduced_mode_runs_end_to_end_on_digits(study: Any, tmp_path: Path) -> None:
    out = tmp_path / "study"
    methods = ["lamb", "kfac"]
    command = [sys.executable, str(SCRIPT), "--reduced", "--dataset", "digits", "--model", "digits_cnn",
               "--batches", "32", "64", "--methods", *methods, "--epochs", "1", "--max-steps", "2", "--jobs", "2",
               "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=850, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads(out.with_suffix(".json").read_text())
    assert len(data["runs"]) == 2 + 2  # one rate per method at each batch
    assert all(r["returncode"] == 0 and r["epochs"] and r["epochs"][-1]["global_step"] == 2 for r in data["runs"])
    assert out.with_suffix(".png").exists() and not out.with_suffix(".csv").exists()
    assert set(data["runs"][0]["epochs"][-1]) <= set(study.CURVE)  # the curve, not the whole metrics row
    table = study.markdown(study.outcomes_of(data))  # what the figures make of a results file: one row a cell
    assert len(table) == 2 + 4 and all(row.startswith(("| 32 |", "| 64 |")) for row in table[2:])


# ---- --tune: the same budget for every method (issue 29) -----------------------------------------------------


def test_tune_gives_every_method_the_same_budget_of_valid_commands(study: Any, tmp_path: Path) -> None:
    methods = ["sgd", "lamb", "lars", "kfac", "adamw", "muon", "soap"]
    args = study.parse_args(["--tune", "--dry-run", "--methods", *methods])
    cells = study.tune_cells(args.methods, (4096,), 0)
    per_method = {m: [c for c in cells if c.method == m] for m in methods}
    assert {len(v) for v in per_method.values()} == {len(study.TUNE_WARMUPS) * 2}  # rate x warm-up, K-FAC included
    for cell in cells:
        command = study.train_command(cell, args, tmp_path / cell.name)
        config = parse_config(command[3:])
        assert config.warmup_epochs == cell.warmup and config.base_lr == pytest.approx(cell.lr)
        assert config.kfac == (cell.method == "kfac")
        assert config.optimizer == ("sgd" if cell.method == "kfac" else cell.method)
        assert f"-w{cell.warmup:g}-" in cell.name


def test_tuning_keeps_the_most_accurate_setting_and_the_verdict_names_who_beats_kfac(study: Any) -> None:
    Cell, Outcome = study.Cell, study.Outcome

    def run(method: str, lr: float, warmup: float, seed: int, finals: list[float]) -> Any:
        rows = [dict(global_step=4 * (i + 1), train_seconds=2.0 * (i + 1), test_accuracy=a)
                for i, a in enumerate(finals)]
        return Outcome(Cell(method, 4096, lr, seed, warmup), 0, rows)

    tuning = [run("muon", 0.01, 0.5, 0, [0.97, 0.99]), run("muon", 0.02, 0.5, 0, [0.986, 0.99]),  # tie: faster wins
              run("muon", 0.02, 1.0, 0, [0.95, 0.98]), run("kfac", 0.4, 0.5, 0, [0.98, 0.992]),
              run("kfac", 0.4, 1.0, 1, [0.999, 0.999])]  # another seed: not a tuning run
    assert sorted(study.tuned_settings(tuning, 0), key=lambda c: c.method) == [
        Cell("kfac", 4096, 0.4, 0, 0.5), Cell("muon", 4096, 0.02, 0, 0.5)]
    three = [run("muon", 0.02, 0.5, s, [0.986, 0.991]) for s in range(3)] + [
        run("kfac", 0.4, 0.5, s, [0.98, 0.990]) for s in range(3)]
    lines = study.verdict(tuning[:4] + three)
    assert lines[0].startswith("muon beats K-FAC: final 99.10 % vs 99.00 %, 98.5 % in 2 s vs 4 s"), lines
    assert any("muon          lr 0.02   wu 0.5 final 99.10 %" in line for line in lines), lines  # the 3-seed row
    kfac_wins = [run("kfac", 0.4, 0.5, s, [0.986, 0.993]) for s in range(3)] + three[:3]
    assert study.verdict(kfac_wins)[0].startswith("no method beats hpcdl's K-FAC: it is the most accurate (99.30 %)")
    theirs = [run("kfac-pytorch-native", 0.2, 0.5, s, [0.99, 0.995]) for s in range(3)]  # another K-FAC counts too
    assert study.verdict(kfac_wins + theirs)[0].startswith("kfac-pytorch-native beats K-FAC: final 99.50 % vs 99.30 %")


# ---- the equal-budget study against Muon, SOAP and AdamW (benchmarks/results/kfac_large_batch_modern.md) -----

RESULTS = REPO / "benchmarks" / "results"
TUNED = {4096: RESULTS / "kfac_large_batch_tune.json", 8192: RESULTS / "kfac_large_batch_tune_8192.json"}
MODERN_DOC = RESULTS / "kfac_large_batch_modern.md"
TUNED_METHODS = {"sgd", "lamb", "lars", "kfac", "adamw", "muon", "soap", "kfac-pytorch-native"}


@pytest.mark.parametrize("batch", sorted(TUNED))
def test_every_method_had_the_same_tuning_budget_and_three_seeds(study: Any, batch: int) -> None:
    outcomes = study.load_outcomes(TUNED[batch])
    methods = {o.cell.method for o in outcomes}
    assert methods == TUNED_METHODS and {o.cell.batch for o in outcomes} == {batch}
    for method in methods:
        mine = [o for o in outcomes if o.cell.method == method]
        tuning = [o for o in mine if o.cell.seed == 0]
        assert len(tuning) == len(study.TUNE_LRS[method]) * len(study.TUNE_WARMUPS), method  # K-FAC included
        chosen = study.tuned_settings(tuning, 0)[0]
        others = {(o.cell.lr, o.cell.warmup) for o in mine if o.cell.seed != 0}
        assert others == {(chosen.lr, chosen.warmup)}, method  # seeds 1 and 2 ran the tuning's best
        assert {o.cell.seed for o in mine} == {0, 1, 2} and all(o.returncode == 0 for o in mine), method


def test_the_study_document_states_the_verdict_its_results_files_give(study: Any) -> None:
    """The first line names whoever beats hpcdl's K-FAC at batch 4096 (or that nobody does); the targets' lines of
    both batches are quoted."""
    text = MODERN_DOC.read_text()
    for batch, path in TUNED.items():
        lines = study.verdict(study.load_outcomes(path), batch)
        if batch == 4096:
            assert text.splitlines()[0] == f"# {lines[0]}"
        targets = [line.strip() for line in lines
                   if line.strip().startswith(("K-FAC >=", "K-FAC time to", "best first"))]
        assert targets and "\n".join(f"    {t}" for t in targets) in text, (batch, targets)  # its own block


def test_ranks_split_the_global_batch_and_the_rate_stays_the_peak_for_it(study: Any, tmp_path: Path) -> None:
    args = study.parse_args(["--target-cell", "--dry-run", "--methods", "kfac", "muon", "--ranks", "4",
                             "--vcluster", "lb"])
    for method in ("kfac", "muon"):
        cell = study.Cell(method, 4096, 0.4, 0)
        config = parse_config(study.train_flags(cell, args))
        assert config.batch_size == 1024 and config.batches_per_allreduce == 1
        assert config.base_lr * 4 == pytest.approx(0.4)  # hpcdl.train scales the per-rank rate by the world size
        command = study.train_command(cell, args, tmp_path / cell.name)
        assert command[1].endswith("launch/mpirun.sh") and command[2:6] == ["--vcluster", "lb", "-np", "4"]
    # A real (not dry) run's arguments: MNIST as generated IDX files, never what an earlier run left in the cache.
    with pytest.raises(UsageError, match="do not split over 3 ranks"):
        three = study.parse_args(["--target-cell", "--methods", "kfac", "--ranks", "3",
                                  "--data-dir", str(write_mnist(tmp_path / "mnist"))])
        study.train_flags(study.Cell("kfac", 4096, 0.4, 0), three)
