"""benchmarks/network.py's report: ratios to the link and the held-out check, from made-up result files.

No processes and no cluster: the files the phases write are made here from a known alpha and B,
so the figures the report derives (and benchmarks/results/network.md quotes) can be checked against the arithmetic.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from hpcdl.bench import alphabeta, timing
from hpcdl.bench.report import Row
from tests.support.scripts import load_benchmark

network = load_benchmark("network")

SIZES = timing.message_sizes(1 << 20, 32 << 20)


def bench_file(path: Path, ranks: int, models: dict[str, alphabeta.AlphaBeta]) -> None:
    rows = []
    for name, model in models.items():
        for size in SIZES:
            us = model.ring_seconds(size, ranks) * 1e6
            rows.append(Row(name, size, size // 4, ranks, 3, 2, 2, us, us, us).as_dict())
    path.write_text(json.dumps({"meta": {"load_average_1min": {"before": 1.0, "after": 2.0}}, "rows": rows}))


def args(**overrides) -> argparse.Namespace:
    return network.parse_args(["--rates", "1gbit", "--nodes", "2", "4", *overrides.get("extra", [])])


def test_ratios_to_the_link_and_the_held_out_prediction(tmp_path: Path) -> None:
    link = alphabeta.network(1, 0)  # 1 Gbit/s = 0.125 GB/s, no latency
    half = alphabeta.AlphaBeta(200e-6, link.bandwidth / 2)
    for ranks in (2, 4):
        bench_file(tmp_path / f"net_1gbit_n{ranks}.json", ranks, {"MPI.Allreduce": link, "ring": half})
    bench_file(tmp_path / "net_1gbit_n2_noput.json", 2, {"MPI.Allreduce": half})
    summary = network.summarise(args(), tmp_path)
    assert [(c["rate"], c["nodes"]) for c in summary["configs"]] == [("1gbit", 2), ("1gbit", 4)]
    two = summary["configs"][0]["implementations"]
    assert two["MPI.Allreduce"]["of_link"][str(16 << 20)] == pytest.approx(1.0)  # bus bandwidth = link rate
    assert set(two) == {"MPI.Allreduce", "ring", network.MPI_NO_PUT}  # the put-off run joins as its own row
    ring_fit = two["ring"]["alpha_beta"]
    assert ring_fit["alpha_us"] == pytest.approx(200, rel=1e-6)
    assert ring_fit["bandwidth_GBps"] == pytest.approx(0.0625, rel=1e-9)
    assert ring_fit["held_out_bytes"] == 32 << 20 and ring_fit["error"] == pytest.approx(0, abs=1e-9)
    assert "horovod" not in two  # none in these files
    assert "alpha_beta" in summary["configs"][1]["implementations"]["MPI.Allreduce"]  # 4 nodes fitted too


def test_the_held_out_size_must_be_a_measured_one() -> None:
    with pytest.raises(SystemExit):
        network.parse_args(["--held-out", "64M", "--max-size", "32M"])
