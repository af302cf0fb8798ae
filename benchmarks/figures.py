"""Every figure README, docs/ and the study documents quote, computed from benchmarks/results/.

    .venv/bin/python benchmarks/figures.py            # rewrite each marked figure and table from the results files
    .venv/bin/python benchmarks/figures.py --check    # exit 1 naming each figure that differs (tests/docs runs it)

A figure whose results file cannot give it (a study interrupted before the runs it needs) is one line naming
the figure and the document, and exit 1, like a figure that differs; the document keeps its text.

A document marks a figure as ``<!--fig:NAME-->99.30 %<!--/fig-->`` (a table the same way, on lines of its
own). NAME is a key of :data:`FIGURES`, a function of the results files; the text between the markers is
its value and nothing else. So a figure is written once, by this file, and one edited by hand fails
``--check``; the prose around it stays the author's.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import io
import json
import math
import re
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MARKER = re.compile(r"<!--fig:([\w.\-]+)-->(.*?)<!--/fig-->", re.DOTALL)
FIGURES: dict[str, Callable[[], str]] = {}


def documents() -> list[Path]:
    """Where figures may be quoted."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted(RESULTS.glob("*.md"))]


def figure(name: str) -> Callable[[Callable[[], str]], Callable[[], str]]:
    def register(function: Callable[[], str]) -> Callable[[], str]:
        FIGURES[name] = function
        return function
    return register


@functools.cache
def results(name: str) -> Any:
    return json.loads((RESULTS / f"{name}.json").read_text())


@functools.cache
def study(script: str) -> Any:
    """A benchmark script as a module, so that its own summaries make the tables."""
    spec = importlib.util.spec_from_file_location(script, REPO / "benchmarks" / f"{script}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[script] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def times(value: float, digits: int = 2) -> str:
    return f"{value:.{digits}f}×"


def percent(fraction: float, digits: int = 2) -> str:
    return f"{100 * fraction:.{digits}f} %"


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n" + "\n".join(lines) + "\n"


# ---- hpcdl.train against a bare loop (benchmarks/train_throughput.py) -----------------------------------

def _throughput(mode: str) -> dict[str, Any]:
    return results("train_throughput_cpu")["modes"][mode]


def _rate(mode: str, who: str) -> float:
    return results("train_throughput_cpu")["batch"] / statistics.median(_throughput(mode)[f"{who}_step_seconds"])


MODES = {"fp32": "fp32", "amp": "bf16 autocast", "amp+cl": "bf16 + channels_last"}
for _mode in MODES:
    FIGURES[f"train.{_mode}.ratio"] = functools.partial(lambda m: times(_throughput(m)["speed_ratio"]), _mode)
    FIGURES[f"train.{_mode}.rates"] = functools.partial(
        lambda m: f"{_rate(m, 'hpcdl'):.1f} vs {_rate(m, 'bare'):.1f} img/s", _mode)


@figure("train.table")
def _train_table() -> str:
    rows = [(label, f"{_rate(m, 'hpcdl'):.1f}", f"{_rate(m, 'bare'):.1f}", times(_throughput(m)["speed_ratio"]),
             ", ".join(f"{r:.3f}" for r in _throughput(m)["paired_speed_ratios"])) for m, label in MODES.items()]
    return table(["mode", "hpcdl.train img/s", "bare loop img/s", "ratio (median of pairs)", "each pair"], rows)


@figure("train.scaling")
def _scaling() -> str:
    r = results("train_throughput_cpu")
    return (f"{100 * r['scaling_efficiency_2_ranks']:.0f} % ({r['images_per_second_1_rank']:.0f} → "
            f"{r['images_per_second_2_rank']:.0f} img/s)")


FIGURES.update(study("train_throughput").figures(results, table))  # Horovod vs torch.distributed (docs/cluster.md)


# ---- bit-identical runs (benchmarks/deterministic_cost.py) ---------------------------------------------

@figure("deterministic.ratio")
def _deterministic() -> str:
    return times(results("deterministic_cost")["rows"][0]["ratio_median"], 3)


@figure("deterministic.pairs")
def _deterministic_pairs() -> str:
    ratios = results("deterministic_cost")["rows"][0]["ratios"]
    return f"{min(ratios):.3f}–{max(ratios):.3f}×"


# ---- K-FAC's cost (benchmarks/kfac_overhead.py, kfac_eigen_scaling.py) ---------------------------------

def _overhead(factors: int, inverse: int, name: str = "kfac_overhead") -> dict[str, Any]:
    return next(r for r in results(name)["results"]
                if (r["factor_update_freq"], r["inv_update_freq"]) == (factors, inverse))


FREQUENCIES = ((1, 10), (10, 10), (10, 100))


@figure("overhead.ratios")
def _overhead_ratios() -> str:
    return " / ".join(times(_overhead(f, i)["ratio"]) for f, i in FREQUENCIES)


for _f, _i in FREQUENCIES:
    FIGURES[f"overhead.{_f}_{_i}"] = functools.partial(lambda f, i: times(_overhead(f, i)["ratio"]), _f, _i)


@figure("overhead.previous")
def _overhead_previous() -> str:
    return " / ".join(times(_overhead(f, i)["baseline_ratio"]) for f, i in FREQUENCIES)


@figure("overhead.table")
def _overhead_table() -> str:
    rows = []
    for f, i in FREQUENCIES:
        r = _overhead(f, i)
        target = f"≤ {r['target']}× (kfac-pytorch: {r['kfac_pytorch_ratio']}×)" if r.get("target") else ""
        rows.append((f"({f}, {i})", f"{r['sgd_ms']:.1f}", f"{r['kfac_ms']:.1f}",
                     f"{times(r['ratio'])} ({r['min_ratio']:.2f}–{r['max_ratio']:.2f})",
                     times(r["baseline_ratio"]), target))
    return table(["(factor, inverse) freq", "SGD ms", "K-FAC ms",
                  f"K-FAC / SGD (median of {results('kfac_overhead')['rounds']} rounds; min–max)",
                  "the previous kfac / SGD", "target"], rows)


@figure("eigen.speedup")
def _eigen_speedup() -> str:
    r = results("kfac_eigen_scaling")
    one, two = r["runs"]["1 rank x 1 thread"], r["runs"]["2 ranks x 1 thread"]
    return f"{times(r['speedup_2_ranks'])} ({1000 * one['median_s']:.0f} → {1000 * two['median_s']:.0f} ms)"


@figure("eigen.cpu_speedup")
def _eigen_cpu() -> str:
    return times(results("kfac_eigen_scaling")["cpu_speedup_2_ranks"])


@figure("eigen.polling")
def _eigen_polling() -> str:
    runs = results("kfac_eigen_scaling")["runs"]
    spinning, yielding = runs["2 ranks x 1 thread, MPI busy polling"], runs["2 ranks x 1 thread"]
    slower = times(spinning["median_s"] / yielding["median_s"], 1)
    return (f"{slower} slower ({1000 * spinning['median_s']:.0f} against "
            f"{1000 * yielding['median_s']:.0f} ms)")


@figure("eigen.table")
def _eigen_table() -> str:
    runs = results("kfac_eigen_scaling")["runs"]
    one = runs["1 rank x 1 thread"]["median_s"]
    return table(["run", "median wall ms (slowest rank)", "speedup vs 1 rank", "CPU ms of the busiest rank"],
                 [(name, f"{1000 * r['median_s']:.1f}", times(one / r["median_s"]), f"{1000 * r['median_cpu_s']:.1f}")
                  for name, r in runs.items()])


# ---- K-FAC against SGD at batch 128 and on digits (benchmarks/kfac_convergence.py) ---------------------

@figure("digits.table")
def _digits_table() -> str:
    r = results("kfac_convergence_digits")
    return table(["setting", f"seeds reaching {100 * r['target']:.0f} %", "median epochs", "median seconds",
                  "mean final accuracy"],
                 [(name, s["reached"], f"{s['median_epochs_to_target']:g}", f"{s['median_seconds_to_target']:.1f}",
                   f"{s['final_accuracy_mean']:.3f}") for name, s in r["settings"].items()])


@figure("digits.verdict")
def _digits_verdict() -> str:
    s = results("kfac_convergence_digits")["settings"]
    kfac = next(v for v in s.values() if v["kfac"])  # named by all its settings since the study runs hpcdl.train
    sgd, fast = s["SGD lr=0.02"], s["SGD lr=0.05"]
    return (f"K-FAC {kfac['median_epochs_to_target']:g} epochs ({kfac['median_seconds_to_target']:.1f} s) vs SGD "
            f"{sgd['median_epochs_to_target']:g} epochs ({sgd['median_seconds_to_target']:.1f} s); SGD at 2.5× the "
            f"lr: {fast['median_epochs_to_target']:g} epochs")


def _mnist_table(name: str) -> str:
    settings = results(name)["settings"]
    if all("median_cpu_seconds_to_target" in s for s in settings.values()):  # the earlier own loop's files
        return table(["setting", "seeds reaching 99.0 %", "median epochs to 99.0 %", "median training s (wall)",
                      "median CPU s", "mean final accuracy", "CPU s / epoch"],
                     [(setting, s["reached"], f"{s['median_epochs_to_target']:.2f}",
                       f"{s['median_seconds_to_target']:.0f}", f"{s['median_cpu_seconds_to_target']:.1f}",
                       percent(s["final_accuracy_mean"]), f"{s['median_cpu_seconds_per_epoch']:.1f}")
                      for setting, s in settings.items()])
    return table(["setting", "seeds reaching 99.0 %", "median epochs to 99.0 %", "median training s to 99.0 %",
                  "mean final accuracy", "training s / epoch"],
                 [(setting, s["reached"], _finite(s["median_epochs_to_target"], ".2f"),
                   _finite(s["median_seconds_to_target"], ".1f"), percent(s["final_accuracy_mean"]),
                   f"{s['median_train_seconds_per_epoch']:.1f}") for setting, s in settings.items()])


def _finite(value: float, form: str) -> str:
    """A median over seeds where a seed that never got there counts as infinite."""
    return format(value, form) if value != float("inf") else "not reached"


def _mnist_pairs(name: str) -> str:
    v = results(name)["verdict"]
    cpu = "cpu_ratio" in v["pairs"][0]

    def epochs(value: float | None) -> str:
        return "not reached" if value is None else f"{value:g}"

    def ratio(value: float | None) -> str:
        return "-" if value is None else times(value)

    seeds = "; ".join(f"seed {p['seed']}: {epochs(p['sgd_epochs'])} vs {epochs(p['kfac_epochs'])} epochs, "
                      + (f"{ratio(p['wall_ratio'])} wall, {ratio(p['cpu_ratio'])} CPU" if cpu
                         else f"{ratio(p['wall_ratio'])} the training time") for p in v["pairs"])
    median = (f"{times(v['median_wall_ratio'])} the wall time, {times(v['median_cpu_ratio'])} the CPU time" if cpu
              else f"{times(v['median_wall_ratio'])} the training time")
    return (f"{seeds}. Median: **{median}**; a K-FAC epoch cost {times(v['cost_per_epoch_ratio'])} an SGD epoch "
            f"(wall)")


def _mnist_budget(name: str) -> tuple[str, str]:
    s = results(name)["settings"]
    cells = []
    for kfac in (False, True):
        entry = next(e for e in s.values() if e["kfac"] == kfac)
        finals = [run["final_accuracy"] for run in entry["runs"]]
        reached = sum(f >= 0.99 for f in finals)
        cells.append(f"{percent(entry['final_accuracy_mean'])}, {reached}/{len(finals)}")
    return cells[0], cells[1]


for _name, _key in (("kfac_convergence_mnist", "mnist1"), ("kfac_convergence_mnist_np2", "mnist2")):
    FIGURES[f"{_key}.table"] = functools.partial(_mnist_table, _name)
    FIGURES[f"{_key}.pairs"] = functools.partial(_mnist_pairs, _name)
    FIGURES[f"{_key}.wall"] = functools.partial(lambda n: times(results(n)["verdict"]["median_wall_ratio"]), _name)
    FIGURES[f"{_key}.cpu"] = functools.partial(lambda n: times(results(n)["verdict"]["median_cpu_ratio"]), _name)


@figure("mnist.budgets")
def _budgets() -> str:
    rows = [(f"{n} epoch{'s' if n > 1 else ''}", *_mnist_budget(f"kfac_convergence_mnist_budget{n}")) for n in (1, 2)]
    return table(["budget", "SGD lr 0.05: final accuracy (mean), seeds ≥ 99.0 %",
                  "K-FAC: final accuracy (mean), seeds ≥ 99.0 %"], rows)


@figure("mnist.profile")
def _profile() -> str:
    s = results("kfac_convergence_mnist_profile")["settings"]
    rows = []
    for name, e in s.items():
        ms = e["ms_per_step"]
        kfac_wall = sum(ms.get(p + "_wall", 0.0) for p in ("factors", "decompositions", "precondition"))
        rows.append((name, f"{ms['step_cpu']:.1f}", times(e.get("cost_vs_sgd_cpu", 1.0)),
                     f"{ms['forward_backward_cpu']:.1f}", f"{ms.get('kfac_step_cpu', 0.0):.1f}",
                     f"{ms.get('precondition_wall', 0.0):.1f} of {kfac_wall:.1f}"))
    return table(["setting", "CPU ms / step", "vs SGD", "forward+backward (CPU)", "K-FAC `step()` (CPU)",
                  "of which preconditioning (wall)"], rows)


@figure("mnist.kfac_gain")
def _kfac_gain() -> str:
    """How many points unskipped K-FAC ended above the best SGD, over every budget and rank count run."""
    gains = []
    for name in ("kfac_convergence_mnist", "kfac_convergence_mnist_np2", "kfac_convergence_mnist_budget1",
                 "kfac_convergence_mnist_budget2"):
        settings = results(name)["settings"].values()
        sgd = max(s["final_accuracy_mean"] for s in settings if not s["kfac"])
        kfac = max(s["final_accuracy_mean"] for s in settings if s["kfac"] and not s.get("skip"))
        gains.append(100 * (kfac - sgd))
    return f"{min(gains):.2f}–{max(gains):.2f} points"


@figure("mnist.profile_range")
def _profile_range() -> str:
    costs = [e["cost_vs_sgd_cpu"] for e in results("kfac_convergence_mnist_profile")["settings"].values() if e["kfac"]]
    return f"{min(costs):.1f}–{max(costs):.1f}×"


@figure("mnist.profile_10_100")
def _profile_10_100() -> str:
    setting = results("kfac_convergence_mnist_profile")["settings"]["K-FAC lr=0.1 d=0.1 f=10/100"]
    return f"{setting['cost_vs_sgd_cpu']:.1f}×"


# ---- K-FAC at large global batches (benchmarks/kfac_large_batch.py) ------------------------------------

TARGET_CELL = ("kfac_large_batch_target_quiet", "kfac_large_batch_target_quiet_others")


def _outcomes(*sources: str) -> list[Any]:
    """``NAME`` or ``NAME@B1,B2`` (only those global batches of the file)."""
    outcomes = []
    with contextlib.redirect_stderr(io.StringIO()):  # old results name deprecated flags: hpcdl.train says so
        for source in sources:
            name, _, only = source.partition("@")
            batches = {int(b) for b in only.split(",")} if only else None
            outcomes += [o for o in study("kfac_large_batch").load_outcomes(RESULTS / f"{name}.json")
                         if batches is None or o.cell.batch in batches]
    return outcomes


@functools.cache
def _rows(*sources: str) -> dict[tuple[str, int], dict[str, Any]]:
    """(method, batch) -> the summary row of its best rate (the highest median final accuracy)."""
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for row in study("kfac_large_batch").summarise(_outcomes(*sources)):
        key = (row["method"], row["batch"])
        if key not in best or (row["median_final"] or 0) > (best[key]["median_final"] or 0):
            best[key] = row
    return best


def _cell(method: str, batch: int = 4096, sources: Sequence[str] = TARGET_CELL) -> dict[str, Any]:
    return _rows(*sources)[method, batch]


def _fastest_first_order(batch: int = 4096, sources: Sequence[str] = TARGET_CELL) -> dict[str, Any]:
    rows = [r for (m, b), r in _rows(*sources).items() if b == batch and m in ("sgd", "lamb", "lars")]
    return min((r for r in rows if r["seconds_98.5"] is not None), key=lambda r: r["seconds_98.5"])


def _lb_table(*sources: str) -> str:
    return "\n" + "\n".join(study("kfac_large_batch").markdown(_outcomes(*sources))) + "\n"


LB_TABLES = {
    "target": TARGET_CELL,
    "ablation": ("kfac_large_batch_kfac_lrs", "kfac_large_batch_ablation_damping", "kfac_large_batch_ablation_every5",
                 "kfac_large_batch_ablation_momentum", "kfac_large_batch_ablation_all_examples"),
    "batches": ("kfac_large_batch_512@512", "kfac_large_batch_kfac_2048_8192", "kfac_large_batch_fo_2048_8192"),
    "reduced": ("kfac_large_batch_reduced",),
    "sweep": ("kfac_large_batch_sweep",),
    "ramp": ("kfac_large_batch_ramp_reduced", "kfac_large_batch_target_kfac", "kfac_large_batch_lamb04",
             "kfac_large_batch_lamb08", "kfac_large_batch_fo_s1", "kfac_large_batch_sgd05", "kfac_large_batch_sgd025",
             "kfac_large_batch_kfp_native", "kfac_large_batch_kfp_native_s1", "kfac_large_batch_kfac_d1",
             "kfac_large_batch_kfac_d10", "kfac_large_batch_kfac_kfpdamping"),
}
for _key, _sources in LB_TABLES.items():
    FIGURES[f"lb.{_key}.table"] = functools.partial(_lb_table, *_sources)

LB_METHODS = ("sgd", "lamb", "lars", "kfac", "kfac-pytorch-native")
for _method in LB_METHODS:
    FIGURES[f"lb.{_method}.final"] = functools.partial(lambda m: percent(_cell(m)["median_final"]), _method)
    FIGURES[f"lb.{_method}.step_ms"] = functools.partial(lambda m: f"{1000 * _cell(m)['seconds_per_step']:.0f} ms",
                                                         _method)
    FIGURES[f"lb.{_method}.to985"] = functools.partial(
        lambda m: f"{_cell(m)['seconds_98.5']:.0f} s ({_cell(m)['steps_98.5']:.0f} steps)", _method)
    FIGURES[f"lb.{_method}.lr"] = functools.partial(lambda m: f"{_cell(m)['lr']:g}", _method)


@figure("lb.kfac.seeds")
def _kfac_seeds() -> str:
    return " / ".join(f"{100 * a:.2f}" for a in _cell("kfac")["final_accuracy"])


@figure("lb.kfac.reached99")
def _kfac_reached() -> str:
    return _cell("kfac")["reached_99.0"]


@figure("lb.ratio985")
def _ratio985() -> str:
    return times(_cell("kfac")["seconds_98.5"] / _fastest_first_order()["seconds_98.5"])


@figure("lb.fastest_first_order")
def _fastest() -> str:
    return str(_fastest_first_order()["method"]).upper()


@figure("lb.kfac_vs_sgd_step")
def _kfac_vs_sgd_step() -> str:
    return times(_cell("kfac")["seconds_per_step"] / _cell("sgd")["seconds_per_step"])


@figure("lb.kfac_vs_lamb_step")
def _kfac_vs_lamb_step() -> str:
    return times(_cell("kfac")["seconds_per_step"] / _cell("lamb")["seconds_per_step"])


@figure("lb.kfac_vs_kfp_step")
def _kfac_vs_kfp_step() -> str:
    return times(_cell("kfac")["seconds_per_step"] / _cell("kfac-pytorch-native")["seconds_per_step"])


@figure("lb.kfp.step_s")
def _kfp_step() -> str:
    return f"{_cell('kfac-pytorch-native')['seconds_per_step']:.2f} s"


OTHER_BATCHES = LB_TABLES["batches"]
for _batch in (2048, 8192):
    for _method in ("lamb", "lars", "kfac"):
        FIGURES[f"lb.{_batch}.{_method}.final"] = functools.partial(
            lambda m, b: percent(_cell(m, b, OTHER_BATCHES)["median_final"]), _method, _batch)


@figure("lb.2048.ratio985")
def _ratio2048() -> str:
    kfac, lars = _cell("kfac", 2048, OTHER_BATCHES), _cell("lars", 2048, OTHER_BATCHES)
    return times(kfac["seconds_98.5"] / lars["seconds_98.5"])


@figure("lb.2048.ratio990")
def _ratio2048_99() -> str:
    kfac, lars = _cell("kfac", 2048, OTHER_BATCHES), _cell("lars", 2048, OTHER_BATCHES)
    return times(kfac["seconds_99.0"] / lars["seconds_99.0"], 1)


@figure("lb.reduced.seconds")
def _reduced_seconds() -> str:
    meta = results("kfac_large_batch_reduced")["meta"]
    return f"{meta['seconds']:.0f} s for its {len(results('kfac_large_batch_reduced')['runs'])} runs"


# The equal-budget study (--tune): every method's best of 2 rates x 2 warm-ups on seed 0, then seeds 1 and 2; one
# results file per global batch. Figures lb.tune.* are batch 4096's, lb.tune8192.* batch 8192's.
TUNE_FILES = {4096: "kfac_large_batch_tune", 8192: "kfac_large_batch_tune_8192"}
TUNE = TUNE_FILES[4096]
TUNE_NAMES = {"kfac": "hpcdl's K-FAC", "muon": "Muon", "soap": "SOAP", "adamw": "AdamW", "lamb": "LAMB", "lars": "LARS",
              "sgd": "SGD", "kfac-pytorch-native": "kfac-pytorch"}


def _tuned(batch: int = 4096) -> dict[str, dict[str, Any]]:
    """Per method, the summary row of its tuned setting (the one run on the most seeds)."""
    return study("kfac_large_batch").best_rows(_outcomes(f"{TUNE_FILES[batch]}@{batch}"), batch)


def _or_dash(value: float | None, form: str) -> str:
    return "not reached" if value is None else format(value, form)


def _reached(row: dict[str, Any], target: str, what: str, form: str) -> str:
    """A median over the seeds that got to ``target``, naming how many did when not all."""
    value, reached = row[f"{what}_{target}"], row[f"reached_{target}"]
    done, runs = reached.split("/")
    return _or_dash(value, form) + (f" ({reached} seeds)" if value is not None and done != runs else "")


def _tune_table(batch: int) -> str:
    rows = sorted(_tuned(batch).values(), key=lambda r: -(r["median_final"] or 0))
    return table(["method", "peak lr", "warm-up (epochs)", "final accuracy, median of 3 seeds (each)",
                  "steps to 98.5 %", "training s to 98.5 %", "steps to 99.0 %", "ms / step"],
                 [(TUNE_NAMES[r["method"]], f"{r['lr']:g}", f"{r['warmup']:g}",
                   f"{percent(r['median_final'])} ({', '.join(f'{100 * a:.2f}' for a in r['final_accuracy'])})",
                   _reached(r, "98.5", "steps", "g"), _reached(r, "98.5", "seconds", ".0f"),
                   _reached(r, "99.0", "steps", "g"),
                   f"{1000 * r['seconds_per_step']:.0f}") for r in rows])


def _tune_first(batch: int) -> str:
    return study("kfac_large_batch").verdict(_outcomes(f"{TUNE_FILES[batch]}@{batch}"), batch)[0]


def _tune_ratio(batch: int) -> str:
    """K-FAC's training seconds to 98.5 % over the fastest other method's (medians of 3 seeds)."""
    rows = _tuned(batch)
    others = [r for m, r in rows.items() if m != "kfac" and r["seconds_98.5"] is not None]
    if rows["kfac"]["seconds_98.5"] is None:
        return "K-FAC never reached 98.5 %"
    if not others:
        return (f"only K-FAC reached 98.5 % ({rows['kfac']['steps_98.5']:g} steps, "
                f"{rows['kfac']['seconds_98.5']:.0f} s; medians)")
    fastest = min(others, key=lambda r: r["seconds_98.5"])
    return f"{times(rows['kfac']['seconds_98.5'] / fastest['seconds_98.5'])} {TUNE_NAMES[fastest['method']]}'s"


def _tune_headline(batch: int) -> str:
    rows = _tuned(batch)
    kfac = rows.pop("kfac")
    ranked = sorted(rows.values(), key=lambda r: -(r["median_final"] or 0))
    return (f"K-FAC {percent(kfac['median_final'])}; " + ", ".join(
        f"{TUNE_NAMES[r['method']]} {percent(r['median_final'])}" for r in ranked[:3]))


def _tune_edge(batch: int) -> str:
    """The methods whose tuned rate is the larger of their two: more rate might have served them better."""
    grid = study("kfac_large_batch").TUNE_LRS
    edge = [TUNE_NAMES[m] for m, r in sorted(_tuned(batch).items(), key=lambda item: -(item[1]["median_final"] or 0))
            if r["lr"] == max(grid[m])]
    return ", ".join(edge) if edge else "none"


for _batch, _key in ((4096, "tune"), (8192, "tune8192")):
    for _name, _function in (("table", _tune_table), ("first", _tune_first), ("ratio", _tune_ratio),
                             ("headline", _tune_headline), ("edge", _tune_edge)):
        FIGURES[f"lb.{_key}.{_name}"] = functools.partial(_function, _batch)


# The reduced rerun (--target-cell --tuned-from the batch-4096 tuning, seed 0): every method once, side by side on
# one machine, later than the tuning and on another machine.
RERUN = "kfac_large_batch_rerun"


@figure("lb.rerun.seconds")
def _rerun_seconds() -> str:
    r = results(RERUN)
    return f"{r['meta']['seconds'] / 60:.1f} minutes for its {len(r['runs'])} runs, 2 at a time"


@figure("lb.rerun.ratio")
def _rerun_ratio() -> str:
    """K-FAC's steps and training seconds to 98.5 % against Muon's in the rerun (seed 0, one machine)."""
    runs = {o.cell.method: o for o in _outcomes(RERUN)}
    kfac, muon = runs["kfac"].to_target(0.985), runs["muon"].to_target(0.985)
    return (f"{times(kfac[1] / muon[1])} Muon's ({kfac[0]} steps, {kfac[1]:.0f} s against {muon[0]} steps, "
            f"{muon[1]:.0f} s)")


@figure("lb.rerun.steps")
def _rerun_steps() -> str:
    """Seconds per step of hpcdl's K-FAC, Muon and kfac-pytorch, side by side in the rerun."""
    runs = {o.cell.method: o for o in _outcomes(RERUN)}
    kfac = runs["kfac"].seconds_per_step
    return (f"{1000 * kfac:.0f} ms a step for hpcdl's K-FAC, {1000 * runs['muon'].seconds_per_step:.0f} ms for Muon, "
            f"{1000 * runs['kfac-pytorch-native'].seconds_per_step:.0f} ms for kfac-pytorch "
            f"({times(runs['kfac-pytorch-native'].seconds_per_step / kfac, 1)} K-FAC's)")


def _steps_to_985(outcome: Any) -> str:
    hit = outcome.to_target(0.985)
    return "not reached" if hit is None else str(hit[0])


@figure("lb.rerun.finals")
def _rerun_finals() -> str:
    """Each method's final accuracy in the rerun against its seed-0 tuning run (the same command, another machine)."""
    tuned = {(o.cell.method, o.cell.lr, o.cell.warmup): o for o in _outcomes(TUNE) if o.cell.seed == 0}
    rows = []
    for o in sorted(_outcomes(RERUN), key=lambda o: -(o.final_accuracy or 0)):
        then = tuned[(o.cell.method, o.cell.lr, o.cell.warmup)]
        rows.append((TUNE_NAMES[o.cell.method], percent(then.final_accuracy), percent(o.final_accuracy),
                     _steps_to_985(then), _steps_to_985(o)))
    return table(["method", "final, tuning run", "final, rerun", "steps to 98.5 %, tuning run",
                  "steps to 98.5 %, rerun"], rows)


@figure("lb.resnet.verdict")
def _resnet_verdict() -> str:
    """mnist_resnet, each method's tuned setting, medians over the seeds run: K-FAC (preset unchanged) against the
    most accurate other method, and the steps each took to that method's median final accuracy."""
    outcomes = _outcomes("kfac_large_batch_resnet")
    seeds = sorted({o.cell.seed for o in outcomes})
    by_method: dict[str, list[Any]] = {}
    for o in outcomes:
        by_method.setdefault(o.cell.method, []).append(o)
    kfac = by_method.pop("kfac")
    final = {m: statistics.median(o.final_accuracy or 0.0 for o in runs) for m, runs in by_method.items()}
    best = max(final, key=lambda m: final[m])
    goal = final[best]

    def steps(runs: list[Any]) -> str:
        hits = [hit[0] for o in runs if (hit := o.to_target(goal))]
        return f"{statistics.median(hits):g} steps ({len(hits)}/{len(runs)} seeds)" if hits else "never"

    kfac_final = statistics.median(o.final_accuracy or 0.0 for o in kfac)
    return (f"K-FAC {percent(kfac_final)} against {TUNE_NAMES[best]}'s {percent(goal)} (medians of {len(seeds)} "
            f"seeds); to {percent(goal)}: K-FAC {steps(kfac)}, {TUNE_NAMES[best]} {steps(by_method[best])}")


def _ratio_985(outcomes: Sequence[Any], other: str) -> tuple[float, int]:
    """The median over seeds of K-FAC's training seconds to 98.5 % over ``other``'s on the same seed (a seed's two
    runs ran on one machine, side by side; seeds may not have), and how many seeds both reached it on."""
    by_seed: dict[int, dict[str, float]] = {}
    for o in outcomes:
        if hit := o.to_target(0.985):
            by_seed.setdefault(o.cell.seed, {})[o.cell.method] = hit[1]
    ratios = [s["kfac"] / s[other] for s in by_seed.values() if "kfac" in s and other in s]
    return statistics.median(ratios), len(ratios)


def _kfac_vs_other(name: str) -> tuple[str, float, int]:
    """The method K-FAC ran beside in results file ``name``, and :func:`_ratio_985` against it."""
    outcomes = _outcomes(name)
    other = next(o.cell.method for o in outcomes if o.cell.method != "kfac")
    return (other, *_ratio_985(outcomes, other))


@figure("lb.2nodes.ratio")
def _two_nodes() -> str:
    """K-FAC's training seconds to 98.5 % over the other method's on 2 virtual nodes x 2 ranks, and on one host with
    one rank: the same settings and seeds, one run at a time on one machine (medians of per-seed ratios)."""
    other, on_nodes, seeds = _kfac_vs_other("kfac_large_batch_2nodes")
    on_host = _ratio_985(_outcomes("kfac_large_batch_1host"), other)[0]
    return (f"{times(on_nodes)} {TUNE_NAMES[other]}'s on 2 nodes x 2 ranks over 1 Gbit/s, {times(on_host)} on one "
            f"host (1 rank; medians over {seeds} seeds of each seed's ratio)")


@figure("lb.2nodes.short")
def _two_nodes_short() -> str:
    other, ratio, _ = _kfac_vs_other("kfac_large_batch_2nodes")
    return f"{times(ratio)} {TUNE_NAMES[other]}'s"


@figure("lb.2nodes.steps")
def _two_nodes_steps() -> str:
    """Seconds per step of each method on 2 nodes and on one host (medians over seeds)."""
    parts = []
    for name, where in (("kfac_large_batch_2nodes", "2 nodes"), ("kfac_large_batch_1host", "one host")):
        per = {}
        for method in ("kfac", "muon"):
            per[method] = statistics.median(o.seconds_per_step for o in _outcomes(name) if o.cell.method == method)
        parts.append(f"{where}: K-FAC {1000 * per['kfac']:.0f} ms, Muon {1000 * per['muon']:.0f} ms "
                     f"({times(per['kfac'] / per['muon'])})")
    return "; ".join(parts)


@figure("lb.2x1.verdict")
def _two_by_one() -> str:
    """2 virtual nodes x 1 rank (1 thread each, 1 Gbit/s): K-FAC's step over Muon's and its training seconds to
    98.5 % over Muon's (medians over seeds of per-seed ratios), the same settings and seeds one run at a time."""
    other, ratio, seeds = _kfac_vs_other("kfac_large_batch_2x1")
    per = {m: statistics.median(o.seconds_per_step for o in _outcomes("kfac_large_batch_2x1") if o.cell.method == m)
           for m in ("kfac", other)}
    return (f"K-FAC {1000 * per['kfac']:.0f} ms a step, {TUNE_NAMES[other]} {1000 * per[other]:.0f} ms "
            f"({times(per['kfac'] / per[other])}); time to 98.5 %: {times(ratio)} {TUNE_NAMES[other]}'s "
            f"({seeds} seeds)")


def _phases_table(name: str) -> str:
    """Per phase, each run's median seconds on its slowest rank; the step's median last."""
    r = results(name)
    labels = list(r["runs"])
    phases = [p for p in next(iter(r["runs"].values()))["step_phases"]["phases"]
              if any(r["runs"][lab]["step_phases"]["phases"][p]["median_slowest"] >= 0.0005 for lab in labels)]
    rows = [(p, *(f"{1000 * r['runs'][lab]['step_phases']['phases'][p]['median_slowest']:.0f}" for lab in labels))
            for p in phases]
    return table(["phase (ms, median, slowest rank)", *labels], rows)


@figure("phases.overhead")
def _phases_overhead() -> str:
    """The loop with its phase clock over the loop with a silent one (median epochs, side by side)."""
    r = results("phase_overhead")
    return f"{times(r['ratio'], 3)} (resnet20, batch 16, {len(r['seconds']['recorded'])} epochs each)"


@figure("phases.2x1")
def _phases_2x1() -> str:
    return _phases_table("kfac_phases_2x1")


@figure("phases.2x2")
def _phases_2x2() -> str:
    return _phases_table("kfac_phases_2x2")


@figure("lb.2x1.short")
def _two_by_one_short() -> str:
    other, ratio, _ = _kfac_vs_other("kfac_large_batch_2x1")
    per = {m: statistics.median(o.seconds_per_step for o in _outcomes("kfac_large_batch_2x1") if o.cell.method == m)
           for m in ("kfac", other)}
    return f"{times(ratio)} {TUNE_NAMES[other]}'s time, its step {times(per['kfac'] / per[other])}"


@figure("lb.2x1.bf16")
def _two_by_one_bf16() -> str:
    """K-FAC with --kfac-comm-precision bf16 against the fp32 payload, the same cell and seeds (2 nodes x 1 rank)."""
    fp32 = [o for o in _outcomes("kfac_large_batch_2x1") if o.cell.method == "kfac"]
    bf16 = _outcomes("kfac_large_batch_2x1_bf16")
    median = {name: statistics.median(o.final_accuracy or 0.0 for o in runs) for name, runs in
              (("fp32", fp32), ("bf16", bf16))}
    steps = {name: statistics.median((o.to_target(0.985) or (math.inf,))[0] for o in runs) for name, runs in
             (("fp32", fp32), ("bf16", bf16))}
    return (f"final accuracy {percent(median['bf16'])} with bf16 against {percent(median['fp32'])} with fp32, "
            f"{steps['bf16']:.0f} steps to 98.5 % against {steps['fp32']:.0f} (medians of {len(bf16)} seeds)")


@figure("lb.1host.ratio")
def _one_host_ratio() -> str:
    """The batch-4096 time target repeated: K-FAC's and Muon's tuned settings, seeds 0-2, one rank, each run alone,
    on the later machine (median of per-seed ratios of training seconds to 98.5 %)."""
    other, ratio, seeds = _kfac_vs_other("kfac_large_batch_1host")
    return f"{times(ratio)} {TUNE_NAMES[other]}'s ({seeds} seeds, each run alone)"


@figure("lb.2nodes.fraction")
def _two_nodes_fraction() -> str:
    """The 2-node cell with K-FAC at grad-worker fraction 0.25 (one gradient worker per layer on 4 ranks: the
    preconditioned gradients are broadcast instead of the decompositions) against the same Muon runs."""
    quarter = [dataclasses.replace(o, cell=dataclasses.replace(o.cell, method="kfac"))
               for o in _outcomes("kfac_large_batch_2nodes_fraction")]
    muon = [o for o in _outcomes("kfac_large_batch_2nodes") if o.cell.method == "muon"]
    ratio, seeds = _ratio_985(quarter + muon, "muon")
    step = statistics.median(o.seconds_per_step for o in quarter)
    return f"{times(ratio)} Muon's time to 98.5 % ({seeds} seeds), {1000 * step:.0f} ms a step"


# ---- K-FAC's traffic (benchmarks/kfac_traffic.py) ----------------------------------------------------------

def _kb(nbytes: float) -> str:
    return f"{nbytes / 1024:,.0f}"


@figure("traffic.bytes")
def _traffic_bytes() -> str:
    """Per grad-worker fraction, rank 0's payload bytes per step of each kind (counted), and seconds per step."""
    r = results("kfac_traffic_count")
    rows = []
    for run in (x for x in r["runs"] if x["rank"] == 0):
        per_step = {k: v["bytes"] / run["steps"] for k, v in run["counted"].items()}
        kfac = sum(per_step.values())
        rows.append((f"{run['fraction']:g}", _kb(run["gradient_bytes"]), _kb(per_step.get("factors", 0)),
                     _kb(per_step.get("decompositions", 0)), _kb(per_step.get("directions", 0)),
                     times(kfac / run["gradient_bytes"], 1), f"{1000 * run['seconds_per_step']:.0f}"))
    return table(["grad-worker fraction", "gradients KiB / step", "K-FAC factors", "decompositions",
                  "preconditioned gradients", "K-FAC / gradients", "ms / step"], rows)


@figure("traffic.model_check")
def _traffic_check() -> str:
    r = results("kfac_traffic_count")
    fractions = sorted({run["fraction"] for run in r["runs"]}, reverse=True)
    verdict = "equals" if r["model_equals_counts"] else "does NOT equal"
    return (f"{verdict} the counted bytes of every collective round on each of the {r['ranks']} ranks, at fractions "
            + ", ".join(f"{f:g}" for f in fractions))


@figure("traffic.heldout")
def _traffic_heldout() -> str:
    """Per cluster size measured (one rank per virtual node), each held-out collective: measured, predicted."""
    names = {"factors": "factors", "broadcasts": "decompositions, one broadcast per rank",
             "one_collective": "decompositions, one collective"}
    rows = []
    for m in _traffic_measures():
        for kind, label in names.items():
            rows.append((m["world"], label, f"{1000 * m['held_out'][kind]:.1f}", f"{1000 * m['predicted'][kind]:.1f}",
                         f"{100 * m['error'][kind]:+.0f} %"))
    return table(["nodes x 1 rank", "collective (held out)", "measured ms", "predicted ms", "error"], rows)


def _traffic_measures() -> list[Any]:
    names = [f"kfac_traffic_measure_{n}" for n in (2, 3, 4)]
    return [results(name) for name in names if (RESULTS / f"{name}.json").exists()]


@figure("traffic.fit")
def _traffic_fit() -> str:
    return "; ".join(f"{m['world']} nodes: α = {1e6 * m['alpha']:.0f} µs, B = {m['bandwidth'] / 1e6:.0f} MB/s"
                     for m in _traffic_measures())


@figure("traffic.ratio1")
def _traffic_ratio1() -> str:
    """K-FAC's payload bytes per step over the gradients', fraction 1, rank 0."""
    run = next(x for x in results("kfac_traffic_count")["runs"] if x["rank"] == 0 and x["fraction"] == 1.0)
    return times(sum(v["bytes"] for v in run["counted"].values()) / run["steps"] / run["gradient_bytes"], 1)


def _traffic_rows(ranks: int, frequencies: tuple[int, int]) -> list[dict[str, Any]]:
    return [r for r in results("kfac_traffic_predict")["rows"] if r["ranks"] == ranks
            and r["network"].startswith("HDR") and (r["factor_every"], r["inverse_every"]) == frequencies]


def _kfac_ms(row: dict[str, Any]) -> float:
    return 1000 * sum(v for k, v in row["seconds"].items() if k != "gradients")


def _best(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return min((r for r in rows if r["design"] == "one collective"), key=_kfac_ms)


def _variant(row: dict[str, Any]) -> str:
    if row["design"] == "broadcasts":
        return f"one broadcast per member ({'NCCL rings' if row['backend'] == 'nccl' else 'MPI trees'})"
    return f"one collective per group, {row['payload']}"


@figure("traffic.resnet1024")
def _traffic_resnet1024() -> str:
    """ResNet-50 on HDR100 at 1,024 ranks, decompositions every step: the former design on NCCL, the best now."""
    rows = _traffic_rows(1024, (1, 1))
    old = next(r for r in rows if r["design"] == "broadcasts" and r["backend"] == "nccl" and r["fraction"] == 1.0)
    best = _best(rows)
    grads = 1000 * best["seconds"]["gradients"]
    return (f"{_kfac_ms(old):.0f} ms a step before (fraction 1, NCCL), {_kfac_ms(best):.0f} ms now "
            f"(fraction {best['fraction']:g}, {best['payload']}: {times(_kfac_ms(best) / grads, 1)} the gradients' "
            f"{grads:.0f} ms)")


@figure("traffic.resnet1024.rare")
def _traffic_resnet1024_rare() -> str:
    """The same at kfac-pytorch's ImageNet frequencies (factors every 10 steps, decompositions every 100)."""
    best = _best(_traffic_rows(1024, (10, 100)))
    grads = 1000 * best["seconds"]["gradients"]
    return (f"{_kfac_ms(best):.1f} ms a step (fraction {best['fraction']:g}, {best['payload']}), "
            f"{times(_kfac_ms(best) / grads)} the gradients'")


@figure("traffic.resnet50")
def _traffic_resnet50() -> str:
    rows = []
    for row in results("kfac_traffic_predict")["rows"]:
        if not row["network"].startswith("HDR") or row["ranks"] not in (64, 256, 1024):
            continue
        sec = row["seconds"]
        rows.append((row["ranks"], f"{row['factor_every']}, {row['inverse_every']}", f"{row['fraction']:g}",
                     _variant(row), f"{1000 * sec['gradients']:.1f}", f"{1000 * sec['factors']:.1f}",
                     f"{1000 * sec['decompositions']:.1f}", f"{1000 * sec['directions']:.1f}",
                     times(_kfac_ms(row) / 1000 / sec["gradients"], 2)))
    return table(["ranks", "factors, decompositions every", "fraction", "sharing", "gradients ms", "factors ms",
                  "decompositions ms", "preconditioned gradients ms", "K-FAC / gradients"], rows)


# ---- the input pipeline (benchmarks/loader_throughput.py) ----------------------------------------------

PIPELINES = {"pil-folder": "old path: PIL decode + transforms, float32 batches",
             "folder-cpu": "libjpeg-turbo (torchvision.io) decode, uint8 batches, folder",
             "shards-cpu": "same, from shards"}


@figure("loader.table")
def _loader_table() -> str:
    r = results("loader_throughput_cpu")
    workers = list(r["pipeline_alone"])
    rows = [(label, *(f"{statistics.median(r['pipeline_alone'][w][key]):.1f}" for w in workers))
            for key, label in PIPELINES.items()]
    rows.append(("**new CPU path / old path** (target ≥ 1)",
                 *(f"**{times(r['ratios'][w]['folder-cpu/pil-folder'])}**" for w in workers)))
    return table(["images/s, pipeline alone", *(f"{w} worker{'s' if w != '1' else ''}" for w in workers)], rows)


@figure("loader.ratios")
def _loader_ratios() -> str:
    ratios = results("loader_throughput_cpu")["ratios"]
    return " / ".join(times(ratios[w]["folder-cpu/pil-folder"]) for w in ratios)


@figure("loader.shards")
def _loader_shards() -> str:
    ratios = results("loader_throughput_cpu")["ratios"]
    return " / ".join(times(ratios[w]["shards-cpu/folder-cpu"]) for w in ratios)


# ---- your own model: the transformer language model (benchmarks/transformer_lm.py) ----------------------

def _lm_run(method: str) -> str:
    run = results("transformer_lm")["runs"][method]
    if run["seconds_to_target"] is None:
        return f"not reached in {results('transformer_lm')['epochs']} epochs (best {run['best_test_loss']:.3f})"
    return f"{run['seconds_to_target']:.0f} s ({run['epochs_to_target']} epochs)"


@figure("lm.target")
def _lm_target() -> str:
    return f"{results('transformer_lm')['target']:g}"


@figure("lm.kfac")
def _lm_kfac() -> str:
    return _lm_run("kfac")


@figure("lm.adamw")
def _lm_adamw() -> str:
    return _lm_run("adamw")


@figure("lm.table")
def _lm_table() -> str:
    data = results("transformer_lm")
    rows = [(method, " ".join(run["flags"]), _lm_run(method), f"{run['best_test_loss']:.3f}",
             ", ".join(f"{loss:.3f}" for loss in run["losses"])) for method, run in data["runs"].items()]
    return table(["method", "flags", f"to validation loss {data['target']:g}", "best validation loss",
                  "validation loss after each epoch"], rows)


@figure("lm.load")
def _lm_load() -> str:
    data = results("transformer_lm")
    return f"{data['load_average'][1]:.1f} on {data['cores']} cores"


# ---- allreduce and the network (python -m hpcdl.bench.allreduce, benchmarks/network.py) ---------------

@figure("allreduce.ring")
def _ring() -> str:
    return f"{results('allreduce_np2')['acceptance']['ring']['min_ratio']:.2f}"


@figure("allreduce.horovod")
def _horovod() -> str:
    return (f"{results('allreduce_np2')['acceptance']['horovod']['min_ratio']:.2f} with its default 1 ms cycle and "
            f"{results('allreduce_np2_cycle0.03ms')['acceptance']['horovod']['min_ratio']:.2f} with a 0.03 ms one")


def _of_link(rate: str, nodes: int, implementation: str, size: int) -> float:
    entry = next(c for c in results("net_summary")["configs"] if (c["rate"], c["nodes"]) == (rate, nodes))
    return float(entry["implementations"][implementation]["of_link"][str(size)])


ALLREDUCE_SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 8 << 20, 16 << 20, 64 << 20, 256 << 20)
ALLREDUCE_IMPLEMENTATIONS = ("MPI.Allreduce", "horovod", "torch.distributed (gloo)", "naive", "ring",
                             "recursive_doubling", "rabenseifner")
ALLREDUCE_RUNS = {"np2": "allreduce_np2", "cycle": "allreduce_np2_cycle0.03ms"}


def _bandwidth(value: float) -> str:
    """Two decimals from 0.1 GB/s up, two significant digits below (one under 0.01)."""
    return f"{value:.2f}" if value >= 0.1 else f"{value:.2g}" if value >= 0.01 else f"{value:.1g}"


def _allreduce_table(name: str) -> str:
    rows = {(r["implementation"], r["bytes"]): r for r in results(name)["rows"]}
    lines = []
    for size in ALLREDUCE_SIZES:
        cells = []
        for implementation in ALLREDUCE_IMPLEMENTATIONS:
            row = rows.get((implementation, size))
            cell = "-" if row is None else _bandwidth(row["busbw_GBps"])
            if row is not None and size == ALLREDUCE_SIZES[0]:
                cell += f" ({row['latency_us']:.0f})"
            cells.append(cell)
        lines.append((_size(size), *cells))
    text = table(["size", *ALLREDUCE_IMPLEMENTATIONS], lines)
    return text.replace("|" + " --- |" * (len(ALLREDUCE_IMPLEMENTATIONS) + 1),
                        "| --- |" + " ---: |" * len(ALLREDUCE_IMPLEMENTATIONS))


def _size(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


for _key, _name in ALLREDUCE_RUNS.items():
    FIGURES[f"allreduce.{_key}.table"] = functools.partial(_allreduce_table, _name)


def _acceptance(name: str, who: str) -> str:
    entry = results(name)["acceptance"][who]
    ratios = {int(size): ratio for size, ratio in entry["ratios"].items()}
    lowest = min(ratios, key=lambda size: ratios[size])
    if entry["met"]:
        return f"**{entry['min_ratio']:.2f}** (met)"
    later = [r for size, r in ratios.items() if size > lowest]
    return (f"{entry['min_ratio']:.2f} at {_size(lowest)} (not met); {min(later):.2f}–{max(later):.2f} "
            f"from {_size(min(s for s in ratios if s > lowest))} up")


@figure("allreduce.acceptance")
def _acceptance_table() -> str:
    rows = [(f"{label}, lowest ratio", f"≥ {results('allreduce_np2')['acceptance'][who]['target']:.2f}",
             *(_acceptance(name, who) for name in ALLREDUCE_RUNS.values()))
            for who, label in (("ring", "our ring"), ("horovod", "Horovod"))]
    text = table(["", "target", "default run", "`--horovod-cycle-time-ms 0.03`"], rows)
    return text.replace("| --- | --- | --- | --- |", "| --- | ---: | ---: | ---: |")


@figure("allreduce.fit")
def _fit() -> str:
    first, second = (results(name)["alpha_beta"]["fitted_here"] for name in ALLREDUCE_RUNS.values())
    return (f"α = {first['alpha_us']:.1f} µs per step, B = {first['bandwidth_GBps']:.1f} GB/s (default run; "
            f"{second['alpha_us']:.1f} µs and {second['bandwidth_GBps']:.1f} GB/s in the second)")


@figure("allreduce.predictions")
def _predictions() -> str:
    rows = [(f"{p['ranks']:,}", f"{p['ring_ms']:.1f}", f"{p['ring_bandwidth_term_ms']:.1f}",
             f"{p['ring_with_alpha_fitted_here_ms']:.1f}", f"{p['naive_ms']:,.0f}")
            for p in results("allreduce_np2")["alpha_beta"]["predictions"]]
    text = table(["ranks", "ring, assumed network (ms)", "of which bandwidth (ms)", "ring with α fitted here (ms)",
                  "naive (ms)"], rows)
    return text.replace("| --- | --- | --- | --- | --- |", "| ---: | ---: | ---: | ---: | ---: |")


@figure("allreduce.alpha")
def _alpha() -> str:
    return f"{results('allreduce_np2')['alpha_beta']['fitted_here']['alpha_us']:.1f} µs"


@figure("allreduce.latency_term_4096")
def _latency_term() -> str:
    """The ring's 2(N-1)·α at 4,096 ranks with the α fitted here."""
    return f"{2 * 4095 * results('allreduce_np2')['alpha_beta']['fitted_here']['alpha_us'] / 1000:.0f} ms"


@figure("allreduce.naive_4096")
def _naive() -> str:
    prediction = next(p for p in results("allreduce_np2")["alpha_beta"]["predictions"] if p["ranks"] == 4096)
    return f"{prediction['naive_ms'] / 1000:.0f} s"


RATES = {"1gbit": "1 Gbit/s", "10gbit": "10 Gbit/s", "100mbit": "100 Mbit/s"}
MIB16, MIB32 = 16 << 20, 32 << 20


@figure("network.table")
def _network_table() -> str:
    rows = []
    def pair(entry: dict[str, Any], name: str, sizes: Sequence[int] = (MIB16, MIB32)) -> str:
        ratios = entry["implementations"].get(name, {}).get("of_link", {})
        return " / ".join(f"{ratios[str(size)]:.2f}x" for size in sizes) if ratios else "-"

    for e in results("net_summary")["configs"]:
        rows.append((RATES[e["rate"]], e["nodes"], pair(e, "MPI.Allreduce", (MIB16,)),
                     pair(e, "MPI.Allreduce", (MIB32,)), pair(e, "horovod"), pair(e, "ring"), pair(e, "MPI, put off")))
    return table(["link", "nodes", "MPI 16 MiB", "MPI 32 MiB", "Horovod 16 / 32 MiB", "ring 16 / 32 MiB",
                  "MPI, TCP put off, 16 / 32 MiB"], rows)


@figure("network.ab")
def _network_ab() -> str:
    runs = {"default": "put on (Open MPI's default), 1st", "putoff": "put off, 1st", "default2": "put on, 2nd",
            "putoff2": "put off, 2nd"}
    rows = []
    for suffix, label in runs.items():
        bandwidth = {(r["implementation"], r["bytes"]): r["busbw_GBps"]
                     for r in results(f"net_ab_1gbit_n2_{suffix}")["rows"]}
        rows.append((label, *(f"{bandwidth[name, size] / 0.125:.2f}x" for name in ("MPI.Allreduce", "ring")
                              for size in (MIB16, MIB32))))
    return table(["run", "MPI 16 MiB", "MPI 32 MiB", "ring 16 MiB", "ring 32 MiB"], rows)


@figure("network.fp16")
def _network_fp16() -> str:
    runs = results("net_fp16")["runs"]
    rows = []
    for rate in dict.fromkeys(r["rate"] for r in reversed(runs)):
        speed = {flag: [s for r in runs if r["rate"] == rate and r["fp16_allreduce"] == flag
                        for s in r["images_per_second"]] for flag in (False, True)}
        loads = [x for r in runs if r["rate"] == rate for x in r["load"]]
        cells = [f"{statistics.median(v):.0f} img/s ({min(v):.0f}-{max(v):.0f})" for v in speed.values()]
        ratio = statistics.median(speed[True]) / statistics.median(speed[False])
        rows.append((RATES[rate], *cells, f"{ratio:.2f}x", f"{min(loads):.1f}-{max(loads):.1f}"))
    return table(["link", "fp32 allreduce", "`--fp16-allreduce`", "ratio", "load"], rows)


@figure("network.best")
def _network_best() -> str:
    return f"{_of_link('1gbit', 2, 'MPI.Allreduce', 32 << 20):.2f}x"


# ---- the markers ---------------------------------------------------------------------------------------

def refreshed(text: str, where: str) -> tuple[str, list[str]]:
    """``text`` with every marked figure recomputed, and one line per figure that differed."""
    changes: list[str] = []

    def replace(match: re.Match[str]) -> str:
        name, old = match.group(1), match.group(2)
        if name not in FIGURES:
            raise SystemExit(f"{where}: unknown figure {name!r} (benchmarks/figures.py defines {len(FIGURES)})")
        try:
            new = FIGURES[name]()
        except Exception as exc:  # noqa: BLE001 - a results file cut short or of another shape: one line, named
            what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            changes.append(f"{where}: {name} cannot be computed from the results files in {RESULTS} ({what}); "
                           "is one of them from an interrupted or unfinished study?")
            return match.group(0)  # left as it is
        if new != old:
            changes.append(f"{where}: {name} is {old.strip()!r}, the results files give {new.strip()!r}")
        return f"<!--fig:{name}-->{new}<!--/fig-->"

    return MARKER.sub(replace, text), changes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if any figure differs")
    args = parser.parse_args(argv)
    differ = []
    for path in documents():
        text = path.read_text()
        new, changes = refreshed(text, str(path.relative_to(REPO)))
        differ += changes
        if changes and not args.check:
            path.write_text(new)
    print("\n".join(differ) if differ else f"every figure equals its results file ({len(FIGURES)} defined)")
    return 1 if differ and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
