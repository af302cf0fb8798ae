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
