"""The network, measured: allreduce on virtual nodes behind shaped links, against the link itself.

    .venv/bin/python benchmarks/network.py                          # everything; results under runs/bench/
    .venv/bin/python benchmarks/network.py --refresh-results        # into benchmarks/results/net_*
    .venv/bin/python benchmarks/network.py --phases report --output-dir benchmarks/results

Needs root (network namespaces, tc) and iperf3. Each phase brings up its own virtual cluster
(``hpcdl.tools.vcluster``, one rank per node) and takes it down again, even when a run fails:

* ``links``: iperf3 between two nodes, one way and both ways: what TCP gets through the link
  (the ceiling no MPI can beat), for every rate;
* ``probe``: ``hpcdl.bench.probe`` on two nodes, call by call, with the bytes each node put on the
  wire: a one-way message, a two-way exchange, MPI_Allreduce with Open MPI's choice and with each
  of its algorithms forced, and with the TCP transport's emulated RDMA (``put``) switched off;
* ``volume``: the same MPI_Allreduce probe on 3 and more nodes at the first rate, Open MPI's choice
  and each large-message algorithm forced: time per call and bytes per node on the wire;
* ``allreduce``: ``hpcdl.bench.allreduce`` (MPI, Horovod, our ring) for every rate and node count;
* ``fp16``: ``hpcdl.train`` with and without ``--fp16-allreduce`` on two nodes, alternating
  (A B B A) on each slow rate, images/s of every epoch after the first;
* ``report``: bus bandwidth / link rate per size, the alpha-beta model fitted to all sizes but one
  and checked on that one (``net_summary.json``, whose tables benchmarks/figures.py writes into network.md).

The machine's 1-minute load average is recorded beside every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from figures import results, save_json, table  # noqa: E402

from hpcdl.bench import alphabeta  # noqa: E402
from hpcdl.bench.sizes import format_size, parse_size  # noqa: E402
from hpcdl.persistence import outputs  # noqa: E402
from hpcdl.runtime.errors import UsageError, run_main  # noqa: E402
from hpcdl.runtime.numbers import integer  # noqa: E402
from hpcdl.tools import vcluster  # noqa: E402

PHASES = ("links", "probe", "volume", "allreduce", "fp16", "report")
MPI_NO_PUT = "MPI, put off"
IMPLEMENTATIONS = ("MPI.Allreduce", "horovod", "ring", MPI_NO_PUT)
NO_PUT = "--mca btl_tcp_flags send,inplace,need-ack,need-csum"  # Open MPI 4.1's default minus put
ALGORITHMS = {1: "basic_linear", 2: "nonoverlapping", 3: "recursive_doubling", 4: "ring", 5: "segmented_ring",
              6: "rabenseifner"}
ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMP_NUM_THREADS": "1",
       "PYTHONUNBUFFERED": "1"}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmarks/network.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    parser.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"], help="link rates (tc syntax)")
    parser.add_argument("--nodes", nargs="+", type=integer(2, 8), default=[2, 3, 4], help="node counts (one rank each)")
    parser.add_argument("--min-size", type=parse_size, default=1 << 20)
    parser.add_argument("--max-size", type=parse_size, default=32 << 20)
    parser.add_argument("--held-out", type=parse_size, default=32 << 20,
                        help="size left out of the alpha-beta fit and predicted (default 32M: extrapolation)")
    parser.add_argument("--probe-size", type=parse_size, default=16 << 20)
    parser.add_argument("--probe-calls", type=integer(1), default=10)
    parser.add_argument("--rounds", type=integer(1), default=2, help="rounds of hpcdl.bench.allreduce (default 2)")
    parser.add_argument("--fp16-rates", nargs="+", default=["1gbit", "100mbit"])
    parser.add_argument("--fp16-pairs", type=integer(1), default=1, help="A B B A blocks per rate (default 1)")
    parser.add_argument("--train-args", default="--dataset synthetic --synthetic-shape 1 8 8 --synthetic-size 16384 "
                                                "--model digits_cnn --epochs 3 --batch-size 32",
                        help="hpcdl.train arguments for the fp16 phase")
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="where the results go (default: a new folder under runs/bench/network/)")
    outputs.add_arguments(parser)
    args = parser.parse_args(argv)
    for rate in {*args.rates, *args.fp16_rates}:
        if not vcluster.RATE_RE.match(rate):
            parser.error(f"a rate looks like 1gbit, 100mbit or 10gbit, got {rate!r}")
    if not args.min_size <= args.held_out <= args.max_size:
        parser.error("--held-out must be one of the measured sizes (between --min-size and --max-size)")
    return args


def output_dir(args: argparse.Namespace) -> Path:
    return outputs.results_folder(args.output_dir, "network", refresh_results=args.refresh_results)


# ---------------------------------------------------------------------------- helpers
def load() -> float:
    return round(os.getloadavg()[0], 2)


def rate_gbps(rate: str) -> float:
    return vcluster._rate_bits(rate) / 1e9  # noqa: SLF001 - the one parser of tc rates


def link_GBps(rate: str) -> float:  # noqa: N802 - GB/s, as the bench reports
    return rate_gbps(rate) / 8


@contextlib.contextmanager
def cluster(nodes: int, rate: str | None) -> Iterator[vcluster.VCluster]:
    """A virtual cluster that is removed whatever happens, SIGTERM (an outer timeout) included."""
    reason = vcluster.missing_requirements()
    if reason:
        raise UsageError(reason)
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    made = vcluster.up(nodes, name=f"nb{os.getpid() % 10000}", rate=rate)
    try:
        yield made
    finally:
        made.down()
        signal.signal(signal.SIGTERM, previous)


def launch(made: vcluster.VCluster, ranks: int, entry: str, words: Sequence[str], timeout: float,
           mpi_args: str = "") -> subprocess.CompletedProcess[str]:
    """launch/mpirun.sh on the cluster; the whole process group is killed after ``timeout`` s."""
    argv = [str(REPO / "launch" / "mpirun.sh"), "--vcluster", made.name, "-np", str(ranks), "--abort-grace", "10",
            "--entry", entry]
    if mpi_args:
        argv[1:1] = ["--mpi-args", mpi_args]
    env = {**os.environ, **ENV, "PATH": f"{REPO / '.venv' / 'bin'}:{os.environ.get('PATH', '')}"}
    child = subprocess.Popen([*argv, "--", *words], cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        out, err = child.communicate()
        return subprocess.CompletedProcess(argv, 124, out, err + f"\n(killed after {timeout:.0f} s)")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(argv, child.returncode, out, err)


def tx_bytes(made: vcluster.VCluster) -> list[int]:
    """Bytes each node's eth0 has sent so far."""
    counts = []
    for node in made.nodes:
        raw = subprocess.run(["ip", "-n", node.namespace, "-s", "-j", "link", "show", "eth0"], text=True,
                             capture_output=True, check=True, timeout=10).stdout
        counts.append(int(json.loads(raw)[0]["stats64"]["tx"]["bytes"]))
    return counts


def say(text: str) -> None:
    print(text, flush=True)


# ---------------------------------------------------------------------------- phases
def iperf(made: vcluster.VCluster, both_ways: bool, seconds: int = 4) -> dict[str, Any]:
    server_node, client_node = made.nodes[1], made.nodes[0]
    server = made.popen(server_node, ["iperf3", "-s", "-1", "-B", server_node.address], stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        argv = ["iperf3", "-c", server_node.address, "-t", str(seconds), "-J", *(["--bidir"] if both_ways else [])]
        before = load()
        done = made.run(client_node, argv, timeout=seconds + 30)
        result = json.loads(done.stdout)
        if "error" in result:
            raise UsageError(f"iperf3: {result['error']}")
        end = result["end"]
        if both_ways:
            gbps = [end["sum_received"]["bits_per_second"] / 1e9, end["sum_received_bidir_reverse"]["bits_per_second"]
                    / 1e9]
        else:
            gbps = [end["sum_received"]["bits_per_second"] / 1e9]
        retransmits = end.get("sum_sent", {}).get("retransmits")
        return {"both_ways": both_ways, "gbps": gbps, "retransmits": retransmits, "load": [before, load()]}
    finally:
        server.kill()
        server.wait()


def phase_links(args: argparse.Namespace, out: Path) -> None:
    if shutil.which("iperf3") is None:
        raise UsageError("iperf3 is missing (apt-get install -y iperf3)")
    results = []
    for rate in args.rates:
        with cluster(2, rate) as made:
            for both in (False, True):
                result = {"rate": rate, **iperf(made, both)}
                say(f"links {rate} {'both ways' if both else 'one way'}: "
                    f"{' + '.join(f'{g:.3f}' for g in result['gbps'])} Gbit/s (load {result['load']})")
                results.append(result)
    save_json(out / "net_links", {"what": "iperf3 TCP goodput between two virtual nodes", "runs": results})


def probe_variants(all_algorithms: bool) -> list[tuple[str, str, str]]:
    """(label, pattern, Open MPI arguments) of the probe phase; each forced algorithm only if asked."""
    dynamic = "--mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_allreduce_algorithm"
    variants = [("one way", "oneway", ""), ("both ways (Sendrecv)", "sendrecv", ""),
                ("both ways, put off", "sendrecv", NO_PUT), ("allreduce, Open MPI's choice", "allreduce", ""),
                ("allreduce, put off", "allreduce", NO_PUT)]
    if all_algorithms:
        variants += [(f"allreduce, {n} {name}", "allreduce", f"{dynamic} {n}") for n, name in ALGORITHMS.items()]
        variants += [("allreduce, 4 ring + put off", "allreduce", f"{dynamic} 4 {NO_PUT}")]
    return variants


def probe_row(made: vcluster.VCluster, args: argparse.Namespace, rate: str | None, label: str, pattern: str,
              mpi_args: str) -> dict[str, Any] | None:
    """One probe run, with the bytes each node sent per call (eth0 counters around the run)."""
    before = tx_bytes(made)
    words = ["--size", str(args.probe_size), "--calls", str(args.probe_calls), "--pattern", pattern]
    done = launch(made, len(made.nodes), "hpcdl.bench.probe", words, 180, mpi_args)
    sent = [b - a for a, b in zip(before, tx_bytes(made), strict=True)]
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        say(f"probe {rate} {label}: FAILED (exit {done.returncode}): {done.stderr.strip()[-300:]}")
        return None
    row = {**json.loads(lines[-1]), "rate": rate or "unshaped", "nodes": len(made.nodes), "label": label,
           "mpi_args": mpi_args, "bytes_sent_per_node_per_call": [s / (args.probe_calls + 1) for s in sent]}
    share = f" = {row['median_busbw_GBps'] / link_GBps(rate):.2f}x link" if rate else ""
    say(f"probe {row['rate']} {len(made.nodes)} nodes {label}: median {row['median_seconds'] * 1e3:.0f} ms, "
        f"{row['median_busbw_GBps']:.4f} GB/s{share}, cpu {row['median_cpu_seconds'] * 1e3:.0f} ms/call, "
        f"sent/node/call {' '.join(f'{b / 2**20:.1f}' for b in row['bytes_sent_per_node_per_call'])} MiB "
        f"(calls ms: {' '.join(f'{t * 1e3:.0f}' for t in row['seconds'])}; load {row['load_1min']})")
    return row


def phase_probe(args: argparse.Namespace, out: Path) -> None:
    results = []
    for rate in [*args.rates, None]:  # None: unshaped, where the CPU alone sets the pace
        with cluster(2, rate) as made:
            for label, pattern, mpi_args in probe_variants(all_algorithms=rate == args.rates[0]):
                row = probe_row(made, args, rate, label, pattern, mpi_args)
                if row:
                    results.append(row)
    save_json(out / "net_probe", {"size": args.probe_size, "calls": args.probe_calls, "runs": results})


def phase_volume(args: argparse.Namespace, out: Path) -> None:
    dynamic = "--mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_allreduce_algorithm"
    variants = [("allreduce, Open MPI's choice", ""), ("allreduce, put off", NO_PUT)]
    variants += [(f"allreduce, {n} {ALGORITHMS[n]}", f"{dynamic} {n}") for n in (3, 4, 6)]
    results = []
    for nodes in (n for n in args.nodes if n > 2):
        with cluster(nodes, args.rates[0]) as made:
            for label, mpi_args in variants:
                row = probe_row(made, args, args.rates[0], label, "allreduce", mpi_args)
                if row:
                    results.append(row)
    save_json(out / "net_volume", {"size": args.probe_size, "calls": args.probe_calls, "runs": results})


def phase_allreduce(args: argparse.Namespace, out: Path) -> None:
    """The benchmark for every rate and node count, and on the first rate MPI alone with TCP's put off."""
    runs = [(rate, nodes, "") for rate in args.rates for nodes in args.nodes]
    runs += [(args.rates[0], nodes, NO_PUT) for nodes in args.nodes]
    for rate, nodes, mpi_args in runs:
        name = f"net_{rate}_n{nodes}{'_noput' if mpi_args else ''}"
        words = ["--min-size", str(args.min_size), "--max-size", str(args.max_size), "--rounds", str(args.rounds),
                 "--seconds", "0.3", "--no-gloo", "--output-dir", str(out), "--name", name, "--force",
                 "--network-gbps", f"{rate_gbps(rate):g}", "--algorithms", *([] if mpi_args else ["ring"]),
                 *(["--no-horovod"] if mpi_args else [])]
        if outputs.is_committed(out / name):
            words.append("--refresh-results")
        with cluster(nodes, rate) as made:
            before = load()
            started = time.monotonic()
            done = launch(made, nodes, "hpcdl.bench.allreduce", words, 900, mpi_args)
        tail = "\n".join(line for line in done.stdout.splitlines()[-40:] if not line.startswith("  ") or "MiB" in line)
        say(f"allreduce {name}: exit {done.returncode} in {time.monotonic() - started:.0f} s, "
            f"load {before} -> {load()}\n{tail}")
        if done.returncode != 0:
            say(done.stderr.strip()[-800:])


def images_per_second(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row["images_per_second"] for row in rows[1:]]  # the first epoch pays start-up costs


def phase_fp16(args: argparse.Namespace, out: Path) -> None:
    results = []
    with cluster(2, args.fp16_rates[0]) as made, tempfile.TemporaryDirectory(prefix="hpcdl-net-fp16-") as scratch:
        for rate in args.fp16_rates:
            for node in made.nodes:  # re-shape both ends of every link, as vcluster up does
                vcluster.tbf(node.host_veth, rate)
                vcluster.tbf("eth0", rate, namespace=node.namespace)
            for index, fp16 in enumerate([False, True, True, False] * args.fp16_pairs):
                run_dir = Path(scratch) / f"{rate}-{index}"
                words = [*args.train_args.split(), "--output-dir", str(run_dir), "--no-progress",
                         *(["--fp16-allreduce"] if fp16 else [])]
                before = load()
                done = launch(made, 2, "hpcdl.train", words, 600)
                if done.returncode != 0:
                    say(f"fp16 {rate} fp16={fp16}: FAILED (exit {done.returncode}): {done.stderr.strip()[-400:]}")
                    continue
                speeds = images_per_second(run_dir)
                results.append({"rate": rate, "fp16_allreduce": fp16, "images_per_second": speeds,
                                "load": [before, load()]})
                say(f"fp16 {rate} fp16_allreduce={fp16}: {statistics.median(speeds):.0f} img/s "
                    f"(epochs after the first: {', '.join(f'{s:.0f}' for s in speeds)}; load {before} -> {load()})")
    save_json(out / "net_fp16", {"train_args": args.train_args, "ranks": "2 (one per node)", "runs": results})


# ---------------------------------------------------------------------------- report
def summarise(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Ratios to the link, the held-out alpha-beta check and the fp16 comparison, from the files in ``out``."""
    configs = []
    for rate in args.rates:
        for nodes in args.nodes:
            path = out / f"net_{rate}_n{nodes}.json"
            if not path.exists():
                continue
            document = json.loads(path.read_text())
            no_put = out / f"net_{rate}_n{nodes}_noput.json"
            if no_put.exists():  # MPI alone with TCP's emulated RDMA off: its own row
                document["rows"] += [{**row, "implementation": MPI_NO_PUT}
                                     for row in json.loads(no_put.read_text())["rows"]]
            link = link_GBps(rate)
            entry: dict[str, Any] = {"rate": rate, "nodes": nodes, "link_GBps": link,
                                     "load": document["meta"].get("load_average_1min"), "implementations": {}}
            for name in IMPLEMENTATIONS:
                rows = sorted((r for r in document["rows"] if r["implementation"] == name), key=lambda r: r["bytes"])
                if not rows:
                    continue
                sizes = [r["bytes"] for r in rows]
                seconds = [r["latency_us"] * 1e-6 for r in rows]
                impl: dict[str, Any] = {
                    "busbw_GBps": {str(r["bytes"]): r["busbw_GBps"] for r in rows},
                    "of_link": {str(r["bytes"]): r["busbw_GBps"] / link for r in rows},
                }
                if args.held_out in sizes and len(sizes) >= 3:
                    model, held = alphabeta.fit_and_hold_out(sizes, seconds, nodes, args.held_out)
                    impl["alpha_beta"] = {"alpha_us": model.alpha * 1e6, "bandwidth_GBps": model.bandwidth / 1e9,
                                          "held_out_bytes": held.nbytes, "measured_ms": held.measured * 1e3,
                                          "predicted_ms": held.predicted * 1e3, "error": held.error}
                entry["implementations"][name] = impl
            configs.append(entry)
    summary: dict[str, Any] = {"configs": configs}
    for extra in ("links", "probe", "volume", "fp16"):
        path = out / f"net_{extra}.json"
        if path.exists():
            summary[extra] = json.loads(path.read_text())
    return summary


def phase_report(args: argparse.Namespace, out: Path) -> None:
    save_json(out / "net_summary", summarise(args, out))
    say(f"wrote {out}/net_summary.json; benchmarks/figures.py makes network.md's tables from it")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    out = output_dir(args)
    say(f"# results in {out}; load {load()}")
    for phase in PHASES:
        if phase in args.phases:
            globals()[f"phase_{phase}"](args, out)


# ---- the figures the documents quote (benchmarks/figures.py): this study's, and those of the 2-rank runs of
# ---- hpcdl.bench.allreduce (allreduce.md) that its network runs stand beside

RATES = {"1gbit": "1 Gbit/s", "10gbit": "10 Gbit/s", "100mbit": "100 Mbit/s"}
MIB16, MIB32 = 16 << 20, 32 << 20


def _network_table() -> str:
    def pair(entry: dict[str, Any], name: str, sizes: Sequence[int] = (MIB16, MIB32)) -> str:
        ratios = entry["implementations"].get(name, {}).get("of_link", {})
        return " / ".join(f"{ratios[str(size)]:.2f}x" for size in sizes) if ratios else "-"

    rows = [(RATES[e["rate"]], e["nodes"], pair(e, "MPI.Allreduce", (MIB16,)), pair(e, "MPI.Allreduce", (MIB32,)),
             pair(e, "horovod"), pair(e, "ring"), pair(e, MPI_NO_PUT)) for e in results("net_summary")["configs"]]
    return table(["link", "nodes", "MPI 16 MiB", "MPI 32 MiB", "Horovod 16 / 32 MiB", "ring 16 / 32 MiB",
                  "MPI, TCP put off, 16 / 32 MiB"], rows)


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


def _network_best() -> str:
    entry = next(c for c in results("net_summary")["configs"] if (c["rate"], c["nodes"]) == ("1gbit", 2))
    return f"{entry['implementations']['MPI.Allreduce']['of_link'][str(MIB32)]:.2f}x"


ALLREDUCE_SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 8 << 20, 16 << 20, 64 << 20, 256 << 20)
ALLREDUCE_IMPLEMENTATIONS = ("MPI.Allreduce", "horovod", "torch.distributed (gloo)", "naive", "ring",
                             "recursive_doubling", "rabenseifner")
ALLREDUCE_RUNS = {"np2": "allreduce_np2", "cycle": "allreduce_np2_cycle0.03ms"}


def _bandwidth(value: float) -> str:
    """Two decimals from 0.1 GB/s up, two significant digits below (one under 0.01)."""
    return f"{value:.2f}" if value >= 0.1 else f"{value:.2g}" if value >= 0.01 else f"{value:.1g}"


def _right_aligned(text: str, columns: int, first: str = "---") -> str:
    """A table of :func:`figures.table` with its number columns right-aligned (all but the first)."""
    return text.replace("|" + " --- |" * columns, f"| {first} |" + " ---: |" * (columns - 1))


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
        lines.append((format_size(size), *cells))
    return _right_aligned(table(["size", *ALLREDUCE_IMPLEMENTATIONS], lines), len(ALLREDUCE_IMPLEMENTATIONS) + 1)


def _acceptance(name: str, who: str) -> str:
    entry = results(name)["acceptance"][who]
    ratios = {int(size): ratio for size, ratio in entry["ratios"].items()}
    lowest = min(ratios, key=lambda size: ratios[size])
    if entry["met"]:
        return f"**{entry['min_ratio']:.2f}** (met)"
    later = [r for size, r in ratios.items() if size > lowest]
    return (f"{entry['min_ratio']:.2f} at {format_size(lowest)} (not met); {min(later):.2f}–{max(later):.2f} "
            f"from {format_size(min(s for s in ratios if s > lowest))} up")


def _acceptance_table() -> str:
    rows = [(f"{label}, lowest ratio", f"≥ {results('allreduce_np2')['acceptance'][who]['target']:.2f}",
             *(_acceptance(name, who) for name in ALLREDUCE_RUNS.values()))
            for who, label in (("ring", "our ring"), ("horovod", "Horovod"))]
    return _right_aligned(table(["", "target", "default run", "`--horovod-cycle-time-ms 0.03`"], rows), 4)


def _fit() -> str:
    first, second = (results(name)["alpha_beta"]["fitted_here"] for name in ALLREDUCE_RUNS.values())
    return (f"α = {first['alpha_us']:.1f} µs per step, B = {first['bandwidth_GBps']:.1f} GB/s (default run; "
            f"{second['alpha_us']:.1f} µs and {second['bandwidth_GBps']:.1f} GB/s in the second)")


def _predictions() -> str:
    rows = [(f"{p['ranks']:,}", f"{p['ring_ms']:.1f}", f"{p['ring_bandwidth_term_ms']:.1f}",
             f"{p['ring_with_alpha_fitted_here_ms']:.1f}", f"{p['naive_ms']:,.0f}")
            for p in results("allreduce_np2")["alpha_beta"]["predictions"]]
    return _right_aligned(table(["ranks", "ring, assumed network (ms)", "of which bandwidth (ms)",
                                 "ring with α fitted here (ms)", "naive (ms)"], rows), 5, first="---:")


def _alpha_us() -> float:
    return float(results("allreduce_np2")["alpha_beta"]["fitted_here"]["alpha_us"])


def _naive_4096() -> str:
    prediction = next(p for p in results("allreduce_np2")["alpha_beta"]["predictions"] if p["ranks"] == 4096)
    return f"{prediction['naive_ms'] / 1000:.0f} s"


def _horovod() -> str:
    default, short = (results(name)["acceptance"]["horovod"]["min_ratio"] for name in ALLREDUCE_RUNS.values())
    return f"{default:.2f} with its default 1 ms cycle and {short:.2f} with a 0.03 ms one"


FIGURES = {
    "network.table": _network_table, "network.ab": _network_ab, "network.fp16": _network_fp16,
    "network.best": _network_best,
    **{f"allreduce.{key}.table": functools.partial(_allreduce_table, name) for key, name in ALLREDUCE_RUNS.items()},
    "allreduce.ring": lambda: f"{results('allreduce_np2')['acceptance']['ring']['min_ratio']:.2f}",
    "allreduce.horovod": _horovod, "allreduce.acceptance": _acceptance_table, "allreduce.fit": _fit,
    "allreduce.predictions": _predictions, "allreduce.alpha": lambda: f"{_alpha_us():.1f} µs",
    # the ring's 2(N-1)·α at 4,096 ranks with the α fitted here
    "allreduce.latency_term_4096": lambda: f"{2 * 4095 * _alpha_us() / 1000:.0f} ms",
    "allreduce.naive_4096": _naive_4096,
}


if __name__ == "__main__":
    run_main(main, "benchmarks/network.py")
