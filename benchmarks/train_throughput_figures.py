"""The figures the documents quote from train_throughput.py's results: hpcdl.train against a bare loop."""

from __future__ import annotations

import statistics
from typing import Any

from figures import results, table, times

MODES = {"fp32": "fp32", "amp": "bf16 autocast", "amp+cl": "bf16 + channels_last"}


def _mode(mode: str) -> dict[str, Any]:
    return results("train_throughput_cpu")["modes"][mode]


def _rate(mode: str, who: str) -> float:
    return results("train_throughput_cpu")["batch"] / statistics.median(_mode(mode)[f"{who}_step_seconds"])


def _table() -> str:
    rows = [(label, f"{_rate(m, 'hpcdl'):.1f}", f"{_rate(m, 'bare'):.1f}", times(_mode(m)["speed_ratio"]),
             ", ".join(f"{r:.3f}" for r in _mode(m)["paired_speed_ratios"])) for m, label in MODES.items()]
    return table(["mode", "hpcdl.train img/s", "bare loop img/s", "ratio (median of pairs)", "each pair"], rows)


def _scaling() -> str:
    r = results("train_throughput_cpu")
    return (f"{100 * r['scaling_efficiency_2_ranks']:.0f} % ({r['images_per_second_1_rank']:.0f} → "
            f"{r['images_per_second_2_rank']:.0f} img/s)")


FIGURES = {"train.fp32.ratio": lambda: times(_mode("fp32")["speed_ratio"]), "train.table": _table,
           "train.scaling": _scaling}


# ---- Horovod against torch.distributed (--backends horovod torch --kfac; docs/cluster.md, README) ------------

BACKEND_RUNS = {"one host, 2 ranks": "train_throughput_backends_cpu",
                "2 virtual nodes x 1 rank, 1 Gbit/s": "train_throughput_backends_2nodes"}
ALLREDUCE_2NODES = "allreduce_2nodes_1gbit"  # python -m hpcdl.bench.allreduce on the same 2 virtual nodes
ALLREDUCE_ROWS = ("MPI.Allreduce", "horovod", "torch.distributed (gloo)")


def _torch_over_horovod(name: str, kfac: bool = False) -> float:
    """torch's images/s over Horovod's at 2 ranks; with K-FAC, inverted: torch's step time over Horovod's."""
    value = results(name)["torch_over_horovod_2_ranks" + ("_kfac" if kfac else "")]
    return 1 / value if kfac else value


def _one_to_two(figures: dict[str, Any]) -> str:
    return (f"{figures['images_per_second_1_rank']:.0f} → {figures['images_per_second_2_rank']:.0f} "
            f"({100 * figures['scaling_efficiency_2_ranks']:.0f} %)")


def _spread(figures: dict[str, Any]) -> str:
    runs = figures["runs"]["2"]
    return f"{min(runs):.0f}–{max(runs):.0f}"


def _backends_table() -> str:
    rows = []
    for where, name in BACKEND_RUNS.items():
        load = results(name)["load"]
        for suffix, what, compared in (("", "SGD", f"images/s {times(_torch_over_horovod(name))}"),
                                       ("+kfac", "K-FAC", f"step {times(_torch_over_horovod(name, kfac=True))}")):
            horovod, torch = (results(name)["backends"][b + suffix] for b in ("horovod", "torch"))
            rows.append((where, what, _one_to_two(horovod), _one_to_two(torch), compared,
                         f"{_spread(horovod)}; {_spread(torch)}", f"{min(load):.1f}–{max(load):.1f}"))
    return table(["where", "", "Horovod img/s, 1 → 2 ranks", "torch (Gloo) img/s, 1 → 2 ranks",
                  "torch / Horovod, 2 ranks", "2-rank rounds, Horovod; torch", "load"], rows)


def _allreduce_2nodes() -> str:
    rows = {(r["implementation"], r["bytes"]): r["busbw_GBps"] for r in results(ALLREDUCE_2NODES)["rows"]}
    sizes = sorted({size for (_, size) in rows if size >= 1 << 20})
    return table(["size", *ALLREDUCE_ROWS],
                 [(f"{size >> 20} MiB", *(f"{rows[who, size]:.3f}" for who in ALLREDUCE_ROWS)) for size in sizes])


ONE_HOST, TWO_NODES = BACKEND_RUNS.values()
FIGURES |= {"backends.table": _backends_table, "backends.allreduce_2nodes": _allreduce_2nodes,
            "backends.ratio": lambda: times(_torch_over_horovod(ONE_HOST)),
            "backends.kfac": lambda: times(_torch_over_horovod(ONE_HOST, kfac=True)),
            "backends.2nodes.ratio": lambda: times(_torch_over_horovod(TWO_NODES)),
            "backends.2nodes.kfac": lambda: times(_torch_over_horovod(TWO_NODES, kfac=True))}
