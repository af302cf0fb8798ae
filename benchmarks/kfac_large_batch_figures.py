"""The figures the documents quote from kfac_large_batch.py's results, by its own summaries.

A results file is named ``NAME`` or ``NAME@B1,B2`` (only those global batches of it). Times to a target are medians
over seeds that count a seed that never got there as beyond the budget (:func:`studies.median_or_inf`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import statistics
from collections.abc import Sequence
from typing import Any

from figures import percent, results, table, times
from kfac_large_batch import TUNE_LRS, Outcome, beats_kfac, best_rows, markdown, most_accurate, selected
from studies import median_or_inf

TARGET_CELL = ("kfac_large_batch_target_quiet", "kfac_large_batch_target_quiet_others")
OTHER_BATCHES = ("kfac_large_batch_512@512", "kfac_large_batch_kfac_2048_8192", "kfac_large_batch_fo_2048_8192")
TABLES = {
    "target": TARGET_CELL,
    "ablation": ("kfac_large_batch_kfac_lrs", "kfac_large_batch_ablation_damping", "kfac_large_batch_ablation_every5",
                 "kfac_large_batch_ablation_momentum", "kfac_large_batch_ablation_all_examples"),
    "batches": OTHER_BATCHES,
    "reduced": ("kfac_large_batch_reduced",),
    "sweep": ("kfac_large_batch_sweep",),
    "ramp": ("kfac_large_batch_ramp_reduced", "kfac_large_batch_target_kfac", "kfac_large_batch_lamb04",
             "kfac_large_batch_lamb08", "kfac_large_batch_fo_s1", "kfac_large_batch_sgd05", "kfac_large_batch_sgd025",
             "kfac_large_batch_kfp_native", "kfac_large_batch_kfp_native_s1", "kfac_large_batch_kfac_d1",
             "kfac_large_batch_kfac_d10", "kfac_large_batch_kfac_kfpdamping"),
}
# The equal-budget study (--tune): every method's best of 2 rates x 2 warm-ups on seed 0, then seeds 1 and 2; one
# results file per global batch.
TUNE = {4096: "kfac_large_batch_tune", 8192: "kfac_large_batch_tune_8192"}
NAMES = {"kfac": "hpcdl's K-FAC", "muon": "Muon", "soap": "SOAP", "adamw": "AdamW", "lamb": "LAMB", "lars": "LARS",
         "sgd": "SGD", "kfac-pytorch-native": "kfac-pytorch"}
# The reduced rerun (--target-cell --tuned-from the batch-4096 tuning, seed 0): every method side by side on one
# machine, later than the tuning.
RERUN = "kfac_large_batch_rerun"


def outcomes(*sources: str) -> list[Outcome]:
    with contextlib.redirect_stderr(io.StringIO()):  # old results name deprecated flags: hpcdl.train says so
        return [o for source in sources for o in selected(source, results)]


@functools.cache
def _rows(*sources: str) -> dict[tuple[str, int], dict[str, Any]]:
    """(method, batch) -> the summary row of its best rate (the highest median final accuracy)."""
    return most_accurate(outcomes(*sources))


def _cell(method: str, batch: int = 4096, sources: Sequence[str] = TARGET_CELL) -> dict[str, Any]:
    return _rows(*sources)[method, batch]


def _ratio985() -> str:
    """K-FAC's training seconds to 98.5 % over the fastest first-order method's, in the target cell."""
    first_order = [r for (m, b), r in _rows(*TARGET_CELL).items() if b == 4096 and m in ("sgd", "lamb", "lars")]
    fastest = min((r for r in first_order if r["seconds_98.5"] is not None), key=lambda r: r["seconds_98.5"])
    return times(_cell("kfac")["seconds_98.5"] / fastest["seconds_98.5"])


def _step_ratio(other: str) -> str:
    return times(_cell("kfac")["seconds_per_step"] / _cell(other)["seconds_per_step"])


def _ratio2048(target: str, digits: int) -> str:
    kfac, lars = _cell("kfac", 2048, OTHER_BATCHES), _cell("lars", 2048, OTHER_BATCHES)
    return times(kfac[f"seconds_{target}"] / lars[f"seconds_{target}"], digits)


def _tuned(batch: int) -> dict[str, dict[str, Any]]:
    """Per method, the summary row of its tuned setting (the one run on the most seeds)."""
    return best_rows(outcomes(f"{TUNE[batch]}@{batch}"), batch)


def _reached(row: dict[str, Any], target: str, what: str, form: str) -> str:
    """A median over seeds, naming how many got to ``target`` when not all did."""
    value, reached = row[f"{what}_{target}"], row[f"reached_{target}"]
    done, runs = reached.split("/")
    if value is None:
        return "not reached"
    return format(value, form) + (f" ({reached} seeds)" if done != runs else "")


def _tune_table(batch: int) -> str:
    rows = sorted(_tuned(batch).values(), key=lambda r: -(r["median_final"] or 0))
    return table(["method", "peak lr", "warm-up (epochs)", "final accuracy, median of 3 seeds (each)",
                  "steps to 98.5 %", "training s to 98.5 %", "steps to 99.0 %", "ms / step"],
                 [(NAMES[r["method"]], f"{r['lr']:g}", f"{r['warmup']:g}",
                   f"{percent(r['median_final'])} ({', '.join(f'{100 * a:.2f}' for a in r['final_accuracy'])})",
                   _reached(r, "98.5", "steps", "g"), _reached(r, "98.5", "seconds", ".0f"),
                   _reached(r, "99.0", "steps", "g"),
                   f"{1000 * r['seconds_per_step']:.0f}") for r in rows])


def _tune_first(batch: int) -> str:
    """Who beats hpcdl's K-FAC at ``batch``: more accurate, or faster to 98.5 % (the study's verdict)."""
    rows = _tuned(batch)
    return beats_kfac(rows["kfac"], [r for m, r in rows.items() if m != "kfac"])


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
    return f"{times(rows['kfac']['seconds_98.5'] / fastest['seconds_98.5'])} {NAMES[fastest['method']]}'s"


def _tune_headline(batch: int) -> str:
    rows = _tuned(batch)
    kfac = rows.pop("kfac")
    ranked = sorted(rows.values(), key=lambda r: -(r["median_final"] or 0))
    return f"K-FAC {percent(kfac['median_final'])}; " + ", ".join(
        f"{NAMES[r['method']]} {percent(r['median_final'])}" for r in ranked[:3])


def _tune_edge(batch: int) -> str:
    """The methods whose tuned rate is the larger of their two: more rate might have served them better."""
    edge = [NAMES[m] for m, r in sorted(_tuned(batch).items(), key=lambda item: -(item[1]["median_final"] or 0))
            if r["lr"] == max(TUNE_LRS[m])]
    return ", ".join(edge) if edge else "none"


def _by_method(*sources: str) -> dict[str, Outcome]:
    return {o.cell.method: o for o in outcomes(*sources)}


def _rerun_ratio(name: str = RERUN) -> str:
    """K-FAC's steps and training seconds to 98.5 % against Muon's in the rerun (seed 0, one machine)."""
    runs = _by_method(name)
    kfac, muon = runs["kfac"].to_target(0.985), runs["muon"].to_target(0.985)
    assert kfac is not None and muon is not None
    return (f"{times(kfac[1] / muon[1])} Muon's ({kfac[0]} steps, {kfac[1]:.0f} s against {muon[0]} steps, "
            f"{muon[1]:.0f} s)")


def _rerun_steps() -> str:
    """Seconds per step of hpcdl's K-FAC, Muon and kfac-pytorch, side by side in the rerun."""
    step = {m: o.seconds_per_step or 0.0 for m, o in _by_method(RERUN).items()}
    return (f"{1000 * step['kfac']:.0f} ms a step for hpcdl's K-FAC, {1000 * step['muon']:.0f} ms for Muon, "
            f"{1000 * step['kfac-pytorch-native']:.0f} ms for kfac-pytorch "
            f"({times(step['kfac-pytorch-native'] / step['kfac'], 1)} K-FAC's)")


def _steps_to_985(outcome: Outcome) -> str:
    hit = outcome.to_target(0.985)
    return "not reached" if hit is None else str(hit[0])


def _rerun_verdict(name: str = "kfac_large_batch_rerun_amortized") -> str:
    """The one-host verdict of a rerun: the most accurate method and the first to 98.5 %, with K-FAC's figures."""
    runs = _by_method(name)
    best = max(runs.values(), key=lambda o: o.final_accuracy or 0.0)
    reached = {method: hit for method, o in runs.items() if (hit := o.to_target(0.985)) is not None}
    first = min(reached, key=lambda method: reached[method][1])  # by training seconds
    kfac = runs["kfac"]
    return (f"the most accurate: {NAMES[best.cell.method]} ({percent(best.final_accuracy or 0.0)}); "
            f"the first to 98.5 %: {NAMES[first]}; K-FAC against Muon: {_rerun_ratio(name)}, final "
            f"{percent(kfac.final_accuracy or 0.0)} against {percent(runs['muon'].final_accuracy or 0.0)}")


def _rerun_finals() -> str:
    """Each method's final accuracy in the rerun against its seed-0 tuning run (the same command, another machine)."""
    tuned = {(o.cell.method, o.cell.lr, o.cell.warmup): o for o in outcomes(TUNE[4096]) if o.cell.seed == 0}
    rows = []
    for o in sorted(outcomes(RERUN), key=lambda o: -(o.final_accuracy or 0)):
        then = tuned[(o.cell.method, o.cell.lr, o.cell.warmup)]
        rows.append((NAMES[o.cell.method], percent(then.final_accuracy or 0.0), percent(o.final_accuracy or 0.0),
                     _steps_to_985(then), _steps_to_985(o)))
    return table(["method", "final, tuning run", "final, rerun", "steps to 98.5 %, tuning run",
                  "steps to 98.5 %, rerun"], rows)


def _median_final(runs: Sequence[Outcome]) -> float:
    return statistics.median(o.final_accuracy or 0.0 for o in runs)


def _median_step(runs: Sequence[Outcome]) -> float:
    return statistics.median(o.seconds_per_step or 0.0 for o in runs)


def _steps_to(runs: Sequence[Outcome], goal: float) -> str:
    """The median over seeds of the steps to ``goal`` (a seed that never got there beyond the budget)."""
    hits = [o.to_target(goal) for o in runs]
    median = median_or_inf([hit and hit[0] for hit in hits])
    reached = f"({sum(hit is not None for hit in hits)}/{len(runs)} seeds)"
    return "never " + reached if median == float("inf") else f"{median:g} steps {reached}"


def _resnet_verdict() -> str:
    """mnist_resnet, each method's tuned setting, medians over the seeds run: K-FAC (preset unchanged) against the
    most accurate other method, and the steps each took to that method's median final accuracy."""
    by_method: dict[str, list[Outcome]] = {}
    for o in outcomes("kfac_large_batch_resnet"):
        by_method.setdefault(o.cell.method, []).append(o)
    seeds = len({o.cell.seed for runs in by_method.values() for o in runs})
    kfac = by_method.pop("kfac")
    best = max(by_method, key=lambda m: _median_final(by_method[m]))
    goal = _median_final(by_method[best])
    return (f"K-FAC {percent(_median_final(kfac))} against {NAMES[best]}'s {percent(goal)} (medians of {seeds} "
            f"seeds); to {percent(goal)}: K-FAC {_steps_to(kfac, goal)}, "
            f"{NAMES[best]} {_steps_to(by_method[best], goal)}")


def _ratio_985(runs: Sequence[Outcome], other: str) -> tuple[float, int]:
    """The median over seeds of K-FAC's training seconds to 98.5 % over ``other``'s on the same seed (a seed's two
    runs ran on one machine, side by side; seeds may not have; a miss counts as beyond the budget), and the seeds."""
    seconds: dict[int, dict[str, float | None]] = {}
    for o in runs:
        hit = o.to_target(0.985)
        seconds.setdefault(o.cell.seed, {})[o.cell.method] = hit and hit[1]
    pairs = [(s["kfac"], s[other]) for s in seconds.values() if "kfac" in s and other in s]
    return median_or_inf([mine and (mine / theirs if theirs else 0.0) for mine, theirs in pairs]), len(pairs)


def _kfac_against(name: str) -> tuple[str, float, int, dict[str, float]]:
    """The method K-FAC ran beside in results file ``name``, :func:`_ratio_985` against it, and each one's median
    seconds per step."""
    runs = outcomes(name)
    other = next(o.cell.method for o in runs if o.cell.method != "kfac")
    step = {m: _median_step([o for o in runs if o.cell.method == m]) for m in ("kfac", other)}
    return (other, *_ratio_985(runs, other), step)


def _two_nodes() -> str:
    """K-FAC's training seconds to 98.5 % over the other method's on 2 virtual nodes x 2 ranks, and on one host with
    one rank: the same settings and seeds, one run at a time on one machine (medians of per-seed ratios)."""
    other, on_nodes, seeds, _ = _kfac_against("kfac_large_batch_2nodes")
    on_host = _ratio_985(outcomes("kfac_large_batch_1host"), other)[0]
    return (f"{times(on_nodes)} {NAMES[other]}'s on 2 nodes x 2 ranks over 1 Gbit/s, {times(on_host)} on one "
            f"host (1 rank; medians over {seeds} seeds of each seed's ratio)")


def _two_nodes_steps() -> str:
    """Seconds per step of each method on 2 nodes and on one host (medians over seeds)."""
    parts = []
    for name, where in (("kfac_large_batch_2nodes", "2 nodes"), ("kfac_large_batch_1host", "one host")):
        step = _kfac_against(name)[3]
        parts.append(f"{where}: K-FAC {1000 * step['kfac']:.0f} ms, Muon {1000 * step['muon']:.0f} ms "
                     f"({times(step['kfac'] / step['muon'])})")
    return "; ".join(parts)


def _two_by_one(name: str) -> str:
    """2 virtual nodes x 1 rank (1 thread each, 1 Gbit/s): K-FAC's step over Muon's and its training seconds to
    98.5 % over Muon's (medians over seeds of per-seed ratios), the same settings and seeds one run at a time."""
    other, ratio, seeds, step = _kfac_against(name)
    return (f"K-FAC {1000 * step['kfac']:.0f} ms a step, {NAMES[other]} {1000 * step[other]:.0f} ms "
            f"({times(step['kfac'] / step[other])}); time to 98.5 %: {times(ratio)} {NAMES[other]}'s ({seeds} seeds)")


def _two_by_one_short(name: str) -> str:
    other, ratio, _, step = _kfac_against(name)
    return f"{times(ratio)} {NAMES[other]}'s time, its step {times(step['kfac'] / step[other])}"


def _variants(base: str, variant: str) -> dict[str, dict[str, float]]:
    """K-FAC's runs of results file ``base`` and every run of ``variant`` (the same cell and seeds): each side's
    median final accuracy, steps to 98.5 % (a miss beyond the budget) and seconds per step, and the seeds."""
    runs = {"base": [o for o in outcomes(base) if o.cell.method == "kfac"], "variant": outcomes(variant)}
    return {side: dict(final=_median_final(each), step=1000 * _median_step(each), seeds=len(each),
                       steps=median_or_inf([hit and hit[0] for hit in (o.to_target(0.985) for o in each)]))
            for side, each in runs.items()}


def _two_by_one_bf16() -> str:
    """K-FAC with --kfac-comm-precision bf16 against the fp32 payload, the same cell and seeds (2 nodes x 1 rank)."""
    fp32, bf16 = _variants("kfac_large_batch_2x1", "kfac_large_batch_2x1_bf16").values()
    return (f"final accuracy {percent(bf16['final'])} with bf16 against {percent(fp32['final'])} with fp32, "
            f"{bf16['steps']:.0f} steps to 98.5 % against {fp32['steps']:.0f} (medians of {bf16['seeds']} seeds)")


def _two_by_one_bf16_factors() -> str:
    """K-FAC with both payloads in bf16 (--kfac-comm-precision and --kfac-factor-precision) against fp32, both
    under --backend torch (Horovod cannot sum bf16), the same cell and seeds (2 nodes x 1 rank)."""
    fp32, bf16 = _variants("kfac_large_batch_2x1_torch", "kfac_large_batch_2x1_torch_bf16").values()
    return (f"final accuracy {percent(bf16['final'])} with both in bf16 against {percent(fp32['final'])} with fp32, "
            f"{bf16['steps']:.0f} steps to 98.5 % against {fp32['steps']:.0f}, {bf16['step']:.0f} against "
            f"{fp32['step']:.0f} ms a step (medians of {bf16['seeds']} seeds)")


def _two_by_one_reduce() -> str:
    """K-FAC with --kfac-conv-approx reduce against expand (the preset's), Horovod, 2 nodes x 1 rank, same seeds."""
    expand, reduce = _variants("kfac_large_batch_2x1", "kfac_large_batch_2x1_reduce").values()
    return (f"{reduce['steps']:.0f} steps to 98.5 % against expand's {expand['steps']:.0f}, "
            f"{reduce['step']:.0f} against {expand['step']:.0f} ms a step, final "
            f"{percent(reduce['final'])} against {percent(expand['final'])} (medians of {reduce['seeds']} seeds)")


def _one_host_halved() -> str:
    """Steps to 98.5 % (per seed) and median final accuracy on one host of K-FAC with the preset's earlier values,
    with only its decompositions every 2nd step, and with only its statistics from 256 examples."""
    parts = []
    for label, name in (("the earlier values", "kfac_large_batch_1host"),
                        ("decompositions every 2nd step", "kfac_large_batch_1host_inv2"),
                        ("statistics of 256 examples", "kfac_large_batch_1host_stats256")):
        runs = sorted((o for o in outcomes(name) if o.cell.method.startswith("kfac")), key=lambda o: o.cell.seed)
        steps = "/".join(_steps_to_985(o) for o in runs)
        parts.append(f"{label}: {steps} steps to 98.5 %, final {percent(_median_final(runs))}")
    return f"{'; '.join(parts)} (seeds {'/'.join(str(o.cell.seed) for o in runs)})"


# The cells run with two of the preset's values: those of 2026-11-27 (eigen) beside the earlier ones.
PRESET_PAIRS = (("kfac_large_batch_2x1_amortized", "kfac_large_batch_2x1"),
                ("kfac_large_batch_2x1_amortized_torch", "kfac_large_batch_2x1_torch"),
                ("kfac_large_batch_2nodes_amortized", "kfac_large_batch_2nodes"),
                ("kfac_large_batch_2nodes_amortized_torch", "kfac_large_batch_2nodes_torch"),
                ("kfac_large_batch_rerun_amortized", RERUN))


def _presets_steps() -> str:
    """K-FAC's steps to 98.5 % summed over every run of the cells run with both of the preset's values, and the
    range of its final accuracies, the values of 2026-11-27 against the earlier ones."""
    parts = []
    for side in (0, 1):
        runs = [o for pair in PRESET_PAIRS for o in outcomes(pair[side]) if o.cell.method == "kfac"]
        hits = [o.to_target(0.985) for o in runs]
        assert all(hits), "every K-FAC run of these cells reached 98.5 %"
        finals = [o.final_accuracy or 0.0 for o in runs]
        parts.append((sum(hit[0] for hit in hits if hit), f"{percent(min(finals))}-{percent(max(finals))}"))
    (now, now_range), (then, then_range) = parts
    return (f"K-FAC took {now} steps to 98.5 % in all with the values of 2026-11-27 against {then} with the earlier "
            f"ones, and ended at {now_range} against {then_range}")


def _one_host_ratio() -> str:
    """The batch-4096 time target repeated: K-FAC's and Muon's tuned settings, seeds 0-2, one rank, each run alone,
    on the later machine (median of per-seed ratios of training seconds to 98.5 %)."""
    other, ratio, seeds, _ = _kfac_against("kfac_large_batch_1host")
    return f"{times(ratio)} {NAMES[other]}'s ({seeds} seeds, each run alone)"


def _two_nodes_fraction() -> str:
    """The 2-node cell with K-FAC at grad-worker fraction 0.25 (one gradient worker per layer on 4 ranks: the
    preconditioned gradients are broadcast instead of the decompositions) against the same Muon runs."""
    quarter = [dataclasses.replace(o, cell=dataclasses.replace(o.cell, method="kfac"))
               for o in outcomes("kfac_large_batch_2nodes_fraction")]
    muon = [o for o in outcomes("kfac_large_batch_2nodes") if o.cell.method == "muon"]
    ratio, seeds = _ratio_985(quarter + muon, "muon")
    return f"{times(ratio)} Muon's time to 98.5 % ({seeds} seeds), {1000 * _median_step(quarter):.0f} ms a step"


def _reduced_seconds() -> str:
    r = results("kfac_large_batch_reduced")
    return f"{r['meta']['seconds']:.0f} s for its {len(r['runs'])} runs"


def _rerun_seconds() -> str:
    r = results(RERUN)
    return f"{r['meta']['seconds'] / 60:.1f} minutes for its {len(r['runs'])} runs, 2 at a time"


FIGURES = {
    **{f"lb.{key}.table": functools.partial(lambda s: "\n" + "\n".join(markdown(outcomes(*s))) + "\n", sources)
       for key, sources in TABLES.items()},
    **{f"lb.{method}.final": functools.partial(lambda m: percent(_cell(m)["median_final"]), method)
       for method in ("sgd", "lamb", "lars", "kfac", "kfac-pytorch-native")},
    **{f"lb.{method}.step_ms": functools.partial(lambda m: f"{1000 * _cell(m)['seconds_per_step']:.0f} ms", method)
       for method in ("sgd", "lamb", "lars", "kfac")},
    **{f"lb.{method}.to985": functools.partial(
        lambda m: f"{_cell(m)['seconds_98.5']:.0f} s ({_cell(m)['steps_98.5']:.0f} steps)", method)
       for method in ("lamb", "lars", "kfac")},
    **{f"lb.8192.{method}.final": functools.partial(lambda m: percent(_cell(m, 8192, OTHER_BATCHES)["median_final"]),
                                                    method) for method in ("lamb", "lars", "kfac")},
    "lb.kfac.seeds": lambda: " / ".join(f"{100 * a:.2f}" for a in _cell("kfac")["final_accuracy"]),
    "lb.ratio985": _ratio985,
    "lb.kfac_vs_sgd_step": lambda: _step_ratio("sgd"), "lb.kfac_vs_lamb_step": lambda: _step_ratio("lamb"),
    "lb.kfac_vs_kfp_step": lambda: _step_ratio("kfac-pytorch-native"),
    "lb.kfp.step_s": lambda: f"{_cell('kfac-pytorch-native')['seconds_per_step']:.2f} s",
    "lb.2048.ratio985": lambda: _ratio2048("98.5", 2), "lb.2048.ratio990": lambda: _ratio2048("99.0", 1),
    "lb.reduced.seconds": _reduced_seconds,
    **{f"lb.{key}.{name}": functools.partial(function, batch) for batch, key in ((4096, "tune"), (8192, "tune8192"))
       for name, function in (("table", _tune_table), ("ratio", _tune_ratio), ("headline", _tune_headline),
                              ("edge", _tune_edge))},
    "lb.tune8192.first": lambda: _tune_first(8192),
    "lb.rerun.seconds": _rerun_seconds, "lb.rerun.ratio": _rerun_ratio, "lb.rerun.steps": _rerun_steps,
    "lb.rerun.finals": _rerun_finals, "lb.resnet.verdict": _resnet_verdict,
    "lb.2nodes.ratio": _two_nodes, "lb.2nodes.earlier": lambda: _two_by_one("kfac_large_batch_2nodes"),
    "lb.2nodes.steps": _two_nodes_steps, "lb.2nodes.fraction": _two_nodes_fraction,
    "lb.2x1.verdict": lambda: _two_by_one("kfac_large_batch_2x1_amortized"),
    "lb.2x1.short": lambda: _two_by_one_short("kfac_large_batch_2x1_amortized"),
    "lb.2x1.torch": lambda: _two_by_one("kfac_large_batch_2x1_amortized_torch"),
    "lb.2x1.earlier": lambda: _two_by_one("kfac_large_batch_2x1"),
    "lb.2x1.earlier.torch": lambda: _two_by_one("kfac_large_batch_2x1_torch"),
    "lb.2x1.bf16": _two_by_one_bf16, "lb.rerun.amortized": _rerun_verdict,
    "lb.2nodes.earlier.torch": lambda: _two_by_one("kfac_large_batch_2nodes_torch"),
    "lb.2nodes.amortized": lambda: _two_by_one("kfac_large_batch_2nodes_amortized"),
    "lb.2nodes.torch": lambda: _two_by_one("kfac_large_batch_2nodes_amortized_torch"),
    "lb.2nodes.amortized.short": lambda: _two_by_one_short("kfac_large_batch_2nodes_amortized"),
    "lb.2x1.bf16factors": _two_by_one_bf16_factors,
    "lb.2x1.reduce": _two_by_one_reduce,
    "lb.1host.ratio": _one_host_ratio, "lb.1host.halved": _one_host_halved, "lb.presets.steps": _presets_steps,
}
