"""benchmarks/kfac_phases.py: which runs a trace makes, its rounds, and the figures it reads back."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from hpcdl.training.config import parse_config
from hpcdl.training.models import MnistCNN
from hpcdl.training.optimizers import build_preconditioner
from tests.support.scripts import load_benchmark

phases = load_benchmark("kfac_phases")
studies = load_benchmark("studies")


def test_spinning_runs_are_their_yielding_twins_with_open_mpis_default_wait() -> None:
    plain = phases.runs(2)
    assert list(plain) == ["K-FAC", "K-FAC, earlier preset", "Muon"]
    assert all(env == {} for _, env in plain.values())  # hpcdl.train's own setting: yield
    both = phases.runs(2, spinning=True)
    assert list(both) == ["K-FAC", "K-FAC, MPI spinning", "K-FAC, earlier preset", "Muon", "Muon, MPI spinning"]
    for method in ("K-FAC", "Muon"):
        flags, env = both[f"{method}, MPI spinning"]
        assert flags == both[method][0]
        assert env == {"OMPI_MCA_mpi_yield_when_idle": "0"}


def test_malloc_default_runs_are_their_twins_with_glibcs_malloc_as_it_comes() -> None:
    both = phases.runs(2, spinning=True, malloc_default=True)
    assert list(both) == ["K-FAC", "K-FAC, MPI spinning", "K-FAC, glibc malloc defaults", "K-FAC, earlier preset",
                          "Muon", "Muon, MPI spinning", "Muon, glibc malloc defaults"]
    for method in ("K-FAC", "Muon"):
        flags, env = both[f"{method}, glibc malloc defaults"]
        assert flags == both[method][0]
        assert env == {"HPCDL_MALLOC_TUNING": "0"}


def test_the_malloc_figure_compares_each_method_with_its_glibc_default_twin(monkeypatch) -> None:
    def run(ms: float) -> dict:
        return {"step_phases": {"phases": {"step": {"median_slowest": ms / 1000}}}}

    fake = {"runs": {"K-FAC": run(300), "K-FAC, glibc malloc defaults": run(450), "Muon": run(250),
                     "Muon, glibc malloc defaults": run(400), "Muon, MPI spinning": run(900)}}
    monkeypatch.setattr(phases, "results", lambda name: fake)
    assert phases._malloc("any") == ("Muon's step 250 ms with freed memory kept against 400 ms with glibc's defaults "
                                     "(1.60×), K-FAC's 300 against 450 ms (1.50×)")


def test_the_yield_figure_reads_each_methods_median_step_on_its_slowest_rank(monkeypatch) -> None:
    def run(ms: float) -> dict:
        return {"step_phases": {"phases": {"step": {"median_slowest": ms / 1000}}}}

    fake = {"runs": {"K-FAC": run(500), "K-FAC, MPI spinning": run(750), "Muon": run(400),
                     "Muon, MPI spinning": run(800)}}
    monkeypatch.setattr(phases, "results", lambda name: fake)
    assert phases._yield("any") == ("Muon's step 400 ms with Open MPI yielding against 800 ms spinning (2.00×), "
                                    "K-FAC's 500 against 750 ms (1.50×)")


def test_a_studys_link_rate_is_none_on_one_host_and_for_an_unknown_cluster() -> None:
    assert studies.link_rate(None) is None
    assert studies.link_rate("nosuchcluster") is None


def test_the_one_bucket_run_is_k_facs_twin_through_a_plugin_with_the_earlier_cap() -> None:
    plan = phases.runs(2, one=True)
    assert list(plan) == ["K-FAC", "K-FAC, one bucket", "K-FAC, earlier preset", "Muon"]
    flags, env = plan["K-FAC, one bucket"]
    assert flags == [*plan["K-FAC"][0], "--kfac-impl", "kfac_phases:one_bucket"] and env == {}
    config = parse_config(["--dataset", "mnist", "--model", "mnist_cnn", "--kfac"])
    twin = phases.one_bucket(config, MnistCNN(), lambda: 0.1, None)
    plain = build_preconditioner(config, MnistCNN(), lambda: 0.1, None)
    assert twin.options.bucket_cap_mb == 25.0 and twin._exchange.buckets == [[3, 2, 1, 0]]
    same = {"bucket_cap_mb", "lr", "method"}  # lr: the callable given; method: its own solver object
    assert {f.name: getattr(twin.options, f.name) for f in fields(twin.options) if f.name not in same} == \
        {f.name: getattr(plain.options, f.name) for f in fields(plain.options) if f.name not in same}
    assert twin.method == plain.method
    assert len(plain._exchange.buckets) > 1


def _trace(wait: float, wait_one: float, step: float, step_one: float, muon: float) -> dict:
    def run(**ms: float) -> dict:
        return {"step_phases": {"phases": {p: {"median_slowest": v / 1000} for p, v in ms.items()}}}

    return {"K-FAC": run(allreduce=wait, step=step), "K-FAC, one bucket": run(allreduce=wait_one, step=step_one),
            "Muon": run(allreduce=1.0, step=muon)}


def test_the_bucket_figures_take_each_rounds_pair_and_the_medians_over_rounds(monkeypatch) -> None:
    rounds = [_trace(5, 9, 270, 280, 250), _trace(3, 12, 266, 270, 262), _trace(7, 8, 290, 283, 255)]
    monkeypatch.setattr(phases, "results", lambda name: {"runs": rounds[0], "rounds": rounds})
    assert phases._buckets_short("any") == (
        "K-FAC waited 5.0 ms a step for the gradients' allreduce with its statistics in buckets of the default cap, "
        "against 9.0 ms with one bucket, and its step was 4 ms shorter (shorter in 2 of 3 rounds; medians, slowest "
        "rank)")
    table = phases._buckets("any").strip().splitlines()
    assert table[2] == "| 1 | 5.0 | 9.0 | 270 | 280 | 250 | -10 |"
    assert table[-1] == "| median | **5.0** | **9.0** | **270** | **280** | **255** | **-4** |"


def test_rounds_repeat_the_plan_and_keep_every_rounds_phases(monkeypatch, tmp_path) -> None:
    """--rounds 2: every run twice, in plan order; the results' runs are the first round's, rounds hold both."""
    calls: list[str] = []

    def fake_run(flags, out, **options):
        calls.append(options["required"])
        step = 0.25 + 0.01 * len(calls)
        return studies.TrainRun([], 0, summary={"step_phases": {"phases": {"step": {"median_slowest": step}}},
                                                "train_seconds": step * 14, "global_steps": 14})

    monkeypatch.setattr(phases, "run_train", fake_run)
    monkeypatch.setattr(phases, "check_mnist", lambda path: None)
    monkeypatch.setattr(phases, "plot_phases", lambda dirs, path, labels: calls.append(f"plot {len(dirs)}"))
    assert phases.main(["--rounds", "2", "--one-bucket", "--out", str(tmp_path / "t")]) == 0
    names = ["the K-FAC run", "the K-FAC, one bucket run", "the K-FAC, earlier preset run", "the Muon run"]
    assert calls == [*names, *names, "plot 4"]
    saved = json.loads((tmp_path / "t.json").read_text())
    assert saved["one_bucket"] is True and len(saved["rounds"]) == 2 and saved["runs"] == saved["rounds"][0]
    assert saved["rounds"][1]["Muon"]["seconds_per_step"] == pytest.approx(0.25 + 0.08)
