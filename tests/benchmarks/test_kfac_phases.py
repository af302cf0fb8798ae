"""benchmarks/kfac_phases.py: which runs a trace makes, and the yielding-against-spinning figure it reads back."""

from __future__ import annotations

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
