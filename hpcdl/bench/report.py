"""Turning allreduce measurements into what people read: tables, CSV, JSON and a plot."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hpcdl.bench.sizes import format_size
from hpcdl.persistence.atomic import write_atomically, write_text_atomically

GB = 1e9  # bandwidths in GB/s (10^9 bytes), as OSU and nccl-tests report them


@dataclass(frozen=True)
class Row:
    """One implementation at one message size (times are the best round's average over ranks)."""

    implementation: str
    bytes: int
    elements: int
    ranks: int
    warmup: int
    iterations: int
    rounds: int
    latency_us: float
    latency_min_us: float  # fastest rank in that round
    latency_max_us: float  # slowest rank in that round

    @property
    def algbw_gbps(self) -> float:
        """Algorithm bandwidth: message bytes over time."""
        return self.bytes / (self.latency_us * 1e-6) / GB

    @property
    def busbw_gbps(self) -> float:
        """Bus bandwidth: algbw x 2(N-1)/N, what each rank's links carry in an optimal allreduce.

        Comparable across rank counts, and with the link's rated bandwidth (nccl-tests' convention).
        """
        return self.algbw_gbps * 2 * (self.ranks - 1) / self.ranks if self.ranks > 1 else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "algbw_GBps": self.algbw_gbps, "busbw_GBps": self.busbw_gbps}


COLUMNS = [*Row.__dataclass_fields__, "algbw_GBps", "busbw_GBps"]


def table(rows: Sequence[Row], implementations: Sequence[str], metric: str) -> str:
    """An OSU-style text table: one line per size, one column per implementation."""
    values = {(r.implementation, r.bytes): getattr(r, metric) for r in rows}
    sizes = sorted({r.bytes for r in rows})
    widths = [max(12, len(name) + 1) for name in implementations]
    unit = "latency (us)" if metric == "latency_us" else "bus bandwidth (GB/s)"
    header = "".join(f"{n:>{w}}" for n, w in zip(implementations, widths, strict=True))
    lines = [f"# {unit}", "# " + f"{'size':>10}" + header]
    for size in sizes:
        cells = []
        for name, width in zip(implementations, widths, strict=True):
            value = values.get((name, size))
            cells.append(f"{'-':>{width}}" if value is None else f"{value:>{width}.{_digits(metric, value)}f}")
        lines.append(f"  {format_size(size):>10}" + "".join(cells))
    return "\n".join(lines)


def _digits(metric: str, value: float) -> int:
    return 2 if metric == "latency_us" or value >= 0.1 else 4


def bandwidth_ratios(rows: Sequence[Row], numerator: str, denominator: str, from_bytes: int) -> dict[int, float]:
    """busbw(numerator) / busbw(denominator) at every size >= ``from_bytes`` both were measured at."""
    bw = {(r.implementation, r.bytes): r.busbw_gbps for r in rows}
    return {
        size: bw[(numerator, size)] / bw[(denominator, size)]
        for (name, size) in sorted(bw)
        if name == numerator and size >= from_bytes and (denominator, size) in bw
    }


def write_csv(path: Path, rows: Iterable[Row]) -> None:
    """Written atomically, like every result file: a failed write leaves the previous file, or none."""
    out = io.StringIO(newline="")
    writer = csv.DictWriter(out, fieldnames=COLUMNS)
    writer.writeheader()
    for row in rows:
        writer.writerow(row.as_dict())
    write_text_atomically(path, out.getvalue())


def write_json(path: Path, rows: Iterable[Row], **sections: Any) -> None:
    """Strict JSON: a value that is not finite (the bus bandwidth of one rank) is written as null."""
    document = {**sections, "rows": [row.as_dict() for row in rows]}
    write_text_atomically(path, json.dumps(_finite_or_null(document), indent=2, allow_nan=False) + "\n")


def _finite_or_null(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(item) for item in value]
    return value


def plot(path: Path, rows: Sequence[Row], implementations: Sequence[str], title: str) -> None:
    """Latency and bus bandwidth against message size, log-log, one line per implementation."""
    import matplotlib

    matplotlib.use("Agg")  # no display on compute nodes
    import matplotlib.pyplot as plt

    figure, (latency_axes, bandwidth_axes) = plt.subplots(1, 2, figsize=(13, 5))
    for name in implementations:
        mine = sorted((r for r in rows if r.implementation == name), key=lambda r: r.bytes)
        if not mine:
            continue
        sizes = [r.bytes for r in mine]
        latency_axes.plot(sizes, [r.latency_us for r in mine], marker="o", markersize=3, label=name)
        bandwidth_axes.plot(sizes, [r.busbw_gbps for r in mine], marker="o", markersize=3, label=name)
    for axes, label in ((latency_axes, "latency (µs)"), (bandwidth_axes, "bus bandwidth (GB/s)")):
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.set_xlabel("message size (bytes)")
        axes.set_ylabel(label)
        axes.grid(True, which="both", alpha=0.3)
    bandwidth_axes.legend(fontsize="small")
    figure.suptitle(title)
    figure.tight_layout()
    image = io.BytesIO()
    figure.savefig(image, dpi=120, format=path.suffix.lstrip(".") or "png")
    plt.close(figure)
    write_atomically(path, lambda handle: handle.write(image.getvalue()))
